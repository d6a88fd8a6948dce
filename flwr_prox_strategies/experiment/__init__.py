"""The experiment layer: one run as a pipeline (compose, build, run, record), sweeps.

:mod:`.server` holds the pipeline's entry points, :mod:`.sweeps` runs it many
times. It needs the ``experiment`` extra (Hydra, flwr-datasets, scikit-learn,
matplotlib, Flower's simulation engine): importing it without them raises an
ImportError that says what to install.
"""

from .._optional import require_installed

require_installed(
    ("hydra", "omegaconf", "matplotlib", "sklearn", "datasets", "flwr_datasets"),
    "experiment",
    "flwr_prox_strategies.experiment",
)

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

# Keys of [tool.flwr.app.config] that `flwr run --run-config` may set. Here rather
# than in .config (which reads them) so the ClientApp (.appdir) names them without
# importing Hydra and the algorithms.
RUN_OVERRIDES = "overrides"
RUN_NUM_ROUNDS = "num-rounds"
RUN_SEED = "seed"
RUN_OUTPUT_DIR = "output-dir"
RUN_OUTPUT_ROOT = "output-root"
# A run's output folder to continue from its checkpoint (experiment/checkpoint.py).
RUN_RESUME = "resume"

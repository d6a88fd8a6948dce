"""Optional dependencies: imported where a feature is used, named when missing.

The base install (flwr, torch, numpy) is what the strategies and clients need.
Everything else comes with an extra of ``flwr-prox-strategies``:

* ``dp``: opacus (DP-SGD on clients);
* ``sdp``: cvxpy (the optimal mixing matrices of P-FedAvg, ``mixing="sdp"``);
* ``experiment``: Hydra, flwr-datasets, scikit-learn, matplotlib, Flower's
  simulation engine (the ``conf/`` tree, the reference data sets, plots, sweeps).

None of these is imported by ``import flwr_prox_strategies`` (opacus, for one,
calls ``logging.basicConfig`` at import).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

#: The distribution that provides each optional top-level module.
DISTRIBUTIONS = {
    "opacus": "opacus",
    "cvxpy": "cvxpy",
    "hydra": "hydra-core",
    "omegaconf": "omegaconf",
    "matplotlib": "matplotlib",
    "sklearn": "scikit-learn",
    "datasets": "datasets",
    "flwr_datasets": "flwr-datasets",
}


def missing_message(module: str, extra: str, feature: str) -> str:
    """Return the message of the ImportError for a missing optional ``module``."""
    top = module.split(".")[0]
    dist = DISTRIBUTIONS.get(top, top)
    return (
        f"{feature} needs {dist}, which is not installed: "
        f'pip install "flwr-prox-strategies[{extra}]"'
    )


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import and return ``module``, or raise an ImportError naming the extra.

    Parameters
    ----------
    module : str
        The module to import (``"cvxpy"``, ``"opacus.validators"``, ...).
    extra : str
        The extra of ``flwr-prox-strategies`` that installs it.
    feature : str
        What needs it, for the message.

    Raises
    ------
    ImportError
        When the module's top-level package is not installed. An ImportError
        raised *inside* an installed package (a broken install) propagates as
        it is.
    """
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as err:
        if err.name is not None and err.name.split(".")[0] != top:
            raise
        raise ImportError(missing_message(module, extra, feature)) from err


def require_installed(modules: tuple[str, ...], extra: str, feature: str) -> None:
    """Check that every module in ``modules`` is installed, without importing it.

    Raises
    ------
    ImportError
        Naming the first missing module's distribution and the extra.
    """
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise ImportError(missing_message(module, extra, feature))

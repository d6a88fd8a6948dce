"""Models, data sets and client partitions for the experiments.

``models`` holds the PyTorch classifiers, ``datasets`` the numpy loaders
(digits, Fashion-MNIST, UCI Adult), ``synthetic`` the FedProx paper's generated
federations and ``partition`` the splitting of a data set among clients
(flwr-datasets' partitioners, the official FedDyn/FedDC rules, a file, the clients
a data set was generated for).
"""

from typing import TYPE_CHECKING, Any

from .datasets import (
    ArrayDataset,
    TrainTest,
    adult_matrix,
    load_adult,
    load_dataset,
    load_digits,
    load_fashion_mnist,
)
from .partition import SCHEMES as _SCHEMES
from .partition import (
    file_partition,
    label_histogram,
    natural_partition,
    official_dirichlet_partition,
    official_iid_partition,
    partition_dataset,
    partition_indices,
)
from .synthetic import load_synthetic

if TYPE_CHECKING:  # torch: loaded on first use (__getattr__ below)
    from .models import CNN, MLP, LogisticRegression, PaperLogistic

SCHEMES = _SCHEMES
"""The partition schemes :func:`partition_dataset` knows, by name.

``"iid"`` (seeded-shuffled rows, sizes differing by at most one),
``"dirichlet"`` (each class split over the clients by a Dirichlet draw of
concentration ``alpha``), ``"inner-dirichlet"`` (FedDyn's scheme: a Dirichlet
class prior per client, partition sizes equal or lognormal) and
``"pathological"`` (``classes_per_partition`` classes per client), all by
flwr-datasets' partitioners.
"""

_MODELS = ("CNN", "MLP", "LogisticRegression", "PaperLogistic")


def __getattr__(name: str) -> Any:
    """Load the models (and torch) on first use: a ServerApp needs neither."""
    if name not in _MODELS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import models

    return getattr(models, name)


__all__ = [
    "CNN",
    "MLP",
    "SCHEMES",
    "ArrayDataset",
    "LogisticRegression",
    "PaperLogistic",
    "TrainTest",
    "adult_matrix",
    "file_partition",
    "label_histogram",
    "load_adult",
    "load_dataset",
    "load_digits",
    "load_fashion_mnist",
    "load_synthetic",
    "natural_partition",
    "official_dirichlet_partition",
    "official_iid_partition",
    "partition_dataset",
    "partition_indices",
]

"""Models, data sets and client partitions for the experiments.

``models`` holds the PyTorch classifiers, ``datasets`` the numpy loaders
(digits, Fashion-MNIST, UCI Adult), ``synthetic`` the FedProx paper's generated
federations and ``partition`` the splitting of a data set among clients
(flwr-datasets' partitioners, the official FedDyn/FedDC rules, a file, the clients
a data set was generated for).
"""

from .datasets import (
    ArrayDataset,
    TrainTest,
    adult_matrix,
    load_adult,
    load_dataset,
    load_digits,
    load_fashion_mnist,
)
from .models import CNN, MLP, LogisticRegression
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

SCHEMES = _SCHEMES
"""The partition schemes :func:`partition_dataset` knows, by name.

``"iid"`` (seeded-shuffled rows, sizes differing by at most one),
``"dirichlet"`` (each class split over the clients by a Dirichlet draw of
concentration ``alpha``), ``"inner-dirichlet"`` (FedDyn's scheme: a Dirichlet
class prior per client, partition sizes equal or lognormal) and
``"pathological"`` (``classes_per_partition`` classes per client), all by
flwr-datasets' partitioners.
"""

__all__ = [
    "CNN",
    "MLP",
    "SCHEMES",
    "ArrayDataset",
    "LogisticRegression",
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

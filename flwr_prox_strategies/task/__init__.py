"""Models, data sets and client partitions for the experiments.

``models`` holds the PyTorch classifiers, ``datasets`` the numpy loaders
(digits, Fashion-MNIST, UCI Adult) and ``partition`` the splitting of a data set among
clients (flwr-datasets' partitioners, the official FedDyn/FedDC rules, a file).
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
from .partition import (
    SCHEMES,
    file_partition,
    label_histogram,
    official_dirichlet_partition,
    official_iid_partition,
    partition_dataset,
    partition_indices,
)

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
    "official_dirichlet_partition",
    "official_iid_partition",
    "partition_dataset",
    "partition_indices",
]

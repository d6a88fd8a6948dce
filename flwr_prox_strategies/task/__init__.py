"""Models, data sets and client partitions for the experiments.

``models`` holds the PyTorch classifiers, ``datasets`` the numpy loaders
(digits, Fashion-MNIST, UCI Adult) and ``partition`` the flwr-datasets based
splitting of a data set among clients.
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
    label_histogram,
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
    "label_histogram",
    "load_adult",
    "load_dataset",
    "load_digits",
    "load_fashion_mnist",
    "partition_dataset",
    "partition_indices",
]

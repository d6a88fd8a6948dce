"""A data set as the pack sees it: numpy features and labels, split in train and test.

The rest of the pack only sees :class:`ArrayDataset` and :class:`TrainTest`, so
it does not depend on a data set library. Features are float32 of shape
``(n, num_features)`` (images flattened and scaled to [0, 1]) and labels int64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """Features and labels of a classification data set.

    Parameters
    ----------
    x : np.ndarray
        Features, converted to contiguous float32 of shape ``(n, features)``.
    y : np.ndarray
        Labels, converted to int64 of shape ``(n,)``, each in
        ``[0, num_classes)``.
    num_classes : int
        Number of classes of the task (not necessarily all present in ``y``).

    Raises
    ------
    ValueError
        If ``x`` is not 2-D, ``y`` is not 1-D of the same length, ``y`` holds
        non-integer labels or labels outside ``[0, num_classes)``, or
        ``num_classes < 1``.
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        """Coerce dtypes and check shapes."""
        x = np.ascontiguousarray(self.x, dtype=np.float32)
        y = np.asarray(self.y)
        if x.ndim != 2:
            raise ValueError(f"x must be 2-D (n, features), got shape {x.shape}")
        if y.ndim != 1 or len(y) != len(x):
            raise ValueError(f"y must have shape ({len(x)},), got {y.shape}")
        if y.size and not np.issubdtype(y.dtype, np.integer):
            raise ValueError(f"y must hold integer labels, got dtype {y.dtype}")
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        y = y.astype(np.int64)
        if y.size and (y.min() < 0 or y.max() >= self.num_classes):
            raise ValueError(f"y must lie in [0, num_classes={self.num_classes})")
        # The dataclass is frozen; this is the documented way to normalise fields.
        object.__setattr__(self, "x", x)
        object.__setattr__(self, "y", y)

    def __len__(self) -> int:
        """Return the number of samples."""
        return len(self.y)

    @property
    def num_features(self) -> int:
        """Number of features per sample."""
        return int(self.x.shape[1])

    def subset(self, indices: Sequence[int] | np.ndarray) -> ArrayDataset:
        """Return the samples at ``indices`` (integer indices or boolean mask).

        Parameters
        ----------
        indices : Sequence[int] or np.ndarray
            Row indices, or a boolean mask of length ``len(self)``.

        Returns
        -------
        ArrayDataset
            A copy holding the selected rows, in the given order.
        """
        idx = np.asarray(indices)
        if idx.dtype != np.bool_:
            # An empty list comes in as float64; it still selects nothing.
            idx = idx.astype(np.int64)
        return ArrayDataset(x=self.x[idx], y=self.y[idx], num_classes=self.num_classes)


@dataclass(frozen=True, eq=False)
class TrainTest:
    """A named train/test pair of :class:`ArrayDataset`.

    Parameters
    ----------
    train, test : ArrayDataset
        The two splits, with the same feature count and number of classes.
    name : str
        Name of the data set (``"digits"``, ``"fashion-mnist"``, ``"adult"``).
    num_features : int
        Number of features per sample.
    num_classes : int
        Number of classes.
    train_owners, test_owners : np.ndarray or None (default: None)
        For a data set generated per client (the FedProx paper's synthetic
        federations), the client each training and test sample belongs to
        (int64, one per sample, clients numbered from 0); ``partition=natural``
        splits the training set by them. None for a pooled data set.

    Raises
    ------
    ValueError
        If an owners array is not one integer per sample of its split.
    """

    train: ArrayDataset
    test: ArrayDataset
    name: str
    num_features: int
    num_classes: int
    train_owners: np.ndarray | None = None
    test_owners: np.ndarray | None = None

    def __post_init__(self) -> None:
        """Check the owners arrays against their splits."""
        for field_name, split in (
            ("train_owners", self.train),
            ("test_owners", self.test),
        ):
            owners = getattr(self, field_name)
            if owners is None:
                continue
            owners = np.asarray(owners)
            if owners.shape != (len(split),) or not (
                owners.size == 0 or np.issubdtype(owners.dtype, np.integer)
            ):
                raise ValueError(
                    f"{field_name} must hold one integer per sample "
                    f"({len(split)}), got shape {owners.shape} and dtype {owners.dtype}"
                )
            if owners.size and owners.min() < 0:
                raise ValueError(f"{field_name} must be >= 0")
            object.__setattr__(self, field_name, owners.astype(np.int64))

    @property
    def num_owners(self) -> int | None:
        """Number of natural clients (None for a pooled data set)."""
        if self.train_owners is None:
            return None
        return int(self.train_owners.max()) + 1 if self.train_owners.size else 0

"""Split a labelled data set among federated clients.

The partitions come from flwr-datasets partitioners, applied to an in-memory
``datasets.Dataset`` that holds only the labels and the row indices, so any
numpy data set can be partitioned the way Flower's examples partition hub data
sets. Results depend only on the labels and the arguments: the same seed gives
the same partitions.

Other rules need no flwr-datasets: the official FedDyn/FedDC code's split
(:mod:`.official`), a split read from a file of client ids and the clients a data
set was generated for (:mod:`.owners`); all are importable from here. Every
partition function is called as ``fn(labels, *, num_partitions, seed,
**params)`` and returns one index array per partition; a function with an
``owners`` parameter also gets the data set's client of every sample (None for
a pooled data set).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._optional import require_installed
from ..ops.checks import check_choice, check_int, check_non_negative, check_positive
from .datasets import ArrayDataset
from .official import (
    _check_partition_count,
    _label_array,
    official_dirichlet_partition,
    official_iid_partition,
)
from .owners import PARTITION_FILE_KEY, file_partition, natural_partition

__all__ = [
    "CLASS_ASSIGNMENT_MODES",
    "PARTITION_FILE_KEY",
    "SCHEMES",
    "file_partition",
    "label_histogram",
    "natural_partition",
    "official_dirichlet_partition",
    "official_iid_partition",
    "partition_dataset",
    "partition_indices",
]

logger = logging.getLogger(__name__)

#: The schemes :func:`partition_dataset` knows (flwr-datasets' partitioners).
SCHEMES = ("iid", "dirichlet", "inner-dirichlet", "pathological")
#: The ``class_assignment_mode`` values of the pathological scheme.
CLASS_ASSIGNMENT_MODES = ("first-deterministic", "random", "deterministic")

# flwr-datasets' DirichletPartitioner gives up after 11 draws; it is re-run with
# derived seeds this many times before the minimum size is declared infeasible.
_DIRICHLET_RESEEDS = 10
# Default minimum partition size of the Dirichlet scheme (flwr-datasets' own
# default), lowered for small data sets so that it stays reachable.
_DIRICHLET_MIN_SIZE = 10


# --------------------------------------------------------------------- validation


def _dense_labels(labels: np.ndarray | Sequence[int]) -> np.ndarray:
    """Return labels as int64 ranks 0..C-1 of their sorted distinct values."""
    array = _label_array(labels)
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {array.dtype}")
    # InnerDirichletPartitioner assumes the classes are exactly 0..C-1.
    _, dense = np.unique(array, return_inverse=True)
    return dense.astype(np.int64)


def _resolve_min_size(
    min_partition_size: int | None, num_samples: int, num_partitions: int, scheme: str
) -> int:
    """Return the minimum partition size, checking that it is reachable."""
    if min_partition_size is None:
        if scheme != "dirichlet":
            return 1 if scheme == "inner-dirichlet" else 0
        fair_share = num_samples // (4 * num_partitions)
        return max(1, min(_DIRICHLET_MIN_SIZE, fair_share))
    size = check_int("min_partition_size", min_partition_size, 0)
    if size * num_partitions > num_samples:
        raise ValueError(
            f"min_partition_size={size} times num_partitions={num_partitions} "
            f"exceeds the {num_samples} samples"
        )
    return size


# ------------------------------------------------------------------ flwr-datasets


def _label_table(labels: np.ndarray, rows: np.ndarray) -> Any:
    """Return a ``datasets.Dataset`` with columns ``label`` and ``idx``."""
    # Imported lazily: ``datasets`` takes seconds to import and only this needs it.
    import datasets

    table = datasets.Dataset.from_dict({"label": labels, "idx": rows})
    # Arrow format: the partitioners' column reads then convert to numpy in one
    # go, where the default format iterates row by row (seconds for 60k rows).
    return table.with_format("arrow")


def _collect(partitioner: Any, table: Any, num_partitions: int) -> list[np.ndarray]:
    """Attach ``table`` to ``partitioner`` and return each partition's row indices."""
    partitioner.dataset = table
    return [
        np.asarray(partitioner.load_partition(pid)[:]["idx"], dtype=np.int64)
        for pid in range(num_partitions)
    ]


def _label_partitioner(name: str, **options: Any) -> Any:
    """Return flwr-datasets' partitioner ``name`` by ``label``, rows in their order."""
    from flwr_datasets import partitioner

    return getattr(partitioner, name)(partition_by="label", shuffle=False, **options)


def _derived_seed(seed: int, stream: int) -> int:
    """Return an independent 32-bit seed for sub-stream ``stream`` of ``seed``."""
    return int(np.random.SeedSequence([seed, stream]).generate_state(1)[0])


def _iid(labels: np.ndarray, num_partitions: int, seed: int) -> list[np.ndarray]:
    from flwr_datasets.partitioner import IidPartitioner

    # IidPartitioner cuts contiguous shards: shuffle the rows first.
    order = np.random.default_rng(seed).permutation(len(labels))
    table = _label_table(labels[order], order)
    return _collect(
        IidPartitioner(num_partitions=num_partitions), table, num_partitions
    )


def _dirichlet(
    labels: np.ndarray, num_partitions: int, seed: int, alpha: float, min_size: int
) -> list[np.ndarray]:
    table = _label_table(labels, np.arange(len(labels)))
    error: ValueError | None = None
    for attempt in range(_DIRICHLET_RESEEDS):
        partitioner = _label_partitioner(
            "DirichletPartitioner",
            num_partitions=num_partitions,
            alpha=alpha,
            min_partition_size=min_size,
            self_balancing=False,
            # Attempt 0 uses the seed itself, matching a plain flwr-datasets run.
            seed=seed if attempt == 0 else _derived_seed(seed, attempt),
        )
        try:
            with warnings.catch_warnings():
                # It warns at each redraw; the outcome is logged below instead.
                warnings.filterwarnings("ignore", message="The specified min_partition")
                return _collect(partitioner, table, num_partitions)
        # Arguments were validated above, so a ValueError here is its
        # "max number of attempts" give-up.
        except ValueError as err:
            error = err
            logger.debug("Dirichlet attempt %d failed: %s", attempt, err)
    raise ValueError(
        f"min_partition_size={min_size} was not reached with alpha={alpha} and "
        f"num_partitions={num_partitions} ({len(labels)} samples) in "
        f"{_DIRICHLET_RESEEDS * 11} Dirichlet draws; lower min_partition_size or "
        "num_partitions, or raise alpha"
    ) from error


def _partition_sizes(
    num_samples: int, num_partitions: int, sigma: float, min_size: int, seed: int
) -> np.ndarray:
    """Return sizes summing to ``num_samples``: equal, or lognormal as in FedDyn.

    Every partition first gets ``min_size`` samples; the rest is shared in
    proportion to equal weights (``sigma == 0``) or to lognormal(0, sigma)
    draws, rounded by largest remainder so that the sizes sum exactly.
    """
    if sigma > 0:
        weights = np.random.default_rng(_derived_seed(seed, 0)).lognormal(
            0.0, sigma, num_partitions
        )
    else:
        weights = np.ones(num_partitions)
    spare = num_samples - min_size * num_partitions
    shares = spare * weights / weights.sum()
    sizes = np.floor(shares).astype(np.int64)
    leftover = spare - int(sizes.sum())
    # Stable sort: with equal weights the first partitions get the extra samples.
    sizes[np.argsort(sizes - shares, kind="stable")[:leftover]] += 1
    return sizes + min_size


def _inner_dirichlet(
    labels: np.ndarray,
    *,
    num_partitions: int,
    seed: int,
    alpha: float,
    min_size: int,
    sigma: float,
) -> list[np.ndarray]:
    sizes = _partition_sizes(len(labels), num_partitions, sigma, min_size, seed)
    partitioner = _label_partitioner(
        "InnerDirichletPartitioner", partition_sizes=sizes, alpha=alpha, seed=seed
    )
    table = _label_table(labels, np.arange(len(labels)))
    try:
        # A client whose prior mass sits only on exhausted classes makes the
        # partitioner renormalise 0/0; that surfaces as a NaN ValueError below.
        with np.errstate(invalid="ignore", divide="ignore"):
            return _collect(partitioner, table, num_partitions)
    except ValueError as err:
        raise ValueError(
            f"inner-dirichlet sampling failed with alpha={alpha}: a client's class "
            "prior ran out of samples; raise alpha or change the seed"
        ) from err


def _pathological(
    labels: np.ndarray, num_partitions: int, seed: int, classes: int, mode: str
) -> list[np.ndarray]:
    num_classes = int(labels.max()) + 1
    if classes > num_classes:
        raise ValueError(
            f"classes_per_partition={classes} exceeds the {num_classes} classes present"
        )
    partitioner = _label_partitioner(
        "PathologicalPartitioner",
        num_partitions=num_partitions,
        num_classes_per_partition=classes,
        class_assignment_mode=mode,
        seed=seed,
    )
    table = _label_table(labels, np.arange(len(labels)))
    with warnings.catch_warnings():
        # Unused classes are reported once below with the sample count.
        warnings.filterwarnings("ignore", message="Classes: ")
        parts = _collect(partitioner, table, num_partitions)
    missing = len(labels) - sum(len(p) for p in parts)
    if missing:
        logger.warning(
            "pathological partitioning leaves %d of %d samples unassigned "
            "(classes given to no partition)",
            missing,
            len(labels),
        )
    return parts


# ------------------------------------------------------------------------ public


def partition_indices(
    labels: np.ndarray | Sequence[int],
    *,
    num_partitions: int,
    scheme: str = "iid",
    seed: int = 0,
    alpha: float = 0.3,
    classes_per_partition: int = 2,
    min_partition_size: int | None = None,
    size_sigma: float = 0.0,
    class_assignment_mode: str = "first-deterministic",
) -> list[np.ndarray]:
    """Split sample indices among ``num_partitions`` clients.

    Parameters
    ----------
    labels : np.ndarray or Sequence[int]
        Integer class label of every sample (any distinct values).
    num_partitions : int
        Number of partitions (clients), at most ``len(labels)``.
    scheme : str, default "iid"
        ``"iid"``, ``"dirichlet"``, ``"inner-dirichlet"`` or ``"pathological"``.
        ``"iid"``: IidPartitioner on seeded-shuffled rows (sizes differ by at
        most one). ``"dirichlet"``: DirichletPartitioner (per-class Dirichlet
        split over clients, Hsu et al. 2019 / Yurochkin et al. 2019), without
        self-balancing. ``"inner-dirichlet"``: InnerDirichletPartitioner
        (FedDyn's scheme: a Dirichlet class prior per client, with partition
        sizes equal or lognormal). ``"pathological"``: PathologicalPartitioner
        (each client holds ``classes_per_partition`` classes).
    seed : int, default 0
        Seed of every random choice.
    alpha : float, default 0.3
        Dirichlet concentration (``"dirichlet"``, ``"inner-dirichlet"``);
        smaller is more skewed.
    classes_per_partition : int, default 2
        Classes per client for ``"pathological"``.
    min_partition_size : int or None, default None
        Minimum samples per partition. ``"dirichlet"`` redraws until it is
        met (default ``min(10, len(labels) // (4 * num_partitions))``, at
        least 1) and raises ``ValueError`` if it cannot be met;
        ``"inner-dirichlet"`` reserves it before sharing out the rest (default
        1); ``"iid"`` and ``"pathological"`` only check it is feasible.
    size_sigma : float, default 0.0
        ``"inner-dirichlet"`` only: sigma of the lognormal partition sizes;
        0 gives equal sizes.
    class_assignment_mode : str, default "first-deterministic"
        ``"pathological"`` only: how classes are dealt to partitions,
        ``"first-deterministic"``, ``"random"`` or ``"deterministic"`` (see
        flwr-datasets). With ``"first-deterministic"`` and at least as many
        partitions as classes every sample is assigned; otherwise classes given
        to no partition are left out (a warning is logged).

    Returns
    -------
    list of np.ndarray
        One sorted int64 index array per partition; the arrays are disjoint.

    Raises
    ------
    ValueError
        If an argument is out of range (naming it: ``num_partitions`` above
        the number of samples, an unknown ``scheme``, a negative ``seed``,
        ``alpha`` not > 0, ...), or ``min_partition_size`` cannot be met.
    ImportError
        If flwr-datasets is not installed (the ``[experiment]`` extra).
    """
    dense = _dense_labels(labels)
    num_partitions = _check_partition_count(num_partitions, len(dense))
    check_choice("scheme", scheme, SCHEMES)
    seed = check_int("seed", seed, 0)
    alpha = check_positive("alpha", alpha)
    classes = check_int("classes_per_partition", classes_per_partition, 1)
    sigma = check_non_negative("size_sigma", size_sigma)
    check_choice("class_assignment_mode", class_assignment_mode, CLASS_ASSIGNMENT_MODES)
    min_size = _resolve_min_size(min_partition_size, len(dense), num_partitions, scheme)
    require_installed(
        ("datasets", "flwr_datasets"), "experiment", "partitioning (flwr-datasets)"
    )

    if scheme == "iid":
        parts = _iid(dense, num_partitions, seed)
    elif scheme == "dirichlet":
        parts = _dirichlet(dense, num_partitions, seed, alpha, min_size)
    elif scheme == "inner-dirichlet":
        parts = _inner_dirichlet(
            dense,
            num_partitions=num_partitions,
            seed=seed,
            alpha=alpha,
            min_size=min_size,
            sigma=sigma,
        )
    else:
        parts = _pathological(
            dense, num_partitions, seed, classes, class_assignment_mode
        )
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def partition_dataset(data: ArrayDataset, **options: Any) -> list[ArrayDataset]:
    """Split ``data`` among clients by its labels ``data.y``.

    Parameters
    ----------
    data : ArrayDataset
        Data set to split.
    **options
        Keyword arguments of :func:`partition_indices` (``num_partitions``,
        ``scheme``, ``seed``, ``alpha``, ...).

    Returns
    -------
    list of ArrayDataset
        One data set per partition, rows in their original order.

    Raises
    ------
    ValueError, ImportError
        As :func:`partition_indices`.
    """
    return [data.subset(idx) for idx in partition_indices(data.y, **options)]


def label_histogram(
    labels: np.ndarray | Sequence[int],
    parts: Sequence[np.ndarray],
    num_classes: int,
) -> np.ndarray:
    """Count the samples of each class in each partition.

    Parameters
    ----------
    labels : np.ndarray or Sequence[int]
        Labels in ``[0, num_classes)`` of the partitioned data set.
    parts : Sequence[np.ndarray]
        Index arrays, e.g. from :func:`partition_indices`.
    num_classes : int
        Number of classes (columns of the result).

    Returns
    -------
    np.ndarray
        int64 counts of shape ``(len(parts), num_classes)``.

    Raises
    ------
    ValueError
        If ``num_classes`` is not an integer >= 1, or ``labels`` is not a 1-D
        integer array in ``[0, num_classes)``.
    """
    num_classes = check_int("num_classes", num_classes, 1)
    y = np.asarray(labels)
    if y.ndim != 1 or (y.size and not np.issubdtype(y.dtype, np.integer)):
        raise ValueError("labels must be a 1-D integer array")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, num_classes={num_classes})")
    counts = np.zeros((len(parts), num_classes), dtype=np.int64)
    for row, idx in enumerate(parts):
        counts[row] = np.bincount(
            y[np.asarray(idx, dtype=np.int64)], minlength=num_classes
        )
    return counts

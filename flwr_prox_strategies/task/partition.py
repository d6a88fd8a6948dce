"""Split a labelled data set among federated clients.

The partitions come from flwr-datasets partitioners, applied to an in-memory
``datasets.Dataset`` that holds only the labels and the row indices, so any
numpy data set can be partitioned the way Flower's examples partition hub data
sets. Results depend only on the labels and the arguments: the same seed gives
the same partitions.

Two more rules need no flwr-datasets: the official FedDyn/FedDC code's split
(:func:`official_dirichlet_partition`, :func:`official_iid_partition`), index
for index, a split read from a file of client ids (:func:`file_partition`), and
the clients a data set was generated for (:func:`natural_partition`). Every
partition function is called as ``fn(labels, *, num_partitions, seed,
**params)`` and returns one index array per partition; a function with an
``owners`` parameter also gets the data set's client of every sample (None for
a pooled data set).
"""

from __future__ import annotations

import bisect
import logging
import os
import re
import warnings
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._optional import require_installed
from ..ops.checks import check_choice, check_int, check_non_negative, check_positive
from .datasets import ArrayDataset

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
    array = np.asarray(labels)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(
            f"labels must be a non-empty 1-D array, got shape {array.shape}"
        )
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
    from flwr_datasets.partitioner import DirichletPartitioner

    table = _label_table(labels, np.arange(len(labels)))
    error: ValueError | None = None
    for attempt in range(_DIRICHLET_RESEEDS):
        partitioner = DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=alpha,
            min_partition_size=min_size,
            self_balancing=False,
            shuffle=False,
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
    from flwr_datasets.partitioner import InnerDirichletPartitioner

    sizes = _partition_sizes(len(labels), num_partitions, sigma, min_size, seed)
    partitioner = InnerDirichletPartitioner(
        partition_sizes=sizes,
        partition_by="label",
        alpha=alpha,
        shuffle=False,
        seed=seed,
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
    from flwr_datasets.partitioner import PathologicalPartitioner

    num_classes = int(labels.max()) + 1
    if classes > num_classes:
        raise ValueError(
            f"classes_per_partition={classes} exceeds the {num_classes} classes present"
        )
    partitioner = PathologicalPartitioner(
        num_partitions=num_partitions,
        partition_by="label",
        num_classes_per_partition=classes,
        class_assignment_mode=mode,
        shuffle=False,
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
    num_partitions = check_int("num_partitions", num_partitions, 1)
    if num_partitions > len(dense):
        raise ValueError(
            f"num_partitions={num_partitions} exceeds the {len(dense)} samples"
        )
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


# ------------------------------------------------- the official FedDyn/FedDC rules

# Largest block of uniforms drawn at once while a client's class is redrawn.
_OFFICIAL_MAX_BLOCK = 1 << 20
# Below this probability the official loop would redraw ~1/p times: it hangs.
_OFFICIAL_MIN_DRAWABLE_MASS = 1e-9


def _official_labels(
    labels: np.ndarray | Sequence[int], num_classes: int | None
) -> tuple[np.ndarray, int]:
    """Return labels as int64 in ``[0, C)`` and ``C``, checked, not remapped."""
    array = np.asarray(labels)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(
            f"labels must be a non-empty 1-D array, got shape {array.shape}"
        )
    if not np.issubdtype(array.dtype, np.integer) or array.min() < 0:
        raise ValueError("labels must be non-negative integers (class 0..C-1)")
    array = array.astype(np.int64)
    if num_classes is None:
        return array, int(array.max()) + 1
    num_classes = check_int("num_classes", num_classes, 1)
    if array.max() >= num_classes:
        raise ValueError(f"labels must lie in [0, num_classes={num_classes})")
    return array, num_classes


def _official_rng(seed: int) -> np.random.RandomState:
    """Return the legacy generator ``np.random.seed(seed)`` would set up."""
    seed = check_int("seed", seed, 0)
    if seed >= 2**32:
        raise ValueError(
            f"seed must be below 2**32 (numpy's legacy seeding), got {seed}"
        )
    return np.random.RandomState(seed)


def _check_partition_count(num_partitions: int, num_samples: int) -> int:
    num_partitions = check_int("num_partitions", num_partitions, 1)
    if num_partitions > num_samples:
        raise ValueError(
            f"num_partitions={num_partitions} exceeds the {num_samples} samples"
        )
    return num_partitions


def _official_client_sizes(
    num_samples: int, num_partitions: int, sigma: float, rng: np.random.RandomState
) -> np.ndarray:
    """Return the client sizes of FedDC's ``DatasetObject``, drawn from ``rng``.

    Lognormal draws around the mean size (drawn even when ``sigma == 0``, which
    moves the generator on), scaled to the data set and truncated to integers;
    the shortfall (or excess) goes to the first client that can absorb it. With
    ``sigma == 0`` the scaled sizes can fall just short of the exact quotient
    (2000 / 10 gives 199.99999999999997): every client then gets one sample
    less and client 0 the rest (209, 199, ..., 199), as in the official code.
    """
    mean_size = int(num_samples / num_partitions)
    draws = rng.lognormal(mean=np.log(mean_size), sigma=sigma, size=num_partitions)
    # Same float expression as the official code: the truncation depends on it.
    sizes = (draws / np.sum(draws) * num_samples).astype(np.int64)
    excess = int(sizes.sum()) - num_samples
    if excess != 0:
        absorbers = np.flatnonzero(sizes > excess)
        if absorbers.size:
            sizes[absorbers[0]] -= excess
    return sizes


def _drawable_mass(pools: Sequence[list[int]], bounds: Sequence[float]) -> float:
    """Probability that one official class draw hits a class with samples left."""
    lower = [0.0, *bounds[:-1]]
    mass = sum(b - a for a, b, pool in zip(lower, bounds, pools, strict=True) if pool)
    # A uniform above the last cumulative prior selects class 0 (argmax of all False).
    return mass + (max(0.0, 1.0 - bounds[-1]) if pools[0] else 0.0)


def _official_class(bounds: list[float], uniform: float) -> int:
    """Return the official ``np.argmax(uniform <= prior_cumsum)``.

    ``bisect_left`` finds the first class whose cumulative prior is
    ``>= uniform``; past the last bound nothing is true and argmax gives 0.
    """
    label = bisect.bisect_left(bounds, uniform)
    return 0 if label == len(bounds) else label


def _redraw_class_in_blocks(
    pools: list[list[int]],
    bounds: list[float],
    rng: np.random.RandomState,
    client: int,
) -> int:
    """Continue the official redraw loop with vectorised draws, on the same stream.

    A block of uniforms is drawn at once; when one selects a class with samples
    left, the generator is rewound and moved on by exactly the draws the
    one-at-a-time loop makes (``random_sample(k)`` is ``k`` scalar draws).
    """
    mass = _drawable_mass(pools, bounds)
    if mass < _OFFICIAL_MIN_DRAWABLE_MASS:
        raise ValueError(
            f"official-dirichlet: client {client}'s class prior gives probability "
            f"{mass:.3g} to the classes that have samples left, so the official "
            "loop would not end; change the seed or raise alpha"
        )
    has_samples = np.array([bool(pool) for pool in pools])
    edges = np.asarray(bounds)
    block = 64
    while True:
        state = rng.get_state()
        labels = np.searchsorted(edges, rng.random_sample(block), side="left")
        labels[labels == len(edges)] = 0
        hits = np.flatnonzero(has_samples[labels])
        if hits.size:
            rng.set_state(state)
            rng.random_sample(hits[0] + 1)
            return int(labels[hits[0]])
        block = min(4 * block, _OFFICIAL_MAX_BLOCK)


def _draw_official_sample(
    pools: list[list[int]],
    bounds: list[float],
    rng: np.random.RandomState,
    client: int,
) -> int:
    """Draw a class from the client's prior, redrawn while it has no samples left.

    Returns the class's last remaining sample (removed from its pool).
    """
    label = _official_class(bounds, rng.random_sample())
    if not pools[label]:
        label = _redraw_class_in_blocks(pools, bounds, rng, client)
    return pools[label].pop()


def _official_dirichlet_fill(
    pools: list[list[int]],
    sizes: np.ndarray,
    cumulative_priors: np.ndarray,
    rng: np.random.RandomState,
) -> list[np.ndarray]:
    """Run the official assignment loop; return each client's samples in slot order.

    A random client is drawn (redrawn while full); it gets one sample of a class
    drawn from its prior. The official code fills a client's slots from the last
    to the first, so each list is reversed at the end.
    """
    room = [int(size) for size in sizes]
    bounds = [row.tolist() for row in cumulative_priors]
    received: list[list[int]] = [[] for _ in room]
    remaining = sum(room)
    if remaining > sum(len(pool) for pool in pools):
        raise ValueError("official-dirichlet: client sizes exceed the samples")
    while remaining > 0:
        client = int(rng.randint(len(room)))
        if room[client] <= 0:
            continue
        room[client] -= 1
        remaining -= 1
        received[client].append(
            _draw_official_sample(pools, bounds[client], rng, client)
        )
    return [np.asarray(samples[::-1], dtype=np.int64) for samples in received]


def official_dirichlet_partition(
    labels: np.ndarray | Sequence[int],
    *,
    num_partitions: int,
    seed: int = 0,
    alpha: float = 0.3,
    size_sigma: float = 0.0,
    num_classes: int | None = None,
) -> list[np.ndarray]:
    """Split indices exactly as the FedDC/FedDyn code's ``'Drichlet'`` rule.

    Reproduces ``DatasetObject`` of ``utils_dataset.py`` in
    github.com/gaoliang13/FedDC, index for index for the same seed and data
    order: ``np.random.seed(seed)``; a permutation of the training set; client
    sizes (lognormal draws; with ``size_sigma == 0`` equal up to the official
    float truncation, the remainder going to client 0); a Dirichlet(alpha)
    class prior per client; then, until every client is full, a random non-full
    client receives the last remaining sample of a class drawn from its prior
    (redrawn while that class is exhausted). Only a local
    ``np.random.RandomState`` is used, never the global generator.

    Parameters
    ----------
    labels : np.ndarray or Sequence[int]
        Class (``0..C-1``) of every training sample, in the data set's original
        order (e.g. torchvision's): the official code permutes it itself.
    num_partitions : int
        Number of clients (the official ``n_client``).
    seed : int, default 0
        The official ``seed``, below ``2**32``.
    alpha : float, default 0.3
        Dirichlet concentration of the class priors (the official ``rule_arg``).
    size_sigma : float, default 0.0
        Lognormal sigma of the client sizes (the official ``unbalanced_sgm``).
    num_classes : int or None, default None
        Number of classes (the official ``n_cls``), default ``max(labels) + 1``.

    Returns
    -------
    list of np.ndarray
        Per client, int64 indices into ``labels`` in the official client's
        sample order (not sorted): entry ``k`` is the official ``clnt_x[c][k]``.

    Raises
    ------
    ValueError
        On invalid arguments, or when a client's prior gives (almost) no
        probability to the classes left, where the official loop would hang.

    References
    ----------
    Official code of FedDC (github.com/gaoliang13/FedDC, ``utils_dataset.py``),
    the same rule as FedDyn's (github.com/alpemreacar/FedDyn).
    """
    array, num_classes = _official_labels(labels, num_classes)
    num_partitions = _check_partition_count(num_partitions, len(array))
    alpha = check_positive("alpha", alpha)
    sigma = check_non_negative("size_sigma", size_sigma)
    rng = _official_rng(seed)
    order = rng.permutation(len(array))
    sizes = _official_client_sizes(len(array), num_partitions, sigma, rng)
    priors = rng.dirichlet(alpha=[alpha] * num_classes, size=num_partitions)
    shuffled = array[order]
    pools = [order[shuffled == label].tolist() for label in range(num_classes)]
    return _official_dirichlet_fill(pools, sizes, np.cumsum(priors, axis=1), rng)


def official_iid_partition(
    labels: np.ndarray | Sequence[int],
    *,
    num_partitions: int,
    seed: int = 0,
    size_sigma: float = 0.0,
) -> list[np.ndarray]:
    """Split indices exactly as the FedDC/FedDyn code's ``'iid'`` rule.

    ``np.random.seed(seed)``, a permutation of the training set, the official
    client sizes (with ``size_sigma == 0`` equal up to the official float
    truncation, the remainder going to client 0), then consecutive slices
    of the permuted order. It differs from flwr-datasets' IID (``iid``) in the
    generator and in where the remainder goes. The official code's special
    case for CIFAR-100 (class-balanced clients) is not reproduced.

    Parameters
    ----------
    labels : np.ndarray or Sequence[int]
        Labels of the training set in its original order (only their number
        is used).
    num_partitions : int
        Number of clients.
    seed : int, default 0
        The official ``seed``, below ``2**32``.
    size_sigma : float, default 0.0
        Lognormal sigma of the client sizes (the official ``unbalanced_sgm``).

    Returns
    -------
    list of np.ndarray
        Per client, int64 indices into ``labels`` in the official sample order.

    Raises
    ------
    ValueError
        If ``num_partitions`` is not an integer in ``1 .. len(labels)``,
        ``seed`` is not in ``0 .. 2**32 - 1`` or ``size_sigma`` is negative.

    References
    ----------
    Official code of FedDC (github.com/gaoliang13/FedDC, ``utils_dataset.py``),
    the same rule as FedDyn's (github.com/alpemreacar/FedDyn).
    """
    num_samples = len(np.asarray(labels))
    num_partitions = _check_partition_count(num_partitions, num_samples)
    sigma = check_non_negative("size_sigma", size_sigma)
    rng = _official_rng(seed)
    order = rng.permutation(num_samples).astype(np.int64)
    sizes = _official_client_sizes(num_samples, num_partitions, sigma, rng)
    edges = np.concatenate(([0], np.cumsum(sizes)))
    return [order[edges[c] : edges[c + 1]] for c in range(num_partitions)]


# ------------------------------------------------------------ partition from a file

# Key of the client ids in an ``.npz`` file holding more than one array.
PARTITION_FILE_KEY = "partition"
_PARTITION_FILE_TYPES = (".npy", ".npz", ".csv")


def _read_npz_ids(path: Path) -> np.ndarray:
    with np.load(path, allow_pickle=False) as archive:
        if PARTITION_FILE_KEY in archive.files:
            return np.asarray(archive[PARTITION_FILE_KEY])
        if len(archive.files) == 1:
            return np.asarray(archive[archive.files[0]])
        raise ValueError(
            f"partition file {path} holds arrays {archive.files}: save one array, "
            f"or the client ids under the key {PARTITION_FILE_KEY!r}"
        )


def _read_csv_ids(path: Path) -> np.ndarray:
    """Read one integer per line; a first line not starting with a digit is a header."""
    lines = [line.strip() for line in path.read_text().splitlines()]
    numbers = [(row, text) for row, text in enumerate(lines, start=1) if text]
    if numbers and not re.match(r"[+-]?\d", numbers[0][1]):
        numbers = numbers[1:]
    ids = []
    for row, text in numbers:
        try:
            ids.append(int(text))
        except ValueError:
            raise ValueError(
                f"partition file {path}, line {row}: {text!r} is not an integer "
                "client id (one integer per line)"
            ) from None
    return np.asarray(ids, dtype=np.int64)


def _read_client_ids(path: Path) -> np.ndarray:
    """Load the raw client-id array of ``path`` (``.npy``, ``.npz`` or ``.csv``)."""
    if not path.is_file():
        raise ValueError(f"partition file {path} does not exist or is not a file")
    suffix = path.suffix.lower()
    if suffix not in _PARTITION_FILE_TYPES:
        raise ValueError(
            f"partition file {path}: unsupported type {suffix!r}, use one of "
            f"{', '.join(_PARTITION_FILE_TYPES)}"
        )
    try:
        if suffix == ".npy":
            return np.asarray(np.load(path, allow_pickle=False))
        if suffix == ".npz":
            return _read_npz_ids(path)
        return _read_csv_ids(path)
    except (OSError, EOFError, UnicodeDecodeError, zipfile.BadZipFile) as err:
        raise ValueError(f"partition file {path} cannot be read: {err}") from err
    except ValueError as err:
        if str(path) in str(err):
            raise
        raise ValueError(f"partition file {path} cannot be read: {err}") from err


def _integer_client_ids(raw: np.ndarray, path: Path) -> np.ndarray:
    """Return ``raw`` as a 1-D int64 array, refusing non-integer or negative ids."""
    ids = raw.reshape(-1) if raw.ndim == 2 and 1 in raw.shape else raw
    if ids.ndim != 1:
        raise ValueError(
            f"partition file {path}: expected one client id per training index "
            f"(a 1-D array), got shape {raw.shape}"
        )
    if np.issubdtype(ids.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(ids) | (ids != np.round(ids)))
        if bad.size:
            raise ValueError(
                f"partition file {path}: non-integer client id {float(ids[bad[0]])} "
                f"at index {bad[0]}"
            )
    elif ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"partition file {path}: client ids must be integers, got dtype {ids.dtype}"
        )
    ids = ids.astype(np.int64)
    negative = np.flatnonzero(ids < 0)
    if negative.size:
        raise ValueError(
            f"partition file {path}: negative client id {ids[negative[0]]} at index "
            f"{negative[0]}"
        )
    return ids


def _check_client_ids(
    ids: np.ndarray,
    path: Path,
    *,
    num_samples: int,
    num_partitions: int,
    allow_empty: bool,
) -> None:
    """Refuse ids that do not give every training index one of the clients."""
    if len(ids) != num_samples:
        raise ValueError(
            f"partition file {path} has {len(ids)} client ids but the training set "
            f"has {num_samples} samples (one id per training index, in its order)"
        )
    if ids.max() >= num_partitions:
        raise ValueError(
            f"partition file {path} has client ids up to {ids.max()} "
            f"({len(np.unique(ids))} distinct) but num_partitions={num_partitions}: "
            f"ids must be 0..{num_partitions - 1}"
        )
    empty = np.flatnonzero(np.bincount(ids, minlength=num_partitions) == 0)
    if empty.size and not allow_empty:
        raise ValueError(
            f"partition file {path}: client ids are not contiguous "
            f"0..{num_partitions - 1}, clients {empty[:10].tolist()} have no samples "
            "(empty clients); set allow_empty=true to accept them"
        )


def file_partition(
    labels: np.ndarray | Sequence[int],
    *,
    num_partitions: int,
    path: str | os.PathLike[str],
    seed: int = 0,
    allow_empty: bool = False,
) -> list[np.ndarray]:
    """Split indices as a file says: one client id per training index.

    Runs another library's split exactly: save its client id of every training
    sample, in the training set's order, and pass the file.

    Parameters
    ----------
    labels : np.ndarray or Sequence[int]
        Labels of the training set (only their number is used).
    num_partitions : int
        Number of clients; the ids must be ``0..num_partitions-1``.
    path : str or os.PathLike
        ``.npy`` (one 1-D integer array), ``.npz`` (one array, or the key
        ``"partition"``) or ``.csv`` (one integer per line, optional header
        line). A relative path is relative to the process's working directory;
        every process that builds a client reads it.
    seed : int, default 0
        Unused: the file fixes the split.
    allow_empty : bool, default False
        Accept clients with no samples (ids in ``0..num_partitions-1`` that
        the file does not use).

    Returns
    -------
    list of np.ndarray
        Sorted int64 indices of each client's samples.

    Raises
    ------
    ValueError
        Naming the file and the problem: missing or unreadable, unsupported
        type, non-integer or negative ids, a length other than the number of
        labels, ids beyond ``num_partitions - 1``, or empty clients.
    """
    del seed
    num_samples = len(np.asarray(labels))
    num_partitions = _check_partition_count(num_partitions, num_samples)
    file = Path(os.path.expanduser(os.fspath(path)))
    ids = _integer_client_ids(_read_client_ids(file), file)
    _check_client_ids(
        ids,
        file,
        num_samples=num_samples,
        num_partitions=num_partitions,
        allow_empty=bool(allow_empty),
    )
    return [np.flatnonzero(ids == client) for client in range(num_partitions)]


def natural_partition(
    labels: np.ndarray | Sequence[int],
    *,
    num_partitions: int,
    owners: np.ndarray | None,
    seed: int = 0,
) -> list[np.ndarray]:
    """Split indices by the client each sample was generated for.

    The data set itself says who owns what (``TrainTest.train_owners``: the
    FedProx paper's synthetic federations); the pack's pipeline passes it to
    any partition function with an ``owners`` parameter.

    Parameters
    ----------
    labels : np.ndarray or Sequence[int]
        Labels of the training set (only their number is used).
    num_partitions : int
        Number of clients: must equal the data set's number of clients.
    owners : np.ndarray or None
        The client of every training sample; None when the data set has none.
    seed : int, default 0
        Unused: the data fixes the split.

    Returns
    -------
    list of np.ndarray
        Sorted int64 indices of each client's samples.

    Raises
    ------
    ValueError
        If the data set has no natural clients, or ``num_partitions`` is not
        their number (the message says which value to set).
    """
    del seed
    if owners is None:
        raise ValueError(
            "partition=natural needs a data set generated per client (dataset="
            "synthetic); this data set is pooled: choose another partition"
        )
    owners = np.asarray(owners, dtype=np.int64)
    if len(owners) != len(np.asarray(labels)):
        raise ValueError(
            f"owners has {len(owners)} entries for {len(np.asarray(labels))} samples"
        )
    count = int(owners.max()) + 1 if owners.size else 0
    if num_partitions != count:
        raise ValueError(
            f"partition=natural: the data set has {count} clients, but "
            f"num_partitions={num_partitions}; set num_clients={count} (and "
            "num_partitions, if you set it)"
        )
    return [np.flatnonzero(owners == client) for client in range(count)]

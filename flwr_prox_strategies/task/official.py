"""The official FedDyn/FedDC code's splits, index for index.

:func:`official_dirichlet_partition` and :func:`official_iid_partition` redo
``DatasetObject`` of ``utils_dataset.py`` (github.com/gaoliang13/FedDC) on a local
``np.random.RandomState``, never the global generator.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from ..ops.checks import check_int, check_non_negative, check_positive

# Largest block of uniforms drawn at once while a client's class is redrawn.
_OFFICIAL_MAX_BLOCK = 1 << 20
# Below this probability the official loop would redraw ~1/p times: it hangs.
_OFFICIAL_MIN_DRAWABLE_MASS = 1e-9


def _label_array(labels: np.ndarray | Sequence[int]) -> np.ndarray:
    """Return ``labels`` as an array, refusing one that is empty or not 1-D."""
    array = np.asarray(labels)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(
            f"labels must be a non-empty 1-D array, got shape {array.shape}"
        )
    return array


def _official_labels(
    labels: np.ndarray | Sequence[int], num_classes: int | None
) -> tuple[np.ndarray, int]:
    """Return labels as int64 in ``[0, C)`` and ``C``, checked, not remapped."""
    array = _label_array(labels)
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

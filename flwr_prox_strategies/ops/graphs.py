r"""Overlay graphs of P-FedAvg's parameter servers: built, read from a user, checked.

A graph is a symmetric 0/1 adjacency matrix with zero diagonal. Every
constructor here returns a *connected* graph and rejects a disconnected one,
because mixing over the edges (:mod:`.mixing`) reaches consensus only on a
connected graph. The edge list and incidence matrix serve the mixing-matrix
optimisation (:mod:`.sdp`).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

TOPOLOGIES = (
    "ring",
    "star",
    "grid",
    "torus",
    "complete",
    "random-regular",
    "erdos-renyi",
)


# Which keyword parameters each topology understands; anything else is a mistake
# (e.g. a degree given to a ring) and is reported rather than silently ignored.
_PARAMETERS = {
    "ring": (),
    "star": (),
    "grid": ("rows",),
    "torus": ("rows",),
    "complete": (),
    "random-regular": ("degree",),
    "erdos-renyi": ("probability",),
}
# Random graphs are redrawn until connected. A random d-regular graph (d >= 3) is
# connected with high probability; a 2-regular one is a union of cycles, a single
# cycle with probability falling like 1/sqrt(M) (a few dozen draws at M = 1000).
_RANDOM_REGULAR_ATTEMPTS = 1000
_ERDOS_RENYI_ATTEMPTS = 1000


def _cycle(n: int) -> NDArray[np.bool_]:
    """Adjacency of the cycle on ``n`` nodes (one edge for 2, none for 1)."""
    adj = np.zeros((n, n), dtype=bool)
    nodes = np.arange(n)
    adj[nodes, (nodes + 1) % n] = True
    adj |= adj.T
    np.fill_diagonal(adj, False)  # n = 1 would otherwise loop onto itself
    return adj


def _path(n: int) -> NDArray[np.bool_]:
    """Adjacency of the path on ``n`` nodes."""
    adj = np.zeros((n, n), dtype=bool)
    nodes = np.arange(n - 1)
    adj[nodes, nodes + 1] = True
    return adj | adj.T


def _cartesian_product(
    first: NDArray[np.bool_], second: NDArray[np.bool_]
) -> NDArray[np.bool_]:
    """Cartesian graph product; node ``(r, c)`` is ``r * len(second) + c``."""
    rows, cols = len(first), len(second)
    product = np.kron(first, np.eye(cols, dtype=bool)) | np.kron(
        np.eye(rows, dtype=bool), second
    )
    return product.astype(bool)


def grid_shape(servers: int, rows: int | None = None) -> tuple[int, int]:
    r"""Rows and columns of a grid of ``servers`` nodes.

    Parameters
    ----------
    servers : int
        Number of nodes :math:`M`.
    rows : int, optional
        Number of rows; must divide ``servers``. Default: the most square
        factorisation (the largest divisor of :math:`M` not above
        :math:`\sqrt M`), so a prime :math:`M` gives a single row.

    Returns
    -------
    tuple of int
        ``(rows, cols)`` with ``rows * cols == servers``.
    """
    if not (isinstance(servers, int | np.integer) and servers >= 1):
        raise ValueError(f"servers must be an integer >= 1, got {servers!r}")
    if rows is None:
        divisors = np.arange(1, int(np.sqrt(servers)) + 1)
        rows = int(divisors[servers % divisors == 0].max())
    if not (isinstance(rows, int | np.integer) and 1 <= rows <= servers):
        raise ValueError(f"rows must be an integer in [1, servers], got {rows!r}")
    if servers % rows:
        raise ValueError(f"rows={rows} does not divide servers={servers}")
    return int(rows), servers // int(rows)


def _random_regular_draw(
    servers: int, degree: int, rng: np.random.Generator
) -> NDArray[np.bool_] | None:
    """One attempt at a simple ``degree``-regular graph, or None if stuck.

    Pairing stubs gets stuck near the end when the graph is dense, so a dense
    graph is drawn as the complement of a sparse ``(M - 1 - degree)``-regular one.
    """
    complement_degree = servers - 1 - degree
    if complement_degree < degree:
        sparse = _pair_stubs(servers, complement_degree, rng)
        if sparse is None:
            return None
        dense = ~sparse
        np.fill_diagonal(dense, False)
        return dense
    return _pair_stubs(servers, degree, rng)


def _pair_stubs(
    servers: int, degree: int, rng: np.random.Generator
) -> NDArray[np.bool_] | None:
    """Pair ``degree`` stubs per node into a simple graph, or None if stuck.

    Stubs are paired one edge at a time. The node with the most free stubs goes
    first (ties broken at random) because it is the one that could run out of
    admissible partners; its partner is drawn with probability proportional to
    its free stubs, among nodes it is not yet joined to.
    """
    free = np.full(servers, degree)
    adj = np.zeros((servers, servers), dtype=bool)
    while free.any():
        node = rng.choice(np.flatnonzero(free == free.max()))
        allowed = (free > 0) & ~adj[node]
        allowed[node] = False
        if not allowed.any():
            return None
        weights = np.where(allowed, free, 0).astype(float)
        partner = rng.choice(servers, p=weights / weights.sum())
        adj[node, partner] = adj[partner, node] = True
        free[[node, partner]] -= 1
    return adj


def _random_regular(
    servers: int, degree: int | None, rng: np.random.Generator
) -> NDArray[np.bool_]:
    if degree is None:
        raise ValueError("random-regular needs degree")
    if not (isinstance(degree, int | np.integer) and 1 <= degree <= servers - 1):
        raise ValueError(
            f"degree must be an integer in [1, servers - 1] = [1, {servers - 1}], "
            f"got {degree!r}"
        )
    if servers * degree % 2:
        raise ValueError(
            f"servers * degree must be even (each edge uses two stubs), got "
            f"{servers} * {degree}"
        )
    if degree == 1 and servers > 2:
        raise ValueError(
            "degree=1 pairs the servers into disjoint edges, a disconnected graph "
            "for servers > 2; use degree >= 2"
        )
    for _ in range(_RANDOM_REGULAR_ATTEMPTS):
        adj = _random_regular_draw(servers, int(degree), rng)
        if adj is not None and is_connected(adj):
            return adj
    raise ValueError(
        f"no connected {degree}-regular graph on {servers} servers found in "
        f"{_RANDOM_REGULAR_ATTEMPTS} draws; use a larger degree"
    )


def _erdos_renyi(
    servers: int, probability: float | None, rng: np.random.Generator
) -> NDArray[np.bool_]:
    if probability is None:
        raise ValueError("erdos-renyi needs probability")
    if not (np.isfinite(probability) and 0 < probability <= 1):
        raise ValueError(f"probability must be in (0, 1], got {probability!r}")
    for _ in range(_ERDOS_RENYI_ATTEMPTS):
        upper = np.triu(rng.random((servers, servers)) < probability, k=1)
        adj = upper | upper.T
        if is_connected(adj):
            return adj
    threshold = np.log(servers) / servers
    raise ValueError(
        f"erdos-renyi with probability={probability} gave no connected graph in "
        f"{_ERDOS_RENYI_ATTEMPTS} draws; connectivity needs probability above "
        f"about ln(M)/M = {threshold:.3g}"
    )


def adjacency(
    kind: str,
    servers: int,
    *,
    degree: int | None = None,
    probability: float | None = None,
    rows: int | None = None,
    seed: int = 0,
) -> NDArray[np.int_]:
    r"""Adjacency matrix of a connected overlay graph of the servers.

    Parameters
    ----------
    kind : str
        One of :data:`TOPOLOGIES`: ``"ring"`` (a single edge for 2 servers),
        ``"star"`` (server 0 is the hub), ``"grid"`` (rows x cols, no
        wrap-around), ``"torus"`` (grid with wrap-around), ``"complete"``,
        ``"random-regular"`` (every server has ``degree`` neighbours) or
        ``"erdos-renyi"`` (each edge independently with ``probability``).
        Random graphs are redrawn until connected.
    servers : int
        Number of servers :math:`M \ge 2`.
    degree : int, optional
        Degree of ``"random-regular"`` (``servers * degree`` even).
    probability : float, optional
        Edge probability of ``"erdos-renyi"``, in (0, 1].
    rows : int, optional
        Rows of ``"grid"``/``"torus"`` (must divide ``servers``); default the
        most square factorisation. Node ``(r, c)`` has index ``r * cols + c``.
    seed : int
        Seed of the random graphs.

    Returns
    -------
    ndarray of int, shape (servers, servers)
        Symmetric 0/1 matrix with zero diagonal.

    Raises
    ------
    ValueError
        Unknown ``kind``, a parameter the kind does not take or a bad value,
        or no connected graph (mixing needs a connected graph).
    """
    if kind not in TOPOLOGIES:
        raise ValueError(f"kind must be one of {TOPOLOGIES}, got {kind!r}")
    if not (isinstance(servers, int | np.integer) and servers >= 2):
        raise ValueError(f"servers must be an integer >= 2, got {servers!r}")
    given = {"degree": degree, "probability": probability, "rows": rows}
    foreign = [
        name
        for name, value in given.items()
        if value is not None and name not in _PARAMETERS[kind]
    ]
    if foreign:
        raise ValueError(f"{kind!r} does not take {', '.join(foreign)}")

    rng = np.random.default_rng(seed)
    adj: NDArray[np.bool_]
    if kind == "ring":
        adj = _cycle(servers)
    elif kind == "star":
        adj = np.zeros((servers, servers), dtype=bool)
        adj[0, 1:] = adj[1:, 0] = True
    elif kind in ("grid", "torus"):
        n_rows, n_cols = grid_shape(servers, rows)
        line = _path if kind == "grid" else _cycle
        adj = _cartesian_product(line(n_rows), line(n_cols))
    elif kind == "complete":
        adj = ~np.eye(servers, dtype=bool)
    elif kind == "random-regular":
        adj = _random_regular(servers, degree, rng)
    else:
        adj = _erdos_renyi(servers, probability, rng)
    return from_adjacency(adj)


def is_connected(adj: ArrayLike) -> bool:
    r"""Whether the graph with adjacency ``adj`` is connected.

    Breadth-first search, one frontier per step (:math:`O(M^2)` in total).
    Non-zero entries are edges, read as undirected (``adj | adj.T``).

    Parameters
    ----------
    adj : array_like, shape (M, M)
        Adjacency matrix, :math:`M \ge 1`.

    Returns
    -------
    bool
    """
    matrix = np.asarray(adj)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.size == 0:
        raise ValueError(
            f"adj must be a non-empty square matrix, got shape {matrix.shape}"
        )
    linked = (matrix != 0) | (matrix.T != 0)
    reached = np.zeros(len(linked), dtype=bool)
    reached[0] = True
    frontier = reached.copy()
    while frontier.any():
        frontier = linked[frontier].any(axis=0) & ~reached
        reached |= frontier
    return bool(reached.all())


def from_adjacency(matrix: ArrayLike) -> NDArray[np.int_]:
    """Validate a user-given adjacency matrix and return it as ints.

    Parameters
    ----------
    matrix : array_like, shape (M, M)
        Must be square, 0/1 (bool, int or float), symmetric, with zero
        diagonal, and describe a connected graph.

    Returns
    -------
    ndarray of int, shape (M, M)

    Raises
    ------
    ValueError
        Naming the first property ``matrix`` violates.
    """
    adj = np.asarray(matrix)
    if adj.ndim != 2 or adj.shape[0] != adj.shape[1] or adj.size == 0:
        raise ValueError(
            f"matrix must be a non-empty square matrix, got shape {adj.shape}"
        )
    if not np.isin(adj, (0, 1)).all():
        raise ValueError("matrix entries must be 0 or 1")
    adj = adj.astype(int)
    if np.diagonal(adj).any():
        raise ValueError("matrix must have a zero diagonal (no self loops)")
    if not np.array_equal(adj, adj.T):
        raise ValueError("matrix must be symmetric (an undirected graph)")
    if not is_connected(adj):
        raise ValueError(
            "matrix must describe a connected graph: mixing cannot reach "
            "consensus across components"
        )
    return adj


def is_complete(adj: NDArray[np.int_]) -> bool:
    """Whether ``adj`` (as :func:`from_adjacency` returns it) is the complete graph."""
    return bool(adj.sum() == len(adj) * (len(adj) - 1))


def edges(adj: NDArray[np.int_]) -> tuple[NDArray[np.intp], NDArray[np.intp]]:
    """Return ``heads, tails``: edge ``e`` joins ``heads[e] < tails[e]``.

    ``adj`` is an adjacency as :func:`from_adjacency` returns it; the edges come
    in row-major order, as two arrays of intp of shape (E,).
    """
    heads, tails = np.nonzero(np.triu(adj, k=1))
    return heads, tails


def incidence(adj: NDArray[np.int_]) -> NDArray[np.float64]:
    """Oriented incidence matrix B, column e = e_i - e_j for edge e = (i, j).

    Parameters
    ----------
    adj : ndarray of int, shape (M, M)
        Adjacency as returned by :func:`from_adjacency`.

    Returns
    -------
    ndarray of float64, shape (M, E)
        Columns in the order of :func:`edges`.
    """
    heads, tails = edges(adj)
    matrix = np.zeros((len(adj), len(heads)))
    columns = np.arange(len(heads))
    matrix[heads, columns] = 1.0
    matrix[tails, columns] = -1.0
    return matrix

r"""Overlay graphs of the parameter servers and their mixing (gossip) matrices.

P-FedAvg runs :math:`M` parameter servers on an undirected, connected overlay
graph with 0/1 adjacency :math:`A` (symmetric, zero diagonal) and degrees
:math:`d_i = \sum_j A_{ij}`. After aggregating its clients, server :math:`i`
mixes with its neighbours,

.. math::
    x_i = \sum_j W_{ij}\, y_j,

with :math:`W` symmetric, :math:`W\mathbf 1 = \mathbf 1` (so doubly stochastic)
and :math:`W_{ij} = 0` whenever :math:`i \ne j` and :math:`A_{ij} = 0`. With
:math:`J = \mathbf 1\mathbf 1^\top / M`, the mean is preserved and the
disagreement obeys :math:`x - \bar x = (W - J)(y - \bar y)`, so it shrinks at
least by the factor

.. math::
    \rho(W) = \lVert W - J \rVert_2 = \max\bigl(\lambda_2(W), -\lambda_M(W)\bigr)

per round (the second equality holds because :math:`W` is symmetric and
:math:`\mathbf 1` is its eigenvector of eigenvalue 1). Smaller is faster;
:math:`\rho < 1` needs a connected graph, which is why every constructor here
rejects disconnected graphs.

Mixing matrices (``MIXINGS``)
-----------------------------
metropolis
    :math:`W_{ij} = 1 / (1 + \max(d_i, d_j))` on edges, the diagonal takes the
    rest of the row. Needs only the neighbours' degrees; non-negative.
max-degree
    :math:`W_{ij} = 1 / (1 + d_{\max})` on edges, diagonal the rest.
uniform
    :math:`W = J`, only valid on the complete graph (:math:`\rho = 0`).
sdp, sdp-signed
    The fastest mixing matrix on the graph (Xiao & Boyd, *Fast linear
    iterations for distributed averaging*, 2004): minimise :math:`\rho(W)` over
    the matrices above, with :math:`W \ge 0` entrywise for ``sdp``. See
    :func:`optimal_mixing` for the semidefinite programme.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._optional import require

TOPOLOGIES = (
    "ring",
    "star",
    "grid",
    "torus",
    "complete",
    "random-regular",
    "erdos-renyi",
)
MIXINGS = ("metropolis", "max-degree", "uniform", "sdp", "sdp-signed")

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
# Mixing takes ~ 1 / (1 - rho) rounds, so the SDP answer is called inaccurate only
# when its W mixes more than this fraction slower than the solver's bound says.
# Clarabel usually lands within 1e-7 of the optimum, but on long rings (1 - rho
# ~ 1e-3) the banded basis of _edge_sdp_weights is ill-conditioned and the rate
# can be off by ~1e-5, under 1 % of the gap.
_SDP_GAP_TOLERANCE = 0.01


# --------------------------------------------------------------------- graphs


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


def _is_complete(adj: NDArray[np.int_]) -> bool:
    return bool(adj.sum() == len(adj) * (len(adj) - 1))


# --------------------------------------------------------------------- mixing


def _fill_diagonal(off_diagonal: NDArray[np.float64]) -> NDArray[np.float64]:
    """Set the diagonal so that every row sums to one."""
    mixing = off_diagonal.copy()
    np.fill_diagonal(mixing, 0.0)
    np.fill_diagonal(mixing, 1.0 - mixing.sum(axis=1))
    return mixing


def mixing_matrix(adj: ArrayLike, method: str = "metropolis") -> NDArray[np.float64]:
    """Symmetric doubly stochastic mixing matrix supported on the graph.

    Parameters
    ----------
    adj : array_like, shape (M, M)
        Adjacency of a connected graph (validated by :func:`from_adjacency`).
    method : str
        One of :data:`MIXINGS` (see the module docstring): ``"metropolis"``,
        ``"max-degree"``, ``"uniform"`` (complete graph only), ``"sdp"``
        (fastest non-negative) or ``"sdp-signed"`` (fastest, entries may be
        negative).

    Returns
    -------
    ndarray of float64, shape (M, M)
    """
    graph = from_adjacency(adj)
    if method not in MIXINGS:
        raise ValueError(f"method must be one of {MIXINGS}, got {method!r}")
    degrees = graph.sum(axis=1)
    if method == "metropolis":
        return _fill_diagonal(graph / (1.0 + np.maximum.outer(degrees, degrees)))
    if method == "max-degree":
        return _fill_diagonal(graph / (1.0 + degrees.max()))
    if method == "uniform":
        if not _is_complete(graph):
            raise ValueError(
                "method='uniform' (W = 11^T/M) needs the complete graph; use "
                "'metropolis' or 'sdp' on other graphs"
            )
        return np.full(graph.shape, 1.0 / len(graph))
    return optimal_mixing(graph, nonnegative=method == "sdp")[0]


def consensus_rate(mixing: ArrayLike) -> float:
    r"""Spectral norm :math:`\lVert W - \mathbf 1\mathbf 1^\top/M \rVert_2`.

    Parameters
    ----------
    mixing : array_like, shape (M, M)
        Mixing matrix :math:`W`.

    Returns
    -------
    float
        The per-round contraction factor of the disagreement; 0 for
        :math:`W = J`, 1 for :math:`W = I` (no mixing).
    """
    w = np.asarray(mixing, dtype=float)
    if w.ndim != 2 or w.shape[0] != w.shape[1] or w.size == 0:
        raise ValueError(f"mixing must be a non-empty square matrix, got {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("mixing must be finite")
    return float(np.linalg.norm(w - 1.0 / len(w), ord=2))


def check_mixing(
    mixing: ArrayLike, adj: ArrayLike | None = None, *, atol: float = 1e-9
) -> None:
    r"""Raise ``ValueError`` unless ``mixing`` is a valid mixing matrix.

    Parameters
    ----------
    mixing : array_like, shape (M, M)
        Must be square, finite, symmetric, with rows summing to one (hence
        doubly stochastic).
    adj : array_like, shape (M, M), optional
        If given, ``mixing`` must also vanish off the graph: :math:`W_{ij} = 0`
        for :math:`i \ne j` without an edge.
    atol : float
        Absolute tolerance of every check.
    """
    w = np.asarray(mixing, dtype=float)
    if w.ndim != 2 or w.shape[0] != w.shape[1] or w.size == 0:
        raise ValueError(f"mixing must be a non-empty square matrix, got {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("mixing must be finite")
    asymmetry = np.abs(w - w.T).max()
    if asymmetry > atol:
        raise ValueError(f"mixing must be symmetric, max |W - W^T| = {asymmetry:.3g}")
    row_error = np.abs(w.sum(axis=1) - 1.0).max()
    if row_error > atol:
        raise ValueError(f"mixing rows must sum to 1, max error {row_error:.3g}")
    if adj is None:
        return
    graph = from_adjacency(adj)
    if graph.shape != w.shape:
        raise ValueError(f"adj has shape {graph.shape} but mixing has {w.shape}")
    off_graph = (graph == 0) & ~np.eye(len(w), dtype=bool)
    leak = np.abs(w[off_graph]).max(initial=0.0)
    if leak > atol:
        raise ValueError(f"mixing must vanish off the graph (adj), found {leak:.3g}")


# ------------------------------------------------------------ optimal weights


def _edges(adj: NDArray[np.int_]) -> tuple[NDArray[np.intp], NDArray[np.intp]]:
    """Endpoints ``(i, j)``, ``i < j``, of every edge."""
    heads, tails = np.nonzero(np.triu(adj, k=1))
    return heads, tails


def _incidence(adj: NDArray[np.int_]) -> NDArray[np.float64]:
    """Oriented incidence matrix B, column e = e_i - e_j for edge e = (i, j)."""
    heads, tails = _edges(adj)
    incidence = np.zeros((len(adj), len(heads)))
    columns = np.arange(len(heads))
    incidence[heads, columns] = 1.0
    incidence[tails, columns] = -1.0
    return incidence


def _mixing_from_edge_weights(
    adj: NDArray[np.int_], weights: NDArray[np.float64], *, nonnegative: bool
) -> NDArray[np.float64]:
    r"""Exactly symmetric, stochastic W from (solver-noisy) edge weights.

    Built as :math:`W = I - \sum_e w_e b_e b_e^\top`, so zeros off the graph,
    symmetry and unit row sums hold to rounding whatever the solver returned.
    For ``nonnegative``, negative noise is clipped and, if a row's weights then
    exceed one by rounding, all weights are shrunk by the same factor (W stays
    symmetric, its diagonal non-negative; rho moves by that noise only).
    """
    heads, tails = _edges(adj)
    if nonnegative:
        weights = np.clip(weights, 0.0, None)
    off_diagonal = np.zeros(adj.shape)
    off_diagonal[heads, tails] = weights
    off_diagonal += off_diagonal.T
    if nonnegative:
        off_diagonal /= max(1.0, off_diagonal.sum(axis=1).max())
    return _fill_diagonal(off_diagonal)


def _sparse_outer_products(columns: NDArray[np.float64]) -> Any:
    """Sparse matrix whose column e is ``vec(c_e c_e^T)`` (row-major)."""
    import scipy.sparse as sp

    n = columns.shape[0]
    stacked = sp.csr_matrix(columns)
    ones = np.ones((n, 1))
    # Row a*n + b of the Khatri-Rao product is columns[a] * columns[b].
    return sp.kron(stacked, ones).multiply(sp.kron(ones, stacked)).tocsr()


def _edge_sdp_weights(
    adj: NDArray[np.int_], *, nonnegative: bool
) -> tuple[NDArray[np.float64], float]:
    r"""Optimal edge weights and the solver's bound on their rate, by Clarabel.

    With :math:`W = I - B\,\mathrm{diag}(w) B^\top` (B the incidence), W is
    symmetric with :math:`W\mathbf 1 = \mathbf 1` by construction and
    :math:`\rho(W) \le s` reads

    * :math:`W + sI \succeq 0` (eigenvalues on :math:`\mathbf 1^\perp` are
      :math:`\ge -s`; the eigenvalue 1 on :math:`\mathbf 1` is harmless),
      sparse with the pattern of the graph;
    * :math:`V^\top (sI - W) V \succeq 0` for a basis V of
      :math:`\mathbf 1^\perp` (eigenvalues on :math:`\mathbf 1^\perp` are
      :math:`\le s`). Taking :math:`V` = differences of consecutive nodes in a
      reverse Cuthill-McKee order keeps this banded, instead of the dense
      :math:`W - J`.

    Clarabel's chordal decomposition then splits both cones into small blocks.
    """
    cp = require("cvxpy", "sdp", "mixing 'sdp' (the optimal mixing matrix)")
    import scipy.sparse as sp  # cvxpy depends on scipy
    from scipy.sparse.csgraph import reverse_cuthill_mckee

    servers = len(adj)
    incidence = _incidence(adj)
    order = reverse_cuthill_mckee(sp.csr_matrix(adj), symmetric_mode=True)
    basis = np.zeros((servers, servers - 1))
    steps = np.arange(servers - 1)
    basis[order[:-1], steps] = 1.0
    basis[order[1:], steps] = -1.0
    projected = basis.T @ incidence

    weights = cp.Variable(incidence.shape[1])
    bound = cp.Variable()

    def laplacian(columns: NDArray[np.float64]) -> Any:
        n = columns.shape[0]
        return cp.reshape(_sparse_outer_products(columns) @ weights, (n, n), order="C")

    constraints = [
        (1.0 + bound) * np.eye(servers) - laplacian(incidence) >> 0,
        laplacian(projected) - (1.0 - bound) * (basis.T @ basis) >> 0,
    ]
    if nonnegative:
        # Off-diagonal entries are the weights, diagonal entries 1 - sum of them.
        constraints += [weights >= 0, np.abs(incidence) @ weights <= 1]
    problem = cp.Problem(cp.Minimize(bound), constraints)
    with warnings.catch_warnings():
        # Graphs with many symmetries (tori) have repeated eigenvalues at the
        # optimum and Clarabel sometimes stops at "almost solved" about 1e-8 from
        # it; cvxpy's generic warning would then be noise. optimal_mixing
        # rebuilds W exactly and warns itself if the rate misses the bound.
        warnings.filterwarnings("ignore", "Solution may be inaccurate")
        # parent_child merging was the faster clique merge on most graphs timed.
        problem.solve(
            solver=cp.CLARABEL, chordal_decomposition_merge_method="parent_child"
        )
    if problem.status not in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE):
        raise RuntimeError(f"mixing SDP not solved: status {problem.status!r}")
    return np.asarray(weights.value, dtype=float), float(problem.value)


def optimal_mixing(
    adj: ArrayLike, *, nonnegative: bool = True
) -> tuple[NDArray[np.float64], float]:
    r"""Fastest mixing matrix on the graph, by semidefinite programming.

    Solves

    .. math::
        \min_W \lVert W - J \rVert_2 \quad\text{s.t.}\quad W = W^\top,\;
        W\mathbf 1 = \mathbf 1,\; W_{ij} = 0 \text{ off the graph},\;
        (W \ge 0 \text{ if nonnegative}),

    a convex problem (Xiao & Boyd 2004): minimise :math:`s` subject to
    :math:`-sI \preceq W - J \preceq sI`, by cvxpy with Clarabel (interior
    point, accurate to about 1e-8) on the sparse formulation of
    ``_edge_sdp_weights``. The complete graph is answered in closed form
    (:math:`W = J`, :math:`\rho = 0`).

    Parameters
    ----------
    adj : array_like, shape (M, M)
        Adjacency of a connected graph.
    nonnegative : bool
        Require :math:`W \ge 0` entrywise (each server takes a convex
        combination of its neighbourhood).

    Returns
    -------
    mixing : ndarray of float64, shape (M, M)
        Symmetric, rows summing to one, exact zeros off the graph (and
        non-negative if asked), whatever the solver's rounding.
    rate : float
        Its :func:`consensus_rate`.

    Notes
    -----
    The time is set by the cliques of the chordal extension of the graph. On
    2 CPU cores with M = 50: ring, star, grid, torus 0.03-1 s; random 3- and
    4-regular 0.3-0.9 s; Erdos-Renyi with p = 0.08-0.1 0.5-1.1 s. Dense
    graphs are slower (random 6-regular 2.5 s, 8-regular 3-4.5 s,
    Erdos-Renyi p = 0.2-0.3 5-9.5 s): their PSD blocks stay dense.

    The rate is usually within 1e-7 of the optimum; on long rings (M >= 100)
    the error grows to ~1e-5, still under 1 % of the spectral gap
    :math:`1 - \rho`. A ``RuntimeWarning`` is raised if the returned W mixes
    more than 1 % slower than the solver's bound.
    """
    graph = from_adjacency(adj)
    if _is_complete(graph):
        uniform = np.full(graph.shape, 1.0 / len(graph))
        return uniform, consensus_rate(uniform)
    weights, bound = _edge_sdp_weights(graph, nonnegative=nonnegative)
    mixing = _mixing_from_edge_weights(graph, weights, nonnegative=nonnegative)
    rate = consensus_rate(mixing)
    if rate - bound > _SDP_GAP_TOLERANCE * (1.0 - bound):
        warnings.warn(
            f"mixing SDP solved inaccurately: rho(W) = {rate:.8f} exceeds the "
            f"solver's bound {bound:.8f}",
            RuntimeWarning,
            stacklevel=2,
        )
    return mixing, rate

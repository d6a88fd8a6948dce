"""Mixing (gossip) matrices of P-FedAvg's servers, and the mixing of their models.

Choosing :math:`W` on a graph of :mod:`.graphs` (:func:`server_graph`), measuring
how fast it mixes and applying it (:func:`mix_models`, :func:`mix_row`,
:func:`consensus_average`, :func:`consensus_model`, :func:`consensus_distance`) on
``name -> ndarray`` dicts. The maths and the matrices (``MIXINGS``): see
``docs/algorithms/pfedavg.md``.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .graphs import adjacency, edges, from_adjacency, is_complete
from .sdp import optimal_edge_weights

MIXINGS = ("metropolis", "max-degree", "uniform", "sdp", "sdp-signed")

# Mixing takes ~ 1 / (1 - rho) rounds, so the SDP answer is called inaccurate only
# when its W mixes more than this fraction slower than the solver's bound says.
# Clarabel usually lands within 1e-7 of the optimum, but on long rings (1 - rho
# ~ 1e-3) the banded basis of sdp.optimal_edge_weights is ill-conditioned and the
# rate can be off by ~1e-5, under 1 % of the gap.
_SDP_GAP_TOLERANCE = 0.01


def _fill_diagonal(off_diagonal: NDArray[np.float64]) -> NDArray[np.float64]:
    """Set the diagonal so that every row sums to one."""
    mixing = off_diagonal.copy()
    np.fill_diagonal(mixing, 0.0)
    np.fill_diagonal(mixing, 1.0 - mixing.sum(axis=1))
    return mixing


def _square_finite(mixing: ArrayLike) -> NDArray[np.float64]:
    """Return ``mixing`` as a float array; raise unless square, non-empty, finite."""
    w = np.asarray(mixing, dtype=float)
    if w.ndim != 2 or w.shape[0] != w.shape[1] or w.size == 0:
        raise ValueError(f"mixing must be a non-empty square matrix, got {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("mixing must be finite")
    return w


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
        if not is_complete(graph):
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
    w = _square_finite(mixing)
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
    w = _square_finite(mixing)
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
    heads, tails = edges(adj)
    if nonnegative:
        weights = np.clip(weights, 0.0, None)
    off_diagonal = np.zeros(adj.shape)
    off_diagonal[heads, tails] = weights
    off_diagonal += off_diagonal.T
    if nonnegative:
        off_diagonal /= max(1.0, off_diagonal.sum(axis=1).max())
    return _fill_diagonal(off_diagonal)


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
    :func:`.sdp.optimal_edge_weights`, whose edge weights are then made an
    exact mixing matrix. The complete graph is answered in closed form
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
    Its time and accuracy: ``docs/algorithms/pfedavg.md``. A ``RuntimeWarning``
    is raised if the returned W mixes more than 1 % slower than the solver's
    bound.
    """
    graph = from_adjacency(adj)
    if is_complete(graph):
        uniform = np.full(graph.shape, 1.0 / len(graph))
        return uniform, consensus_rate(uniform)
    weights, bound = optimal_edge_weights(graph, nonnegative=nonnegative)
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


# ------------------------------------------------------------- server models


def mixing_graph(mixing: ArrayLike) -> NDArray[np.int_]:
    """Return the graph a mixing matrix :math:`W` (M x M) uses: its non-zeros.

    A 0/1 int adjacency with zero diagonal, symmetric when :math:`W` is; not
    checked for connectivity (:func:`check_mixing` with this graph does that).
    """
    graph = (np.abs(np.asarray(mixing, dtype=np.float64)) > 0).astype(int)
    np.fill_diagonal(graph, 0)
    return graph


@dataclass(frozen=True)
class ServerGraph:
    """The servers' overlay graph and mixing matrix, as every server derives them."""

    adjacency: NDArray[np.int_]
    weights: NDArray[np.float64]
    topology: str
    mixing: str
    rho: float


def server_graph(
    servers: int,
    *,
    topology: str = "ring",
    mixing: str = "metropolis",
    adjacency_matrix: Any = None,
    weights: Any = None,
    degree: int | None = None,
    probability: float | None = None,
    rows: int | None = None,
    seed: int = 0,
) -> ServerGraph:
    r"""Build and check W: the one place the logical and deployed P-FedAvg get it.

    ``weights`` (your own W) wins over ``adjacency_matrix`` (your own graph),
    which wins over ``topology``; random topologies are seeded by ``seed``, so
    servers built apart from the same settings derive the same W.

    Parameters
    ----------
    servers : int
        :math:`M \ge 1`, the number of parameter servers.
    topology : str (default: "ring")
        The server graph: ``"ring"``, ``"star"``, ``"grid"``, ``"torus"``,
        ``"complete"``, ``"random-regular"`` or ``"erdos-renyi"``; ignored
        when ``adjacency_matrix`` or ``weights`` is given.
    mixing : str (default: "metropolis")
        The weights: ``"metropolis"`` (Metropolis-Hastings), ``"max-degree"``,
        ``"uniform"`` (complete graph), ``"sdp"`` or ``"sdp-signed"`` (the
        optimal :math:`\min\lVert W - \mathbf{1}\mathbf{1}^\top/M\rVert_2` by
        semidefinite programming; needs the ``[sdp]`` extra, cvxpy).
    adjacency_matrix : array_like | None (default: None)
        Your own server graph (symmetric 0/1, zero diagonal, connected).
    weights : array_like | None (default: None)
        Your own mixing matrix (checked: symmetric, doubly stochastic, zero
        off the graph's edges).
    degree : int | None (default: None)
        The degree of ``"random-regular"``.
    probability : float | None (default: None)
        The edge probability of ``"erdos-renyi"``.
    rows : int | None (default: None)
        The rows of ``"grid"`` and ``"torus"``.
    seed : int (default: 0)
        Seeds the random topologies (the same on every server).

    Returns
    -------
    ServerGraph
        The graph, W, their names and :math:`\rho(W)`.
    """
    if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
        raise ValueError(f"servers must be an integer >= 1, got {servers!r}")
    if weights is not None:
        matrix = np.asarray(weights, dtype=np.float64)
        graph, topology = mixing_graph(matrix), "custom"
    else:
        if adjacency_matrix is not None:
            graph, topology = from_adjacency(adjacency_matrix), "custom"
        elif servers == 1:
            graph, topology = np.zeros((1, 1), dtype=int), "single"
        else:
            try:
                graph = adjacency(
                    topology,
                    servers,
                    degree=degree,
                    probability=probability,
                    rows=rows,
                    seed=seed,
                )
            except ValueError as err:
                raise ValueError(f"topology={topology!r}: {err}") from err
        try:
            matrix = np.ones((1, 1)) if servers == 1 else mixing_matrix(graph, mixing)
        except ValueError as err:
            raise ValueError(f"mixing={mixing!r}: {err}") from err
    if matrix.shape != (servers, servers):
        raise ValueError(f"weights is {matrix.shape}, expected ({servers}, {servers})")
    try:
        check_mixing(matrix, graph)
    except ValueError as err:
        raise ValueError(f"weights: {err}") from err
    return ServerGraph(
        adjacency=graph,
        weights=matrix,
        topology=topology,
        mixing=mixing if weights is None else "custom",
        rho=consensus_rate(matrix),
    )


#: The keywords of :func:`server_graph`: the settings every P-FedAvg server takes.
GRAPH_SETTINGS = tuple(inspect.signature(server_graph).parameters)[1:]


def graph_of(servers: int, settings: Mapping[str, Any]) -> ServerGraph:
    """Return :func:`server_graph` of the ``GRAPH_SETTINGS`` among ``settings``."""
    return server_graph(servers, **{name: settings[name] for name in GRAPH_SETTINGS})


def _is_float(array: NDArray) -> bool:
    # Only floating-point arrays are averaged; integer buffers (step counts,
    # indices) would be corrupted by a weighted sum.
    return bool(np.issubdtype(array.dtype, np.floating))


def mix_row(
    row: ArrayLike, own: int, models: Mapping[int, Mapping[str, NDArray]]
) -> tuple[dict[str, NDArray], float]:
    r"""Server :math:`i`'s mixing step over the models it has, re-normalised.

    .. math::
        x_i = \frac{\sum_{j \in A} W_{ij}\, y_j}{\sum_{j \in A} W_{ij}},
        \qquad A = \{j : W_{ij} \ne 0,\ y_j \text{ at hand}\}.

    With every neighbour's model at hand the denominator is the row sum, 1, and
    :math:`x_i = \sum_j W_{ij} y_j` exactly as :func:`mix_models` computes it
    (no division: the same floats). A neighbour whose model did not arrive is
    left out and the weights of the others (:math:`i` itself included) are scaled
    up to sum to 1, so :math:`x_i` stays a convex combination (for
    :math:`W \ge 0`) and a lost neighbour never shrinks the model towards zero.
    Floating-point arrays are summed in float64, in the order of :math:`j`, and
    cast back to :math:`y_i`'s dtype; any other array is :math:`y_i`'s own.

    Parameters
    ----------
    row : array_like, shape (M,)
        Row :math:`i` of :math:`W` (non-negative weights summing to one).
    own : int
        :math:`i`; ``models[own]`` must be present.
    models : mapping of int to mapping of str to ndarray
        The models at hand, by server: :math:`y_i` and the neighbours' that
        arrived (others are ignored: :math:`W_{ij} = 0`).

    Returns
    -------
    tuple[dict[str, ndarray], float]
        :math:`x_i`, and the weight :math:`\sum_{j \in A} W_{ij}` that was at
        hand (1.0 when every neighbour's model was).

    Raises
    ------
    ValueError
        ``models`` lacks ``own``, or a neighbour's model lacks a key or has
        another shape (a sum would otherwise broadcast silently).
    """
    weights = np.asarray(row, dtype=np.float64)
    if own not in models:
        raise ValueError(f"model {own} (the server's own) is missing")
    neighbours = [int(j) for j in np.flatnonzero(weights)]
    present = [j for j in neighbours if j in models]
    scale = None  # every neighbour present: x_i = sum_j W_ij y_j, not divided
    total = 1.0
    if len(present) < len(neighbours):
        total = float(sum(weights[j] for j in present))
        if total == 0.0:
            raise ValueError(f"no weight at hand: row {own} is {weights}")
        scale = 1.0 / total
    mixed = {}
    for key, value in models[own].items():
        if not _is_float(value):
            mixed[key] = value
            continue
        acc = np.zeros(value.shape, dtype=np.float64)
        for j in present:
            other = models[j].get(key)
            if other is None or other.shape != value.shape:
                raise ValueError(
                    f"model {j} has {key!r} "
                    f"{'missing' if other is None else f'of shape {other.shape}'}"
                    f", model {own} has shape {value.shape}"
                )
            weight = weights[j] if scale is None else weights[j] * scale
            acc += weight * other
        mixed[key] = acc.astype(value.dtype)
    return mixed, total


def mix_models(
    mixing: ArrayLike, models: Sequence[Mapping[str, NDArray]]
) -> list[dict[str, NDArray]]:
    r"""One mixing step over the servers' models, :math:`x_i = \sum_j W_{ij} y_j`.

    Server :math:`i` reads only the models :math:`y_j` with
    :math:`W_{ij} \ne 0` (itself and its neighbours): row by row,
    :func:`mix_row` with every model at hand, which is the step a parameter
    server runs on its own (:class:`~flwr_prox_strategies.PFedAvgServer`).

    Parameters
    ----------
    mixing : array_like, shape (M, M)
        Mixing matrix :math:`W` (see :func:`check_mixing`; not checked here).
    models : sequence of mapping of str to ndarray, length M
        :math:`y_1, \dots, y_M`, with the same keys and shapes.

    Returns
    -------
    list of dict of str to ndarray, length M
        :math:`x_1, \dots, x_M`, new arrays for the mixed keys.

    Raises
    ------
    ValueError
        ``mixing`` is not M x M, or a neighbour's model lacks a key or has
        another shape.
    """
    weights = np.asarray(mixing, dtype=np.float64)
    if weights.shape != (len(models), len(models)):
        raise ValueError(
            f"mixing is {weights.shape} for {len(models)} models, expected "
            f"({len(models)}, {len(models)})"
        )
    at_hand = dict(enumerate(models))
    return [mix_row(weights[i], i, at_hand)[0] for i in range(len(models))]


def consensus_average(
    models: Sequence[Mapping[str, NDArray]],
) -> dict[str, NDArray[np.float64]]:
    r"""Return the servers' mean :math:`\bar x = \frac1M \sum_i x_i`, in float64.

    Parameters
    ----------
    models : sequence of mapping of str to ndarray, length M >= 1
        :math:`x_1, \dots, x_M`, with the same keys and shapes.

    Returns
    -------
    dict of str to ndarray of float64
        One mean per floating-point array of the first model.
    """
    if not models:
        raise ValueError("consensus_average needs at least one model")
    keys = [k for k, v in models[0].items() if _is_float(v)]
    return {k: np.mean([m[k].astype(np.float64) for m in models], axis=0) for k in keys}


def consensus_model(
    models: Sequence[Mapping[str, NDArray]],
    average: Mapping[str, NDArray] | None = None,
) -> dict[str, NDArray]:
    """Return the servers' mean as a model, with the first model's keys and dtypes.

    Parameters
    ----------
    models : sequence of mapping of str to ndarray, length M >= 1
        The servers' models.
    average : mapping of str to ndarray, optional
        Their :func:`consensus_average`, if already computed.

    Returns
    -------
    dict of str to ndarray
        Floating-point arrays: the mean, cast to the first model's dtype;
        other arrays: the first model's.
    """
    average = consensus_average(models) if average is None else average
    template = models[0]
    return {
        k: average[k].astype(template[k].dtype) if k in average else template[k]
        for k in template
    }


def consensus_distance(
    models: Sequence[Mapping[str, NDArray]],
    average: Mapping[str, NDArray] | None = None,
) -> float:
    r"""Return the servers' disagreement, :math:`\sum_i \lVert x_i - \bar x \rVert^2`.

    Parameters
    ----------
    models : sequence of mapping of str to ndarray, length M >= 1
        The servers' models; their floating-point arrays count.
    average : mapping of str to ndarray, optional
        Their :func:`consensus_average`, if already computed.

    Returns
    -------
    float
        0 exactly when every server holds the same model.
    """
    average = consensus_average(models) if average is None else average
    return float(
        sum(
            np.sum((model[k].astype(np.float64) - average[k]) ** 2)
            for model in models
            for k, v in model.items()
            if _is_float(v)
        )
    )

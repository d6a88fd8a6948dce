r"""The fastest-mixing semidefinite programme, solved by cvxpy with Clarabel.

Xiao & Boyd (*Fast linear iterations for distributed averaging*, 2004): over
the edge weights of a graph, minimise the consensus rate of the mixing matrix
they define. This module states and solves that programme and nothing else;
:func:`.mixing.optimal_mixing` turns its answer into an exact mixing matrix.
It is the only part of :mod:`flwr_prox_strategies.ops` that needs cvxpy (the
``sdp`` extra), imported when a programme is solved, not when this is imported.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._optional import require
from .graphs import from_adjacency, incidence


def _sparse_outer_products(columns: NDArray[np.float64]) -> Any:
    """Sparse matrix whose column e is ``vec(c_e c_e^T)`` (row-major)."""
    import scipy.sparse as sp

    n = columns.shape[0]
    stacked = sp.csr_matrix(columns)
    ones = np.ones((n, 1))
    # Row a*n + b of the Khatri-Rao product is columns[a] * columns[b].
    return sp.kron(stacked, ones).multiply(sp.kron(ones, stacked)).tocsr()


def optimal_edge_weights(
    adj: ArrayLike, *, nonnegative: bool = True
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

    Parameters
    ----------
    adj : array_like, shape (M, M)
        Adjacency of a connected graph (validated by
        :func:`.graphs.from_adjacency`).
    nonnegative : bool
        Also require :math:`W \ge 0` entrywise: :math:`w \ge 0` and every
        row's weights summing to at most one.

    Returns
    -------
    weights : ndarray of float64, shape (E,)
        One weight per edge, in the order of :func:`.graphs.edges`, as the
        solver returned them (feasible to its tolerance, not exactly).
    bound : float
        The solver's optimal :math:`s`, a bound on :math:`\rho(W)`.

    Raises
    ------
    RuntimeError
        The solver ended neither optimal nor optimal-inaccurate.
    """
    cp = require("cvxpy", "sdp", "mixing 'sdp' (the optimal mixing matrix)")
    import scipy.sparse as sp  # cvxpy depends on scipy
    from scipy.sparse.csgraph import reverse_cuthill_mckee

    adj = from_adjacency(adj)
    servers = len(adj)
    oriented = incidence(adj)
    order = reverse_cuthill_mckee(sp.csr_matrix(adj), symmetric_mode=True)
    basis = np.zeros((servers, servers - 1))
    steps = np.arange(servers - 1)
    basis[order[:-1], steps] = 1.0
    basis[order[1:], steps] = -1.0
    projected = basis.T @ oriented

    weights = cp.Variable(oriented.shape[1])
    bound = cp.Variable()

    def laplacian(columns: NDArray[np.float64]) -> Any:
        n = columns.shape[0]
        return cp.reshape(_sparse_outer_products(columns) @ weights, (n, n), order="C")

    constraints = [
        (1.0 + bound) * np.eye(servers) - laplacian(oriented) >> 0,
        laplacian(projected) - (1.0 - bound) * (basis.T @ basis) >> 0,
    ]
    if nonnegative:
        # Off-diagonal entries are the weights, diagonal entries 1 - sum of them.
        constraints += [weights >= 0, np.abs(oriented) @ weights <= 1]
    problem = cp.Problem(cp.Minimize(bound), constraints)
    with warnings.catch_warnings():
        # Graphs with many symmetries (tori) have repeated eigenvalues at the
        # optimum and Clarabel sometimes stops at "almost solved" about 1e-8 from
        # it; cvxpy's generic warning would then be noise. mixing.optimal_mixing
        # rebuilds W exactly and warns itself if the rate misses the bound.
        warnings.filterwarnings("ignore", "Solution may be inaccurate")
        # parent_child merging was the faster clique merge on most graphs timed.
        problem.solve(
            solver=cp.CLARABEL, chordal_decomposition_merge_method="parent_child"
        )
    if problem.status not in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE):
        raise RuntimeError(f"mixing SDP not solved: status {problem.status!r}")
    return np.asarray(weights.value, dtype=float), float(problem.value)

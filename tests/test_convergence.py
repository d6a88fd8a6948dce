"""The convergence contract: every algorithm reaches its known fixed point.

On the least-squares federation of ``tests/lsq.py`` (4 clients, optima and
curvatures that differ), with K full-batch gradient steps per round:

* FedAvg and FedProx converge to the fixed point of their round map, which is
  affine here and solved in closed form below: not the global minimiser (client
  drift), and FedProx's lies nearer to it than FedAvg's;
* the drift-corrected methods and the others reach the point their own tests
  compute (:data:`ELSEWHERE` names each test; a test added here or there is how a
  new algorithm enters the table, and the guard below fails until it does).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from flwr_prox_strategies import FedAvg, FedAvgClient, FedProx, FedProxClient
from flwr_prox_strategies.algorithms import ALGORITHMS

from .lsq import LeastSquares

STEPS, LR, ROUNDS = 10, 0.1, 150


def round_map_fixed_point(problem: LeastSquares, mu: float) -> np.ndarray:
    r"""The x with x = mean_k theta_K^k(x) for K steps of GD on f_k + mu/2||. - x||^2.

    One step is theta <- M theta + lr (mu x + A^T b), M = I - lr (A^T A + mu I),
    so after K steps from theta = x: theta_K = P x + q with
    P = M^K + lr mu S, q = lr S A^T b, S = sum_{j<K} M^j.
    """
    eye = np.eye(problem.dim)
    p_sum, q_sum = np.zeros_like(eye), np.zeros(problem.dim)
    for a32, b32 in zip(problem.a, problem.b, strict=True):
        a, b = a32.astype(np.float64), b32.astype(np.float64)
        m = eye - LR * (a.T @ a + mu * eye)
        powers = [np.linalg.matrix_power(m, j) for j in range(STEPS + 1)]
        s = sum(powers[:STEPS])
        p_sum += powers[STEPS] + LR * mu * s
        q_sum += LR * s @ (a.T @ b)
    k = len(problem.a)
    return np.linalg.solve(eye - p_sum / k, q_sum / k)


@pytest.fixture(scope="module")
def problem() -> LeastSquares:
    return LeastSquares()


@pytest.mark.parametrize(
    ("name", "make", "client", "mu"),
    [
        ("fedavg", lambda: FedAvg(min_available_nodes=4), FedAvgClient, 0.0),
        ("fedprox", lambda: FedProx(mu=0.5, min_available_nodes=4), FedProxClient, 0.5),
    ],
)
def test_fedavg_and_fedprox_reach_their_round_maps_fixed_point(
    problem: LeastSquares, name, make, client, mu
) -> None:
    expected = round_map_fixed_point(problem, mu)
    theta = problem.run(make(), client, ROUNDS, local_epochs=STEPS, learning_rate=LR)
    error = np.linalg.norm(theta - expected) / np.linalg.norm(expected)
    assert error < 1e-4, (name, error)
    assert problem.relative_error(expected) > 1e-2  # drift: not the minimiser


def test_the_proximal_term_moves_the_fixed_point_towards_the_minimiser(
    problem: LeastSquares,
) -> None:
    errors = [
        problem.relative_error(round_map_fixed_point(problem, mu)) for mu in (0, 0.5, 5)
    ]
    assert errors[0] > errors[1] > errors[2]


# Where every other algorithm's fixed point is checked (module, test function).
ELSEWHERE = {
    "feddyn": (
        "tests.test_drift",
        "test_drift_corrected_methods_reach_the_global_minimiser",
    ),
    "feddc": (
        "tests.test_drift",
        "test_drift_corrected_methods_reach_the_global_minimiser",
    ),
    "scaffold": (
        "tests.test_drift",
        "test_drift_corrected_methods_reach_the_global_minimiser",
    ),
    "apfl": ("tests.test_apfl", "test_personal_model_reaches_the_closed_form_optimum"),
    "fedepm": (
        "tests.test_fedepm",
        "test_without_the_l1_term_fedepm_reaches_the_original_optimum",
    ),
    "sfedavg": (
        "tests.test_fedepm",
        "test_sfedavg_and_sfedprox_follow_their_equations",
    ),
    "sfedprox": (
        "tests.test_fedepm",
        "test_sfedavg_and_sfedprox_follow_their_equations",
    ),
    "pfedavg": (
        "tests.test_pfedavg",
        "test_a_sparser_graph_reaches_consensus_and_the_optimum_more_slowly",
    ),
}
HERE = {"fedavg", "fedprox"}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_has_a_convergence_check(name: str) -> None:
    if name in HERE:
        return
    assert name in ELSEWHERE, f"no convergence check for {name}: add one here"
    module, function = ELSEWHERE[name]
    assert callable(getattr(importlib.import_module(module), function, None)), (
        f"{module}.{function} (the convergence check of {name}) does not exist"
    )

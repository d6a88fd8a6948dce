"""FedNova: the pack's conformance checks, a round by hand, and the paper's point."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr_fednova import FEDNOVA, FedNova, normaliser
from flwr_fednova.client import FedNovaClient

from flwr_prox_strategies import FedAvg, FedAvgClient, testing

CHECKS = testing.conformance_checks(FEDNOVA)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_fednova_conforms(name: str) -> None:
    """FedNova passes every check the pack's own algorithms pass."""
    CHECKS[name]()


def with_steps(client_cls: type, per_client: tuple[int, ...]) -> type:
    """Return ``client_cls`` whose client k takes ``per_client[k]`` full-batch steps.

    The heterogeneous local work FedNova is about (speeds, data sizes), pinned
    per client so that a round can be replayed by hand.
    """

    class Stepped(client_cls):  # type: ignore[misc, valid-type]
        def local_solve(
            self, config: dict[str, Any], *, epochs: int, steps: int | None
        ) -> Any:
            tau = per_client[self.client_key]
            # LeastSquares loads one full batch: tau epochs of one step each.
            return super().local_solve(config, epochs=tau, steps=tau)

    return Stepped


def by_hand(
    problem: testing.LeastSquares, steps: tuple[int, ...], eta: float, mu: float
) -> tuple[np.ndarray, list[float], float]:
    """Return one FedNova round from theta^0 in float64: x^1, the a_i, tau_eff."""
    x = np.zeros(problem.dim)
    a_mats = [a.astype(np.float64) for a in problem.a]
    b_vecs = [b.astype(np.float64) for b in problem.b]
    n = np.array([len(b) for b in b_vecs], dtype=np.float64)
    p = n / n.sum()
    models, normalisers = [], []
    for a_k, b_k, tau in zip(a_mats, b_vecs, steps, strict=True):
        y = x.copy()
        for _ in range(tau):  # full-batch GD on f_k + mu/2 ||y - x||^2
            y = y - eta * (a_k.T @ (a_k @ y - b_k) + mu * (y - x))
        models.append(y)
        # a_i = sum_k (1 - eta mu)^k, summed term by term (not the closed form).
        normalisers.append(sum((1.0 - eta * mu) ** k for k in range(tau)))
    d = [(x - y) / a_i for y, a_i in zip(models, normalisers, strict=True)]
    tau_eff = float(np.dot(p, normalisers))
    new_x = x - tau_eff * sum(p_i * d_i for p_i, d_i in zip(p, d, strict=True))
    return new_x, normalisers, tau_eff


@pytest.mark.parametrize("mu", [0.0, 2.0])
def test_one_round_matches_numpy(mu: float) -> None:
    """One round, clients at tau = 1, 3, 6: the strategy's x^1 is the paper's."""
    problem = testing.LeastSquares(num_clients=3)
    steps, eta = (1, 3, 6), 0.05
    expected, normalisers, tau_eff = by_hand(problem, steps, eta, mu)
    if mu == 0.0:
        assert normalisers == [1.0, 3.0, 6.0] and tau_eff == pytest.approx(10 / 3)
    else:  # eta mu = 0.1: a_i < tau_i, and the closed form agrees
        assert all(a < t for a, t in zip(normalisers[1:], steps[1:], strict=True))
        assert [normaliser(t, eta * mu) for t in steps] == pytest.approx(normalisers)
    theta = problem.run(
        FedNova(mu=mu, min_available_nodes=3, fraction_evaluate=0.0),
        with_steps(FedNovaClient, steps),
        1,
        learning_rate=eta,
    )
    np.testing.assert_allclose(theta, expected, rtol=1e-6, atol=1e-6)


def test_normaliser() -> None:
    """a_i is tau_i for plain SGD, the geometric sum for proximal SGD."""
    assert normaliser(6, 0.0) == 6.0
    assert normaliser(6, 0.1) == pytest.approx(sum(0.9**k for k in range(6)))
    assert normaliser(1, 0.5) == 1.0
    assert normaliser(10**6, 1e-12) == pytest.approx(10**6, rel=1e-5)
    with pytest.raises(ValueError, match="lr \\* mu < 1"):
        normaliser(3, 1.0)


def test_equal_steps_is_fedavg() -> None:
    """With equal local steps FedNova is FedAvg (the paper's Section 5)."""
    # tau_eff / a_i = 1 for every client: the step is FedAvg's average.
    problem = testing.LeastSquares(num_clients=3)
    steps = (4, 4, 4)
    nova = problem.run(
        FedNova(min_available_nodes=3, fraction_evaluate=0.0),
        with_steps(FedNovaClient, steps),
        2,
        learning_rate=0.05,
    )
    avg = problem.run(
        FedAvg(min_available_nodes=3, fraction_evaluate=0.0),
        with_steps(FedAvgClient, steps),
        2,
        learning_rate=0.05,
    )
    np.testing.assert_allclose(nova, avg, rtol=1e-5, atol=1e-6)


def test_client_refuses_momentum() -> None:
    """Momentum changes a_i: the client refuses it rather than mis-normalise."""
    problem = testing.LeastSquares(num_clients=1)
    with pytest.raises(ValueError, match="momentum must be 0"):
        FedNovaClient(problem.model(), problem.loader(0), momentum=0.9)


def test_reaches_the_minimiser_where_fedavg_does_not() -> None:
    """The paper's point: unequal local work biases FedAvg, not FedNova.

    Clients run 1, 3, 6 and 10 full-batch steps a round. FedAvg weights client
    k's gradients by its steps: it converges to the minimiser of
    sum_k tau_k f_k (the paper's Theorem 1), 15% away from the true one.
    FedNova normalises them away and reaches the minimiser of sum_k f_k, up to
    the client drift that the decaying step size shrinks.
    """
    problem = testing.LeastSquares()
    steps = (1, 3, 6, 10)
    options = {"min_available_nodes": 4, "fraction_evaluate": 0.0, "lr_decay": 0.97}
    nova_error = testing.check_converges(
        lambda: FedNova(**options),
        with_steps(FedNovaClient, steps),
        rounds=100,
        tolerance=0.035,
        problem=problem,
        learning_rate=0.03,
    )
    theta = problem.run(
        FedAvg(**options), with_steps(FedAvgClient, steps), 100, learning_rate=0.03
    )
    a_mats = [a.astype(np.float64) for a in problem.a]
    b_vecs = [b.astype(np.float64) for b in problem.b]
    surrogate = np.linalg.solve(
        sum(t * a.T @ a for t, a in zip(steps, a_mats, strict=True)),
        sum(t * a.T @ b for t, a, b in zip(steps, a_mats, b_vecs, strict=True)),
    )
    avg_error = problem.relative_error(theta)
    assert avg_error > 0.12 > 3 * nova_error
    # FedAvg did converge: to the tau-weighted objective's minimiser.
    assert np.linalg.norm(theta - surrogate) / np.linalg.norm(surrogate) < 0.03

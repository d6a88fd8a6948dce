"""APFL against mathematics: its limits, its fixed point, one step by hand, the seed's averages."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from torch.utils.data import DataLoader, TensorDataset

from flwr_prox_strategies import APFL, APFLClient, FedAvg, FedAvgClient, to_client_app
from flwr_prox_strategies.algorithms.apfl import averaging_weight_sum
from flwr_prox_strategies.core.client.state import ClientState
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid

logging.getLogger("flwr").setLevel(logging.WARNING)


def half_sse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((out.squeeze(-1) - y) ** 2).sum()


class Quadratic:
    """f_k(x) = 1/2 ||A_k x - b_k||^2 with A_k^T A_k = c_k I and minimiser x_k.

    The global minimiser of sum_k f_k is sum c_k x_k / sum c_k.
    """

    def __init__(self, curvatures, optima, rows: int = 12, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.dim = len(optima[0])
        self.curvatures = [float(c) for c in curvatures]
        self.optima = [np.asarray(x, dtype=np.float64) for x in optima]
        self.a, self.b = [], []
        for c, x in zip(self.curvatures, self.optima, strict=True):
            q, _ = np.linalg.qr(rng.normal(size=(rows, self.dim)))
            a = q * np.sqrt(c)
            self.a.append(a)
            self.b.append(a @ x + 0.0)
        weights = np.array(self.curvatures)
        self.optimum = (weights[:, None] * np.array(self.optima)).sum(0) / weights.sum()

    def loader(self, k: int, batch_size: int | None = None, shuffle: bool = False):
        data = TensorDataset(torch.from_numpy(self.a[k]), torch.from_numpy(self.b[k]))
        return DataLoader(data, batch_size=batch_size or len(data), shuffle=shuffle)

    def model(self) -> torch.nn.Module:
        return torch.nn.Linear(self.dim, 1, bias=False).double()

    def client_fn(self, client_cls=APFLClient, batch_size=None, shuffle=False, **kw):
        def client_fn(context):
            k = int(context.node_config["partition-id"])
            return client_cls(
                self.model(),
                self.loader(k, batch_size, shuffle),
                self.loader(k),  # full batch: the evaluated loss is f_k exactly
                loss_fn=half_sse,
                seed=k,
                **kw,
            )

        return client_fn

    def grid(self, client_cls=APFLClient, **kw) -> InProcessGrid:
        return InProcessGrid(
            to_client_app(self.client_fn(client_cls, **kw)), num_nodes=len(self.a)
        )

    def value(self, k: int, x: np.ndarray) -> float:
        return 0.5 * float(np.sum((self.a[k] @ x - self.b[k]) ** 2))


def initial(x) -> ArrayRecord:
    return ArrayRecord([np.asarray(x, dtype=np.float64).reshape(1, -1)])


def personal(grid: InProcessGrid, node: int) -> tuple[np.ndarray, float]:
    state = ClientState(grid.contexts[node])
    omega = state.get("apfl-personal")
    assert omega is not None
    return omega[0].reshape(-1), state.scalar("apfl-alpha")


HETEROGENEOUS = Quadratic(
    [2.0, 1.0, 1.0, 1.5],
    [[3.0, -1.0, 2.0], [-2.0, 0.5, 1.0], [0.0, 4.0, -1.0], [1.0, 1.0, 1.0]],
)


def test_alpha_zero_is_fedavg_bit_for_bit() -> None:
    """alpha = 0: the global copies follow plain local SGD, so the global model is
    FedAvg's (same sampling, mini-batches and shuffles), and the personal model is
    the global one."""
    rounds, tau = 6, 7  # 7 steps of batch 5 over 12 rows: crosses epoch ends
    common = dict(fraction_train=0.5, min_train_nodes=2, min_available_nodes=4, seed=3)
    apfl = APFL(
        alpha=0.0, sync_gap=tau, fraction_evaluate=1.0, min_evaluate_nodes=4, **common
    )
    fedavg = FedAvg(
        local_steps=tau, weighting="uniform", fraction_evaluate=0.0, **common
    )
    kw = dict(batch_size=5, shuffle=True, learning_rate=0.05)
    got = apfl.start(
        grid=HETEROGENEOUS.grid(**kw),
        initial_arrays=initial([1, 2, 3]),
        num_rounds=rounds,
    )
    want = fedavg.start(
        grid=HETEROGENEOUS.grid(FedAvgClient, **kw),
        initial_arrays=initial([1, 2, 3]),
        num_rounds=rounds,
    )
    np.testing.assert_array_equal(
        got.arrays.to_numpy_ndarrays()[0], want.arrays.to_numpy_ndarrays()[0]
    )
    evaluation = got.evaluate_metrics_clientapp[rounds]
    assert evaluation["personal-loss"] == evaluation["loss"]


def test_alpha_one_is_purely_local_training_bit_for_bit() -> None:
    """alpha = 1: the personal model is trained on the local data only, exactly as
    a client training alone (same steps, batches and rate) would train it."""
    rounds, tau, lr = 4, 5, 0.05
    strategy = APFL(
        alpha=1.0, sync_gap=tau, min_available_nodes=4, fraction_evaluate=0.0
    )
    grid = HETEROGENEOUS.grid(batch_size=5, shuffle=True, learning_rate=lr)
    strategy.start(grid=grid, initial_arrays=initial([1, 2, 3]), num_rounds=rounds)
    for k, node in enumerate(sorted(grid.contexts)):
        alone = FedAvgClient(
            HETEROGENEOUS.model(),
            HETEROGENEOUS.loader(k, 5, shuffle=True),
            loss_fn=half_sse,
            learning_rate=lr,
            seed=k,
        )
        params = [np.array([[1.0, 2.0, 3.0]])]
        for rnd in range(1, rounds + 1):
            params, _, _ = alone.fit(params, {"server-round": rnd, "local-steps": tau})
        omega, alpha = personal(grid, node)
        assert alpha == 1.0
        np.testing.assert_array_equal(omega, params[0].reshape(-1))


@pytest.mark.long
@pytest.mark.parametrize(
    ("mixing", "gradient", "rounds"),
    [
        ("parameters", "mixture", 250),
        ("parameters", "chain", 250),
        ("outputs", "chain", 250),
    ],
)
def test_personal_model_reaches_the_closed_form_optimum(
    mixing, gradient, rounds
) -> None:
    """Fixed alpha, tau = 1, full batches: theta -> theta* (the global minimiser)
    and the personal model -> argmin_w f_k(alpha w + (1 - alpha) theta*), which for
    a full-rank quadratic is w* = (x_k - (1 - alpha) theta*) / alpha."""
    alpha = 0.7
    strategy = APFL(
        alpha=alpha,
        sync_gap=1,
        mixing=mixing,
        personal_gradient=gradient,
        min_available_nodes=4,
        fraction_evaluate=0.0,
    )
    grid = HETEROGENEOUS.grid(learning_rate=0.3)
    result = strategy.start(
        grid=grid, initial_arrays=initial([0, 0, 0]), num_rounds=rounds
    )
    theta = result.arrays.to_numpy_ndarrays()[0].reshape(-1)
    np.testing.assert_allclose(theta, HETEROGENEOUS.optimum, atol=1e-9)
    for k, node in enumerate(sorted(grid.contexts)):
        omega, _ = personal(grid, node)
        expected = (
            HETEROGENEOUS.optima[k] - (1 - alpha) * HETEROGENEOUS.optimum
        ) / alpha
        np.testing.assert_allclose(omega, expected, atol=1e-7)


def test_adaptive_alpha_rises_on_an_outlier_and_falls_on_an_iid_client() -> None:
    """Clients 0 and 1 have optima far from the global one; clients 2 and 3 share
    the global optimum (their objective has the global minimiser)."""
    d = np.array([3.0, -1.0, 2.0])
    problem = Quadratic([2.0, 0.5, 1.0, 1.0], [d, -4 * d, 0 * d, 0 * d])
    np.testing.assert_allclose(problem.optimum, 0.0, atol=1e-12)
    strategy = APFL(
        alpha=0.5,
        adaptive_alpha=True,
        sync_gap=1,
        min_available_nodes=4,
        fraction_evaluate=0.0,
    )
    grid = problem.grid(learning_rate=0.1)
    result = strategy.start(
        grid=grid, initial_arrays=initial([1, 1, -2]), num_rounds=80
    )
    alphas = [personal(grid, node)[1] for node in sorted(grid.contexts)]
    assert alphas[0] == alphas[1] == 1.0  # clipped at 1: fully personal
    assert alphas[2] < 0.3 and alphas[3] < 0.3  # leaning on the global model
    metrics = result.train_metrics_clientapp[80]
    assert metrics["apfl-alpha-max"] == 1.0 and metrics["apfl-alpha-min"] < 0.3


def numpy_apfl(problem: Quadratic, *, alpha, tau, rounds, mu, kappa, start, adaptive):
    """The seed's pseudo-code, literally, in numpy (full participation, full batches)."""
    a = max(128 * kappa, tau)
    m = len(problem.a)
    grad = [
        lambda x, k=k: problem.a[k].T @ (problem.a[k] @ x - problem.b[k])
        for k in range(m)
    ]
    theta = [np.array(start, float) for _ in range(m)]
    omega = [np.array(start, float) for _ in range(m)]
    alphas = [alpha] * m
    p_sum, theta_hat, omega_hat = 0.0, 0.0, [0.0] * m
    for t in range(rounds * tau):
        eta = 16 / (mu * (t + a))
        for k in range(m):
            bar = alphas[k] * omega[k] + (1 - alphas[k]) * theta[k]
            g_bar = grad[k](bar)
            new_alpha = alphas[k] - eta * float((omega[k] - theta[k]) @ g_bar)
            theta[k] = theta[k] - eta * grad[k](theta[k])
            omega[k] = omega[k] - eta * g_bar
            if adaptive:
                alphas[k] = min(1.0, max(0.0, new_alpha))
        p = (t + 1 + a) ** 2
        p_sum += p
        theta_hat = theta_hat + p * np.mean(theta, axis=0)
        omega_hat = [h + p * w for h, w in zip(omega_hat, omega, strict=True)]
        if (t + 1) % tau == 0:
            theta = [np.mean(theta, axis=0)] * m
    theta_hat = theta_hat / p_sum
    personal_hat = [
        alphas[k] * omega_hat[k] / p_sum + (1 - alphas[k]) * theta_hat for k in range(m)
    ]
    return theta[0], theta_hat, personal_hat, alphas


@pytest.mark.parametrize("adaptive", [False, True])
def test_decaying_rate_and_weighted_final_models_follow_the_seed(adaptive) -> None:
    rounds, tau, mu, kappa = 5, 3, 4.0, 0.01  # a = max(1.28, 3) = 3: eta_0 = 4/3 / ...
    strategy = APFL(
        alpha=0.4,
        adaptive_alpha=adaptive,
        sync_gap=tau,
        lr_schedule="decay",
        strong_convexity=mu,
        condition_number=kappa,
        min_available_nodes=4,
        fraction_evaluate=1.0,
        min_evaluate_nodes=4,
    )
    grid = HETEROGENEOUS.grid()
    result = strategy.start(
        grid=grid, initial_arrays=initial([1, 2, 3]), num_rounds=rounds
    )
    theta, theta_hat, personal_hat, alphas = numpy_apfl(
        HETEROGENEOUS,
        alpha=0.4,
        tau=tau,
        rounds=rounds,
        mu=mu,
        kappa=kappa,
        start=[1, 2, 3],
        adaptive=adaptive,
    )
    np.testing.assert_allclose(
        result.arrays.to_numpy_ndarrays()[0].reshape(-1), theta, rtol=1e-12
    )
    average = strategy.average_model()
    assert average is not None
    np.testing.assert_allclose(
        average.to_numpy_ndarrays()[0].reshape(-1), theta_hat, rtol=1e-12
    )
    for k, node in enumerate(sorted(grid.contexts)):
        assert personal(grid, node)[1] == pytest.approx(alphas[k], abs=1e-12)
    # Each client evaluates hat-omega_k on its data; the mean of f_k(hat-omega_k):
    evaluation = result.evaluate_metrics_clientapp[rounds]
    want = np.mean([HETEROGENEOUS.value(k, personal_hat[k]) for k in range(4)])
    assert evaluation["personal-avg-loss"] == pytest.approx(want, rel=1e-10)
    global_want = np.mean([HETEROGENEOUS.value(k, theta_hat) for k in range(4)])
    assert evaluation["global-avg-loss"] == pytest.approx(global_want, rel=1e-10)


def test_one_step_by_hand_with_adaptive_alpha() -> None:
    """Second fit of one client (omega != theta): every quantity by hand."""
    problem = HETEROGENEOUS
    a, b = problem.a[0], problem.b[0]
    lr, alpha0 = 0.02, 0.3
    for mixing, gradient in (
        ("parameters", "mixture"),
        ("parameters", "chain"),
        ("outputs", "chain"),
    ):
        client = APFLClient(
            problem.model(), problem.loader(0), loss_fn=half_sse, learning_rate=lr
        )
        config = {
            "local-steps": 1,
            "apfl-alpha": alpha0,
            "apfl-adaptive-alpha": True,
            "apfl-mixing": mixing,
            "apfl-personal-gradient": gradient,
            "apfl-first-step": 0,
        }
        first = np.array([[1.0, -1.0, 0.5]])
        client.fit([first], {**config, "server-round": 1})
        omega, alpha = personal_state(client)
        theta = np.array([0.2, 0.3, -0.4])  # the server's next model
        client.fit(
            [theta.reshape(1, -1)], {**config, "server-round": 2, "apfl-first-step": 1}
        )
        # by hand, from omega (after fit 1) and the received theta
        bar = alpha * omega + (1 - alpha) * theta
        g_bar = a.T @ (a @ bar - b)
        scale = 1.0 if gradient == "mixture" else alpha
        want_omega = omega - lr * scale * g_bar
        want_alpha = alpha - lr * float((omega - theta) @ g_bar)
        assert 0 < want_alpha < 1 and abs(want_alpha - alpha) > 1e-3  # no clipping
        got_omega, got_alpha = personal_state(client)
        np.testing.assert_allclose(got_omega, want_omega, rtol=1e-12)
        assert got_alpha == pytest.approx(want_alpha, rel=1e-12)


def personal_state(client: APFLClient) -> tuple[np.ndarray, float]:
    omega = client.state.get("apfl-personal")
    assert omega is not None
    return omega[0].reshape(-1), client.state.scalar("apfl-alpha")


def test_averaging_weights_closed_form() -> None:
    for first, last, a in ((1, 1, 0.0), (1, 10, 3.0), (5, 17, 128.0), (3, 2, 1.0)):
        want = sum((t + a) ** 2 for t in range(first, last + 1))
        assert averaging_weight_sum(first, last, a) == pytest.approx(want, rel=1e-15)


def test_a_client_that_skips_rounds_counts_its_idle_steps() -> None:
    """hat-omega_k sums p_t omega_k^t over every t, including the steps the client
    sat out (its omega unchanged then): rounds 1 and 3 trained, round 2 skipped."""
    a = 5.0
    client = APFLClient(
        HETEROGENEOUS.model(),
        HETEROGENEOUS.loader(1),
        loss_fn=half_sse,
        learning_rate=0.1,
    )
    config = {
        "local-steps": 1,
        "apfl-alpha": 0.5,
        "apfl-mixing": "parameters",
        "apfl-personal-gradient": "mixture",
        "apfl-average-a": a,
    }
    client.fit([np.array([[1.0, 2.0, 3.0]])], {**config, "apfl-first-step": 0})
    omega_1, _ = personal_state(client)
    client.fit([np.array([[0.5, 0.0, 1.0]])], {**config, "apfl-first-step": 2})
    omega_3, _ = personal_state(client)
    want = (1 + a) ** 2 * omega_1 + (2 + a) ** 2 * omega_1 + (3 + a) ** 2 * omega_3
    saved = client.state.get("apfl-personal-sum")
    assert saved is not None and client.state.scalar("apfl-last-step") == 3
    np.testing.assert_allclose(saved[0].reshape(-1), want, rtol=1e-14)
    # evaluating at T = 5 adds steps 4 and 5 with omega_3, then normalises
    client.received_arrays = {"apfl-average-model": [np.zeros((1, 3))]}
    models = client.personal_models({**config, "apfl-step": 5})
    got = models["personal-avg"].weight.detach().numpy().reshape(-1)
    total = sum((t + a) ** 2 for t in range(1, 6))
    expected = 0.5 * (want + ((4 + a) ** 2 + (5 + a) ** 2) * omega_3) / total
    np.testing.assert_allclose(got, expected, rtol=1e-14)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"alpha": 1.5}, "alpha"),
        ({"alpha": -0.1}, "alpha"),
        ({"sync_gap": 0}, "sync_gap"),
        ({"mixing": "logits"}, "mixing"),
        ({"personal_gradient": "exact"}, "personal_gradient"),
        ({"mixing": "outputs", "personal_gradient": "mixture"}, "personal_gradient"),
        ({"lr_schedule": "cosine"}, "lr_schedule"),
        ({"lr_schedule": "decay"}, "strong_convexity"),
        ({"lr_schedule": "decay", "strong_convexity": -1.0}, "strong_convexity"),
        ({"condition_number": 0.0}, "condition_number"),
        ({"local_epochs": 2}, "local_epochs"),
        ({"drop_percent": 0.5}, "drop_percent"),
    ],
)
def test_invalid_hyperparameters_name_the_parameter(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        APFL(**kwargs)


def test_a_fedavg_server_gets_a_clear_protocol_error() -> None:
    client = APFLClient(
        HETEROGENEOUS.model(), HETEROGENEOUS.loader(0), loss_fn=half_sse
    )
    from flwr_prox_strategies import ProtocolError

    with pytest.raises(ProtocolError, match="APFL"):
        client.fit([np.zeros((1, 3))], {"server-round": 1, "local-epochs": 1})


def test_six_rounds_equal_three_plus_resume_plus_three(tmp_path) -> None:
    """Checkpoint the strategy, restart clients from their state_dir: the global
    model, the weighted average and every client's personal model and alpha are
    bit-identical to an uninterrupted run."""

    def make() -> APFL:
        return APFL(
            alpha=0.5,
            adaptive_alpha=True,
            sync_gap=3,
            fraction_train=0.5,
            min_train_nodes=2,
            min_available_nodes=4,
            fraction_evaluate=0.0,
            seed=2,
        )

    def grid(state_dir) -> InProcessGrid:
        return HETEROGENEOUS.grid(
            batch_size=5, shuffle=True, learning_rate=0.05, state_dir=str(state_dir)
        )

    start = initial([1, 2, 3])
    straight_strategy = make()
    straight_grid = grid(tmp_path / "a")
    straight = straight_strategy.start(
        grid=straight_grid, initial_arrays=start, num_rounds=6
    )
    first = make()
    half = first.start(grid=grid(tmp_path / "b"), initial_arrays=start, num_rounds=3)
    second = make()
    second.load_state_dict(first.state_dict())
    resumed_grid = grid(tmp_path / "b")  # fresh contexts: state comes from disk
    resumed = second.start(grid=resumed_grid, initial_arrays=half.arrays, num_rounds=3)
    assert (
        straight.arrays.to_numpy_ndarrays()[0].tobytes()
        == resumed.arrays.to_numpy_ndarrays()[0].tobytes()
    )
    a, b = straight_strategy.average_model(), second.average_model()
    assert a is not None and b is not None
    np.testing.assert_array_equal(a.to_numpy_ndarrays()[0], b.to_numpy_ndarrays()[0])
    for node in straight_grid.contexts:
        if ClientState(resumed_grid.contexts[node]).get("apfl-personal") is None:
            continue  # not sampled after the restart: its state is still on disk only
        np.testing.assert_array_equal(
            personal(straight_grid, node)[0], personal(resumed_grid, node)[0]
        )
        assert personal(straight_grid, node)[1] == personal(resumed_grid, node)[1]
    with pytest.raises(ValueError, match="sync_gap"):
        APFL(sync_gap=4, seed=2).load_state_dict(first.state_dict())

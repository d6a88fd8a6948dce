"""DP-SGD on the pack's clients: checked against a hand-written step and opacus."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from opacus.accountants import PRVAccountant, RDPAccountant
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flwr_prox_strategies import (
    DPSGD,
    FedAvg,
    FedAvgClient,
    FedEPMClient,
    FedProxClient,
    PrivacyBudgetExhausted,
    ProtocolError,
    to_client_app,
)
from flwr_prox_strategies.core.client.dp import unsupported_layers
from flwr_prox_strategies.core.contract.ledger import (
    EPSILON_METRIC,
    EPSILON_TOTAL_METRIC,
)
from flwr_prox_strategies.core.transport.keys import REPORT_GRADIENT_KEY

from .helpers import record, sampling_grid
from .test_adapter import context, train_message
from .test_contract import build_reply, good_content, setup_round

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def dataset(n: int = 8, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=gen) * 3
    y = torch.randint(0, 2, (n,), generator=gen)
    return TensorDataset(x, y)


def linear(seed: int = 1) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(3, 2)


def hand_dp_sgd(
    weight: torch.Tensor,
    bias: torch.Tensor,
    data: TensorDataset,
    *,
    steps: int,
    lr: float,
    sigma: float,
    clip: float,
    seed: int,
    extra=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DP-SGD written out: per-example gradient, clip, sum, noise, mean, + extra."""
    generator = torch.Generator().manual_seed(seed)
    w, b = weight.clone(), bias.clone()
    x, y = data.tensors
    for _ in range(steps):
        sum_w, sum_b = torch.zeros_like(w), torch.zeros_like(b)
        for i in range(len(y)):
            wi, bi = w.clone().requires_grad_(), b.clone().requires_grad_()
            loss = nn.functional.cross_entropy(x[i : i + 1] @ wi.T + bi, y[i : i + 1])
            gw, gb = torch.autograd.grad(loss, (wi, bi))
            norm = torch.sqrt((gw**2).sum() + (gb**2).sum())
            factor = (clip / (norm + 1e-6)).clamp(max=1.0)  # opacus' clip factor
            sum_w += factor * gw
            sum_b += factor * gb
        noise_w = torch.normal(0, sigma * clip, w.shape, generator=generator)
        noise_b = torch.normal(0, sigma * clip, b.shape, generator=generator)
        grad_w = (sum_w + noise_w) / len(y)
        grad_b = (sum_b + noise_b) / len(y)
        if extra is not None:
            extra_w, extra_b = extra(w, b)
            grad_w, grad_b = grad_w + extra_w, grad_b + extra_b
        w, b = w - lr * grad_w, b - lr * grad_b
    return w, b


def fit_once(client, config):
    params = client.get_parameters({})
    return client.fit(params, {"server-round": 1, **config})


def test_private_step_equals_hand_written_clip_and_noise() -> None:
    data = dataset()
    model = linear()
    weight, bias = model.weight.detach().clone(), model.bias.detach().clone()
    dp = DPSGD(noise_multiplier=0.7, clipping_norm=0.1, poisson_sampling=False)
    client = FedAvgClient(
        model, DataLoader(data, batch_size=8), learning_rate=0.5, dp=dp, seed=3
    )
    new, _, metrics = fit_once(client, {"local-steps": 1})
    w, b = hand_dp_sgd(
        weight, bias, data, steps=1, lr=0.5, sigma=0.7, clip=0.1,
        seed=client.noise_seed(),
    )  # fmt: skip
    np.testing.assert_allclose(new[0], w.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new[1], b.numpy(), rtol=1e-5, atol=1e-6)
    # Clipping was active, and noise was added: plain SGD lands elsewhere.
    plain, _, _ = fit_once(
        FedAvgClient(linear(), DataLoader(data, batch_size=8), learning_rate=0.5),
        {"local-steps": 1},
    )
    assert not np.allclose(new[0], plain[0], atol=1e-3)
    assert metrics[EPSILON_TOTAL_METRIC] > 0


def test_proximal_term_is_added_unclipped_and_unnoised() -> None:
    """FedProx with mu = 40: its gradient at step 2 is far above the clip norm."""
    data = dataset()
    model = linear()
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    mu, lr, clip = 40.0, 0.5, 0.05
    dp = DPSGD(noise_multiplier=0.5, clipping_norm=clip, poisson_sampling=False)
    client = FedProxClient(
        model, DataLoader(data, batch_size=8), learning_rate=lr, dp=dp, seed=5
    )
    new, _, _ = fit_once(client, {"local-steps": 2, "proximal-mu": mu})

    def proximal(w, b):
        return mu * (w - w0), mu * (b - b0)

    w, b = hand_dp_sgd(
        w0, b0, data, steps=2, lr=lr, sigma=0.5, clip=clip,
        seed=client.noise_seed(), extra=proximal,
    )  # fmt: skip
    np.testing.assert_allclose(new[0], w.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new[1], b.numpy(), rtol=1e-5, atol=1e-6)
    # The test can fail: the proximal gradient at step 2 exceeds the clip norm,
    # so clipping it (or dropping it) lands elsewhere.
    w1, b1 = hand_dp_sgd(
        w0, b0, data, steps=1, lr=lr, sigma=0.5, clip=clip, seed=client.noise_seed()
    )
    prox_w, prox_b = proximal(w1, b1)
    assert float(torch.sqrt((prox_w**2).sum() + (prox_b**2).sum())) > 10 * clip
    without, _ = hand_dp_sgd(
        w0, b0, data, steps=2, lr=lr, sigma=0.5, clip=clip, seed=client.noise_seed()
    )
    assert not np.allclose(new[0], without.numpy(), atol=1e-3)


@pytest.mark.parametrize(
    ("name", "accountant"), [("rdp", RDPAccountant), ("prv", PRVAccountant)]
)
def test_epsilon_matches_opacus_accountant(name, accountant) -> None:
    data = dataset(n=60)
    loader = DataLoader(data, batch_size=10, shuffle=True)
    dp = DPSGD(noise_multiplier=1.1, clipping_norm=1.0, delta=1e-4, accountant=name)
    client = FedAvgClient(linear(), loader, dp=dp, seed=0)
    reference = accountant()
    params = client.get_parameters({})
    previous = 0.0
    for server_round in (1, 2, 3):
        params, _, metrics = client.fit(
            params, {"server-round": server_round, "local-epochs": 2}
        )
        for _ in range(2 * len(loader)):
            reference.step(noise_multiplier=1.1, sample_rate=1 / len(loader))
        expected = reference.get_epsilon(delta=1e-4)
        assert metrics["local-steps"] == 2 * len(loader)
        assert metrics[EPSILON_TOTAL_METRIC] == pytest.approx(expected, rel=1e-6)
        assert metrics[EPSILON_METRIC] == pytest.approx(expected - previous, rel=1e-5)
        assert metrics["dp-delta"] == 1e-4
        previous = expected


def test_poisson_sampling_draws_batches_of_varying_size() -> None:
    seen: list[int] = []
    model = linear()
    model.register_forward_pre_hook(lambda module, args: seen.append(len(args[0])))
    dp = DPSGD(noise_multiplier=1.0, clipping_norm=1.0)
    client = FedAvgClient(model, DataLoader(dataset(n=200), batch_size=20), dp=dp)
    fit_once(client, {"local-epochs": 3})
    assert len(seen) == 30 and len(set(seen)) > 3  # Poisson: sizes vary
    assert 15 < np.mean(seen) < 25  # around q * N = 20


def budget_client(target: float) -> FedAvgClient:
    dp = DPSGD(noise_multiplier=1.0, clipping_norm=1.0, target_epsilon=target)
    return FedAvgClient(linear(), DataLoader(dataset(n=40), batch_size=10), dp=dp)


def test_budget_exhaustion_stops_the_client_and_spends_nothing() -> None:
    client = budget_client(target=8.0)
    params = client.get_parameters({})
    totals = []
    with pytest.raises(PrivacyBudgetExhausted, match="target_epsilon=8"):
        for server_round in range(1, 50):
            params, _, metrics = client.fit(
                params, {"server-round": server_round, "local-epochs": 1}
            )
            totals.append(metrics[EPSILON_TOTAL_METRIC])
    assert 1 < len(totals) < 49 and max(totals) <= 8.0
    before = [t.detach().clone() for t in client.model.state_dict().values()]
    with pytest.raises(PrivacyBudgetExhausted):
        client.fit(params, {"server-round": 99, "local-epochs": 1})
    # The refused round trained nothing and spent nothing.
    after = list(client.model.state_dict().values())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    from flwr_prox_strategies.core.client.dp import PrivacyLedger

    assert PrivacyLedger(client.dp, client.state).epsilon() == pytest.approx(totals[-1])


def test_exhausted_client_is_absent_not_failed_and_is_not_sampled_again() -> None:
    # The ClientApp's reply says why...
    app = to_client_app(lambda context: budget_client(target=0.5))
    model = ArrayRecord(linear().state_dict())
    answer = app(
        train_message(model, {"server-round": 1, "local-epochs": 1}), context()
    )
    assert answer.has_error()
    assert answer.error.reason.startswith("PrivacyBudgetExhausted:")

    # ... and the strategy treats it as absent: same round as without it.
    strategy, messages, good = setup_round("fedavg")
    reference, _, good_b = setup_round("fedavg")
    # (The reference misses node 0's reply: a failure, which it must accept.)
    strategy.accept_failures = False
    exhausted = Message(answer.error, reply_to=messages[0])
    arrays, metrics = strategy.aggregate_train(1, [exhausted, *good[1:]])
    arrays_b, _ = reference.aggregate_train(1, good_b[1:])
    assert arrays is not None and arrays_b is not None  # not a failure
    for key in arrays:
        assert arrays[key].numpy().tobytes() == arrays_b[key].numpy().tobytes()
    assert metrics["replies-absent"] == 1 and metrics["replies-failed"] == 0
    assert strategy.retired_nodes == {messages[0].metadata.dst_node_id}
    # Later rounds never sample it; the retirement survives a checkpoint.
    grid = sampling_grid(5)
    sampled = {
        m.metadata.dst_node_id
        for m in strategy.configure_train(2, arrays, ConfigRecord(), grid)
    }
    assert messages[0].metadata.dst_node_id not in sampled and len(sampled) == 4
    resumed = FedAvg(min_available_nodes=5)
    resumed.load_state_dict(strategy.state_dict())
    assert resumed.retired_nodes == strategy.retired_nodes


def test_strategy_reports_every_clients_epsilon() -> None:
    strategy = FedAvg(min_available_nodes=3, per_client_metrics=True)
    arrays = record({"w": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.float32)})
    messages = list(
        strategy.configure_train(1, arrays, ConfigRecord(), sampling_grid(3))
    )
    replies = [
        build_reply(
            m,
            good_content(strategy, i),
            metrics={
                "client-key": 10 + i,
                EPSILON_METRIC: 0.5,
                EPSILON_TOTAL_METRIC: 1.0 + i,
            },
        )
        for i, m in enumerate(messages)
    ]
    _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["dp-epsilon-total-per-client"] == [1.0, 2.0, 3.0]
    assert metrics["dp-epsilon-client-keys"] == [10, 11, 12]
    assert metrics["dp-epsilon-total-max"] == 3.0
    # A round in which nobody trains still reports what was spent.
    strategy.configure_train(2, arrays, ConfigRecord(), sampling_grid(3))
    _, quiet = strategy.aggregate_train(2, [])
    assert quiet["dp-epsilon-total-max"] == 3.0


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.hidden(x))))


def test_batchnorm_is_refused_naming_the_layer_or_fixed_on_request() -> None:
    loader = DataLoader(dataset(n=40), batch_size=10)
    dp = DPSGD(noise_multiplier=1.0, clipping_norm=1.0)
    with pytest.raises(ValueError, match=r"'norm' \(BatchNorm1d\).*fix_model=True"):
        FedAvgClient(WithBatchNorm(), loader, dp=dp)
    assert unsupported_layers(WithBatchNorm()) and not unsupported_layers(linear())
    fixed = DPSGD(noise_multiplier=1.0, clipping_norm=1.0, fix_model=True)
    client = FedAvgClient(WithBatchNorm(), loader, dp=fixed)
    assert isinstance(client.model.norm, nn.GroupNorm)
    _, _, metrics = fit_once(client, {"local-epochs": 1})
    assert math.isfinite(metrics["train-loss"]) and metrics[EPSILON_TOTAL_METRIC] > 0


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"noise_multiplier": math.nan}, "noise_multiplier"),
        ({"clipping_norm": 0.0}, "clipping_norm"),
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"accountant": "gdp-typo"}, "accountant"),
        ({"target_epsilon": -2.0}, "target_epsilon"),
        ({"target_epsilon": 1.0, "noise_multiplier": 0.0}, "target_epsilon"),
    ],
)
def test_invalid_settings_fail_at_construction_naming_the_parameter(
    kwargs, name
) -> None:
    settings = {"noise_multiplier": 1.0, "clipping_norm": 1.0, **kwargs}
    with pytest.raises(ValueError, match=name):
        DPSGD(**settings)


def test_clients_that_cannot_use_dp_sgd_say_why() -> None:
    dp = DPSGD(noise_multiplier=1.0, clipping_norm=1.0)
    data = dataset(n=20)
    with pytest.raises(ValueError, match="DataLoader"):
        FedAvgClient(linear(), [data.tensors], dp=dp)
    with pytest.raises(ValueError, match="gamma"):
        FedProxClient(linear(), DataLoader(data, batch_size=5), gamma=0.5, dp=dp)
    with pytest.raises(ValueError, match="Laplace"):
        FedEPMClient(linear(), DataLoader(data, batch_size=5), dp=dp)
    with pytest.raises(TypeError, match="dp must be a DPSGD"):
        FedAvgClient(linear(), DataLoader(data, batch_size=5), dp={"sigma": 1})
    client = FedAvgClient(linear(), DataLoader(data, batch_size=5), dp=dp)
    with pytest.raises(ProtocolError, match="not private"):
        fit_once(client, {REPORT_GRADIENT_KEY: True})


@pytest.mark.parametrize(
    "strategy", ["fedavg", "fedprox", "feddyn", "feddc", "scaffold", "apfl"]
)
def test_every_client_trains_privately_from_the_privacy_group(
    tmp_path: Path, strategy: str
) -> None:
    from flwr_prox_strategies.experiment.sweeps.sweep import run_inprocess

    overrides = [
        f"strategy={strategy}",
        "privacy=dp-sgd",
        "privacy.dp.noise_multiplier=1.0",
        "num_clients=3",
        "num_rounds=2",
        "model=logreg",
        "train.local_epochs=1",
    ]
    if strategy == "apfl":
        overrides.append("strategy.sync_gap=5")
    results = json.loads(run_inprocess(overrides, tmp_path, 3).read_text())
    train = results["rounds"][-1]["train"]
    assert train["replies-valid"] == 3
    per_client = train["dp-epsilon-total-per-client"]
    assert len(per_client) == 3 and all(0 < e < math.inf for e in per_client)
    assert train["dp-epsilon-total-max"] == max(per_client)
    # Under DP-SGD too, every optimiser step's update held the rule's term
    # (added after opacus' clipping and noise, measured at the inner step).
    assert train.get("replies-term-incomplete", 0) == 0
    assert train.get("term-lost-steps", 0) == train.get("term-missing-steps", 0) == 0
    assert results["summary"]["final-accuracy"] is not None
    assert results["summary"]["final-epsilon-max"] == max(per_client)
    assert results["summary"]["delta"] == pytest.approx(1e-5)
    assert (tmp_path / "privacy.png").stat().st_size > 0
    ledger = json.loads((tmp_path / "privacy-ledger.json").read_text())
    assert sorted(ledger["epsilon-total"].values()) == sorted(per_client)


@pytest.mark.parametrize("mixing", [None, "parameters", "outputs"])
def test_an_empty_poisson_batch_is_a_noise_only_step(mixing) -> None:
    """Three examples, q = 1/2: some of 40 batches are empty (p = 1/8 each)."""
    from flwr_prox_strategies import APFLClient

    data = dataset(n=3)
    dp = DPSGD(noise_multiplier=1.0, clipping_norm=1.0)
    loader = DataLoader(data, batch_size=2)
    config = {"local-steps": 40, "proximal-mu": 0.1}
    if mixing is None:
        client = FedProxClient(linear(), loader, dp=dp, seed=0)
    else:
        client = APFLClient(linear(), loader, dp=dp, seed=0)
        config.update(
            {
                "apfl-alpha": 0.5,
                "apfl-adaptive-alpha": True,
                "apfl-mixing": mixing,
                "apfl-personal-gradient": "mixture",
                "apfl-first-step": 0,
            }
        )
    new, _, metrics = fit_once(client, config)
    assert metrics["local-steps"] == 40
    assert math.isfinite(metrics["train-loss"])
    assert all(np.isfinite(a).all() for a in new)
    if mixing is not None:
        assert math.isfinite(metrics["personal-train-loss"])
        personal = client.state.get("apfl-personal")
        assert personal is not None and all(np.isfinite(p).all() for p in personal)


@pytest.mark.parametrize("mixing", ["parameters", "outputs"])
def test_apfl_global_copy_takes_exactly_the_dp_sgd_steps_of_fedavg(mixing) -> None:
    """APFL's theta is plain SGD on the data: under DP-SGD it must match FedAvg's
    private steps draw for draw, untouched by the personal model's step (whose
    forward and backward must not leave per-example gradients on theta)."""
    from flwr_prox_strategies import APFLClient

    dp = DPSGD(noise_multiplier=0.8, clipping_norm=0.5)
    data = dataset(n=40)
    config = {
        "server-round": 1,
        "local-steps": 6,
        "apfl-alpha": 0.5,
        "apfl-mixing": mixing,
        "apfl-personal-gradient": "mixture",
        "apfl-first-step": 0,
    }
    apfl = APFLClient(linear(), DataLoader(data, batch_size=8), dp=dp, seed=4)
    fedavg = FedAvgClient(linear(), DataLoader(data, batch_size=8), dp=dp, seed=4)
    theta, _, apfl_metrics = fit_once(apfl, config)
    reference, _, fedavg_metrics = fit_once(fedavg, {"local-steps": 6})
    for a, b in zip(theta, reference, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert apfl_metrics[EPSILON_TOTAL_METRIC] == fedavg_metrics[EPSILON_TOTAL_METRIC]


def test_a_run_whose_every_client_retires_stops_with_a_clear_message(
    tmp_path: Path,
) -> None:
    from flwr_prox_strategies.experiment.sweeps.sweep import run_inprocess

    base = [
        "strategy=fedavg",
        "privacy=dp-sgd",
        "num_clients=3",
        "model=logreg",
        "train.local_epochs=1",
    ]
    one = json.loads(
        run_inprocess([*base, "num_rounds=1"], tmp_path / "one", 3).read_text()
    )
    first = one["rounds"][-1]["train"]["dp-epsilon-total-max"]
    # A budget the first round fits in and the second does not, for everyone.
    overrides = [*base, "num_rounds=6", f"privacy.dp.target_epsilon={1.1 * first}"]
    results = json.loads(run_inprocess(overrides, tmp_path / "six", 3).read_text())
    stopped = results["stopped-early"]
    assert (
        "every one of the 3 connected node(s) has spent its privacy budget"
        in (stopped["reason"])
    )
    rounds = {r["round"]: r for r in results["rounds"]}
    last = max(rounds)  # clients retire as their own epsilon reaches the budget
    assert stopped["round"] == last + 1 <= 6  # no idle rounds after that
    assert rounds[1]["train"]["replies-valid"] == 3
    assert rounds[last]["train"]["dp-clients-retired"] == 3
    assert results["summary"]["final-accuracy"] is not None


def test_round_rows_list_every_client_only_up_to_the_limit() -> None:
    """10,000 clients' epsilons are not copied into every round's metrics."""
    from flwr_prox_strategies.core.contract.ledger import (
        PER_CLIENT_LIMIT,
        privacy_metrics,
    )

    small = privacy_metrics({k: float(k) for k in range(PER_CLIENT_LIMIT)})
    assert small["dp-epsilon-total-per-client"] == [float(k) for k in range(100)]
    assert "dp-epsilon-total-median" not in small
    large = privacy_metrics({k: float(k) for k in range(10_001)})
    assert "dp-epsilon-total-per-client" not in large
    assert "dp-epsilon-client-keys" not in large
    assert large["dp-epsilon-total-median"] == 5000.0
    assert large["dp-epsilon-total-max"] == 10_000.0
    assert large["dp-epsilon-total-mean"] == 5000.0
    assert large["dp-clients-reporting"] == 10_001

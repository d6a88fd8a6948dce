"""Client rules in a user's own Message-API ClientApp and training loop.

The same rule object runs inside the pack's ``XxxClient`` and inside a
hand-written ``@app.train()`` function with dict batches and the user's own
optimiser: both must give the same models (one rule, two loops), and the
hand-written one must give the algorithm's update (checked by hand).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import (
    ArrayRecord,
    Context,
    Message,
)
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader, Dataset

from flwr_prox_strategies import (
    APFL,
    APFLClient,
    APFLRule,
    ClientRule,
    FedAvgClient,
    FedEPM,
    FedEPMClient,
    FedEPMRule,
    FedProxRule,
    ProtocolError,
    Scaffold,
    ScaffoldRule,
    SFedProx,
    SFedProxClient,
    SFedRule,
    to_client_app,
)
from flwr_prox_strategies.algorithms import ALGORITHMS
from flwr_prox_strategies.core.client.training import BatchFormatError
from flwr_prox_strategies.core.server.outcome import NoRoundAggregatedError
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid

from .helpers import context, train_message
from .lsq import LeastSquares, half_sse, rule_app

EPOCHS = 3
LR = 0.05


class DictData(Dataset):
    """Rows as flwr-datasets gives them: a mapping per example."""

    def __init__(self, a: np.ndarray, b: np.ndarray, keys=("img", "label")) -> None:
        self.a, self.b, self.keys = torch.from_numpy(a), torch.from_numpy(b), keys

    def __len__(self) -> int:
        return len(self.a)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {self.keys[0]: self.a[i], self.keys[1]: self.b[i]}


def dict_loader(problem: LeastSquares, k: int, batch_size: int = 5) -> DataLoader:
    return DataLoader(DictData(problem.a[k], problem.b[k]), batch_size=batch_size)


def own_client_app(
    problem: LeastSquares,
    rule_cls: type[ClientRule],
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
) -> ClientApp:
    """A user's Message-API client: own loop, own optimiser, dict batches."""

    def train(k: int, model: torch.nn.Module, rule: ClientRule) -> Message:
        optimizer = rule.attach(make_optimizer(model))
        loader = dict_loader(problem, k)
        for _ in range(EPOCHS):
            for batch in loader:
                optimizer.zero_grad()
                loss = half_sse(model(batch["img"]), batch["label"])
                loss.backward()
                optimizer.step()
        return rule.reply(
            num_examples=len(loader.dataset), metrics={"train-loss": loss.item()}
        )

    return rule_app(problem, rule_cls, train)


def pack_client_app(problem: LeastSquares, client_cls, **kwargs) -> ClientApp:
    def client_fn(context: Context):
        k = int(context.node_config["partition-id"])
        model = torch.nn.Linear(problem.dim, 1, bias=False)
        return client_cls(
            model,
            dict_loader(problem, k),
            **{"loss_fn": half_sse, **kwargs},
            local_epochs=EPOCHS,
            learning_rate=LR,
        )

    return to_client_app(client_fn)


def run(problem: LeastSquares, strategy, app: ClientApp, rounds: int = 4):
    grid = InProcessGrid(app, num_nodes=len(problem.a))
    result = strategy.start(
        grid=grid, initial_arrays=problem.initial(), num_rounds=rounds
    )
    return result.arrays.to_numpy_ndarrays()[0][0], grid


#: Rules a user's plain loop (minibatch steps, one optimiser) cannot run: each
#: has its own-loop test below. Every other rule of the table runs the plain loop.
OWN_LOOP_ELSEWHERE = {
    "apfl": "test_apfl_rule_in_own_loop_equals_apfl_client (a personal model too)",
    "fedepm": "test_full_gradient_rules_in_own_client (full-gradient solver)",
    "sfedavg": "test_full_gradient_rules_in_own_client (full-gradient solver)",
    "sfedprox": "test_full_gradient_rules_in_own_client (full-gradient solver)",
}

#: Every algorithm of the table with a client and a rule: its first configuration,
#: with four nodes and no evaluation.
CASES = [
    pytest.param(name, algorithm, id=name)
    for name, algorithm in ALGORITHMS.items()
    if algorithm.rule is not None and name not in OWN_LOOP_ELSEWHERE
]


def table_strategy(algorithm):
    make = next(iter(algorithm.cases.values()))
    strategy = make(4)
    strategy.fraction_evaluate = 0.0
    return strategy


def test_every_rule_has_an_own_loop_test() -> None:
    covered = {p.values[0] for p in CASES} | set(OWN_LOOP_ELSEWHERE)
    with_rules = {n for n, a in ALGORITHMS.items() if a.rule is not None}
    assert with_rules <= covered


@pytest.fixture(scope="module")
def problem() -> LeastSquares:
    return LeastSquares()


@pytest.mark.parametrize(("name", "algorithm"), CASES)
def test_own_loop_equals_pack_client(problem, name, algorithm):
    """The user's loop with the rule gives the pack client's models."""
    momentum = 0.0 if algorithm.rule.plain_sgd else 0.9
    own, _ = run(
        problem,
        table_strategy(algorithm),
        own_client_app(
            problem,
            algorithm.rule,
            lambda m: torch.optim.SGD(m.parameters(), lr=LR, momentum=momentum),
        ),
    )
    pack, _ = run(
        problem,
        table_strategy(algorithm),
        pack_client_app(problem, algorithm.client, momentum=momentum),
    )
    np.testing.assert_allclose(own, pack, rtol=1e-6, atol=1e-7)
    assert np.linalg.norm(pack) > 1.0  # four rounds moved the model from zero


def test_fedprox_rule_with_momentum_by_hand(problem):
    """Three heavy-ball steps on f_k + (mu/2)||w - w_t||^2, in numpy."""
    mu, lr, beta = 0.7, 0.05, 0.9
    a, b = problem.a[1].astype(np.float64), problem.b[1].astype(np.float64)
    w_t = np.linspace(-1, 1, problem.dim)
    model = torch.nn.Linear(problem.dim, 1, bias=False)
    msg = train_message(
        ArrayRecord([w_t.reshape(1, -1).astype(np.float32)]),
        {"proximal-mu": mu, "server-round": 1},
    )
    rule = FedProxRule.from_message(msg, context(), model)
    optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=lr, momentum=beta))
    x, y = torch.from_numpy(problem.a[1]), torch.from_numpy(problem.b[1])
    for _ in range(3):
        optimizer.zero_grad()
        half_sse(model(x), y).backward()
        optimizer.step()
    w, v = w_t.astype(np.float32).astype(np.float64), np.zeros(problem.dim)
    for _ in range(3):
        grad = a.T @ (a @ w - b) + mu * (w - w_t)
        v = beta * v + grad
        w = w - lr * v
    np.testing.assert_allclose(
        model.weight.detach().numpy()[0], w, rtol=1e-4, atol=1e-5
    )
    reply = rule.reply(num_examples=20)
    metrics = reply.content["metrics"]
    assert metrics["proximal-mu-applied"] == 3  # every step held the term
    assert metrics["local-steps"] == 3
    assert metrics["term-lost-steps"] == metrics["term-missing-steps"] == 0
    assert metrics["num-examples"] == 20
    np.testing.assert_allclose(
        reply.content["arrays"].to_numpy_ndarrays()[0][0], w, rtol=1e-4, atol=1e-5
    )


def test_scaffold_rule_by_hand_and_state_commit(problem):
    """One SCAFFOLD round by hand; c_i advances only when the server confirms."""
    lr = 0.1
    x0 = np.zeros((1, problem.dim), np.float32)
    c = np.full((1, problem.dim), 0.3, np.float32)
    ctx = context(2)
    model = torch.nn.Linear(problem.dim, 1, bias=False)
    msg = train_message(
        ArrayRecord([x0]),
        {"server-round": 1, "accepted-round": -1},
        {"control": ArrayRecord([c])},
    )
    rule = ScaffoldRule.from_message(msg, ctx, model)
    optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=lr))
    xs, ys = torch.from_numpy(problem.a[2]), torch.from_numpy(problem.b[2])
    for _ in range(2):
        optimizer.zero_grad()
        half_sse(model(xs), ys).backward()
        optimizer.step()
    reply = rule.reply(num_examples=20)
    a, b = problem.a[2].astype(np.float64), problem.b[2].astype(np.float64)
    y = np.zeros(problem.dim)
    for _ in range(2):
        y = y - lr * (a.T @ (a @ y - b) + c[0])  # c_i = 0 at first
    ci_new = -c[0] + (0 - y) / (2 * lr)
    delta = reply.content["control-delta"].to_numpy_ndarrays()[0][0]
    np.testing.assert_allclose(delta, ci_new, rtol=1e-4, atol=1e-5)
    assert reply.content["metrics"]["client-key"] == 2
    assert reply.content["metrics"]["scaffold-applied"] == 2  # both steps
    # Round 2 says round 1 was not aggregated: c_i stays 0.
    msg2 = train_message(
        ArrayRecord([x0]),
        {"server-round": 2, "accepted-round": -1},
        {"control": ArrayRecord([c])},
    )
    rule2 = ScaffoldRule.from_message(
        msg2, ctx, torch.nn.Linear(problem.dim, 1, bias=False)
    )
    assert all(float(t.abs().sum()) == 0.0 for t in rule2.ci)


def test_plain_sgd_rules_refuse_momentum_and_adam():
    model = torch.nn.Linear(3, 1, bias=False)
    msg = train_message(
        ArrayRecord([np.zeros((1, 3), np.float32)]),
        {"server-round": 1},
        {"control": ArrayRecord([np.zeros((1, 3), np.float32)])},
    )
    rule = ScaffoldRule.from_message(msg, context(), model)
    with pytest.raises(ValueError, match="momentum=0"):
        rule.attach(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match="got Adam"):
        rule.attach(torch.optim.Adam(model.parameters()))


def test_rule_names_the_strategy_it_needs():
    model = torch.nn.Linear(3, 1, bias=False)
    msg = train_message(ArrayRecord([np.zeros((1, 3), np.float32)]), {"lr": 0.1})
    with pytest.raises(ProtocolError, match=r"proximal-mu.*FedProx"):
        FedProxRule.from_message(msg, context(), model)
    with pytest.raises(ProtocolError, match="'control' that Scaffold sends"):
        ScaffoldRule.from_message(msg, context(), model)


def test_attach_refuses_an_optimizer_of_another_model():
    model = torch.nn.Linear(3, 1, bias=False)
    msg = train_message(
        ArrayRecord([np.zeros((1, 3), np.float32)]), {"proximal-mu": 0.1}
    )
    rule = FedProxRule.from_message(msg, context(), model)
    other = torch.nn.Linear(3, 1, bias=False)
    with pytest.raises(ValueError, match="does not update"):
        rule.attach(torch.optim.SGD(other.parameters(), lr=0.1))


def test_pack_client_refuses_unreadable_batches_at_construction(problem):
    loader = DataLoader(
        DictData(problem.a[0], problem.b[0], keys=("image", "target")), batch_size=4
    )
    with pytest.raises(
        BatchFormatError,
        match=r"train_loader must yield \(inputs, targets\) or a mapping with keys "
        r"'img' or 'image' and 'label'; got dict with keys \['image', 'target'\]",
    ):
        FedAvgClient(torch.nn.Linear(problem.dim, 1), loader)
    client = FedAvgClient(torch.nn.Linear(problem.dim, 1), loader, label_key="target")
    assert client.num_train_examples() == 20
    triples = DataLoader(
        [(torch.zeros(3), torch.tensor(0), torch.tensor(1))] * 4, batch_size=2
    )
    with pytest.raises(BatchFormatError, match="got list of length 3"):
        FedAvgClient(torch.nn.Linear(3, 2), triples)
    pairs = DataLoader([(torch.zeros(3), torch.tensor(0))] * 4, batch_size=2)
    FedAvgClient(torch.nn.Linear(3, 2), pairs, batch_fn=lambda b: (b[0], b[1]))


def test_construction_peek_leaves_shuffling_unchanged(problem):
    data = DictData(problem.a[0], problem.b[0])
    model = torch.nn.Linear(problem.dim, 1)
    torch.manual_seed(5)
    expected = [
        b["label"].tolist() for b in DataLoader(data, batch_size=4, shuffle=True)
    ]
    torch.manual_seed(5)
    client = FedAvgClient(model, DataLoader(data, batch_size=4, shuffle=True))
    assert [t.tolist() for _, t in client.train_loader] == expected


def test_server_lr_is_honoured(problem):
    """A server-sent ``lr`` (Flower's examples send one) sets the step size."""

    def one_round(config_lr: float | None, use_server_lr: bool = True) -> np.ndarray:
        client = FedAvgClient(
            torch.nn.Linear(problem.dim, 1, bias=False),
            problem.loader(0),
            loss_fn=half_sse,
            learning_rate=0.01,
            use_server_lr=use_server_lr,
        )
        config = {"server-round": 1, **({} if config_lr is None else {"lr": config_lr})}
        arrays, _, _ = client.fit([np.zeros((1, problem.dim), np.float32)], config)
        return arrays[0]

    a, b = problem.a[0].astype(np.float64), problem.b[0].astype(np.float64)
    step = -(a.T @ (0 - b))  # minus the gradient at 0
    np.testing.assert_allclose(one_round(0.2)[0], 0.2 * step, rtol=1e-4)
    np.testing.assert_allclose(one_round(None)[0], 0.01 * step, rtol=1e-4)
    np.testing.assert_allclose(
        one_round(0.2, use_server_lr=False)[0], 0.01 * step, rtol=1e-4
    )


def test_construction_peek_leaves_a_loader_generator_unchanged(problem):
    data = DictData(problem.a[0], problem.b[0])

    def loader():
        return DataLoader(
            data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3)
        )

    expected = [b["label"].tolist() for b in loader()]
    client = FedAvgClient(torch.nn.Linear(problem.dim, 1), loader())
    assert [t.tolist() for _, t in client.train_loader] == expected


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.squeeze(-1), y)


def own_solver_app(problem: LeastSquares, rule_cls) -> ClientApp:
    """A user's client for the full-gradient methods: own objective, dict data."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        k = int(context.node_config["partition-id"])
        model = torch.nn.Linear(problem.dim, 1, bias=False)
        data = DictData(problem.a[k], problem.b[k])
        rule = rule_cls.from_message(
            msg, context, model, num_examples=len(data), seed=7
        )

        def objective():
            batch = next(iter(DataLoader(data, batch_size=len(data))))
            loss = mse(model(batch["img"]), batch["label"])
            grads = torch.autograd.grad(loss, list(model.parameters()))
            return float(loss), [g.detach() for g in grads]

        rule.solve(objective)
        return rule.reply(num_examples=len(data))

    return app


@pytest.mark.parametrize(
    ("strategy", "rule", "client"),
    [
        (
            lambda: FedEPM(num_clients=4, k0=3, noise=0.5, fraction_evaluate=0.0),
            FedEPMRule,
            FedEPMClient,
        ),
        (
            lambda: SFedProx(num_clients=4, k0=2, noise=0.0, fraction_evaluate=0.0),
            SFedRule,
            SFedProxClient,
        ),
    ],
)
def test_full_gradient_rules_in_own_client(problem, strategy, rule, client):
    """FedEPM's and SFedProx's rules in a user's client give the pack's models."""
    own, _ = run(problem, strategy(), own_solver_app(problem, rule), rounds=3)
    pack, _ = run(
        problem,
        strategy(),
        pack_client_app(problem, client, seed=7, loss_fn=mse),
        rounds=3,
    )
    np.testing.assert_allclose(own, pack, rtol=1e-5, atol=1e-6)
    assert np.linalg.norm(pack) > 0.1


def own_apfl_app(problem: LeastSquares) -> ClientApp:
    """A user's APFL client: own loop over dict batches, the rule beside it."""

    def train(k: int, model: torch.nn.Module, rule: APFLRule) -> Message:
        optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=LR))
        loader = dict_loader(problem, k)
        steps = 0
        while steps < rule.local_steps:
            for batch in loader:
                if steps == rule.local_steps:
                    break
                optimizer.zero_grad()
                loss = half_sse(model(batch["img"]), batch["label"])
                loss.backward()
                rule.personal_step(batch["img"], batch["label"], half_sse)
                optimizer.step()
                steps += 1
        return rule.reply(num_examples=len(loader.dataset))

    return rule_app(problem, APFLRule, train)


@pytest.mark.parametrize(
    "settings",
    [
        {"mixing": "parameters", "adaptive_alpha": True},
        {"mixing": "outputs", "adaptive_alpha": True},
        {
            "mixing": "parameters",
            "lr_schedule": "decay",
            "strong_convexity": 4.0,
            "condition_number": 0.01,
        },
    ],
)
def test_apfl_rule_in_own_loop_equals_apfl_client(problem, settings):
    """theta, omega, alpha and the weighted averages agree with APFLClient."""

    def strategy():
        return APFL(alpha=0.4, sync_gap=6, fraction_evaluate=0.0, **settings)

    own_grid = InProcessGrid(own_apfl_app(problem), num_nodes=4)
    own = strategy().start(
        grid=own_grid, initial_arrays=problem.initial(), num_rounds=3
    )
    pack_grid = InProcessGrid(pack_client_app(problem, APFLClient), num_nodes=4)
    pack = strategy().start(
        grid=pack_grid, initial_arrays=problem.initial(), num_rounds=3
    )
    np.testing.assert_allclose(
        own.arrays.to_numpy_ndarrays()[0], pack.arrays.to_numpy_ndarrays()[0], rtol=1e-6
    )
    for node in own_grid.contexts:  # each client's omega_k and alpha_k
        mine, theirs = own_grid.contexts[node].state, pack_grid.contexts[node].state
        for name in ("apfl-personal", "scalar:apfl-alpha"):
            np.testing.assert_allclose(
                mine.array_records[name]["0"].numpy(),
                theirs.array_records[name]["0"].numpy(),
                rtol=1e-6,
            )
    alphas = [
        float(g.state.array_records["scalar:apfl-alpha"]["0"].numpy())
        for g in own_grid.contexts.values()
    ]
    if settings.get("adaptive_alpha"):
        assert any(abs(a - 0.4) > 1e-3 for a in alphas)  # alpha was learned


def test_reply_takes_numpy_and_tensor_metrics():
    model = torch.nn.Linear(3, 1, bias=False)
    msg = train_message(ArrayRecord([np.ones((1, 3), np.float32)]), {"lr": 0.1})
    rule = ClientRule.from_message(msg, context(), model)
    np.testing.assert_array_equal(model.weight.detach().numpy(), np.ones((1, 3)))
    reply = rule.reply(
        num_examples=np.int64(7),
        metrics={"train_loss": torch.tensor(0.5), "acc": np.float32(0.25), "ok": True},
    )
    metrics = reply.content["metrics"]
    assert (metrics["train_loss"], metrics["acc"], metrics["ok"]) == (0.5, 0.25, 1)
    assert metrics["num-examples"] == 7 and metrics["local-steps"] == 0
    assert metrics["client-key"] == 0 and "state-round" not in metrics  # no state


def test_rule_refuses_a_model_moved_after_its_first_step():
    model = torch.nn.Linear(3, 1, bias=False)
    msg = train_message(
        ArrayRecord([np.zeros((1, 3), np.float32)]), {"proximal-mu": 0.1}
    )
    rule = FedProxRule.from_message(msg, context(), model)
    model(torch.ones(2, 3)).sum().backward()
    rule.add_gradient()
    model.to("meta")
    with pytest.raises(RuntimeError, match=r"move the model before its first step"):
        rule.add_gradient()


def test_a_refused_setting_fails_the_run_with_its_reason(problem):
    """SCAFFOLD's rule refuses momentum in every node: the run says so, once, and fails."""
    app = own_client_app(
        problem,
        ScaffoldRule,
        lambda m: torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9),
    )
    with pytest.raises(NoRoundAggregatedError) as failure:
        run(problem, Scaffold(fraction_evaluate=0.0), app, rounds=2)
    message = str(failure.value)
    assert "8 x 'ValueError: ScaffoldRule needs momentum=0" in message
    np.testing.assert_array_equal(
        failure.value.result.arrays.to_numpy_ndarrays()[0],
        problem.initial().to_numpy_ndarrays()[0],
    )

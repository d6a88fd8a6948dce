"""Drop-in use inside a user's own server loop and ClientApp.

A pack strategy run by a loop that is not the pack's ``start()`` (Flower's
``Strategy.start`` here, the loop Flower's examples copy into their own
``start()``) still fails loudly when rounds stop aggregating; its messages name
the pack's real classes and the user's action; its bookkeeping stays out of
the user's metrics unless asked; a client that restores part of the model after
``from_message`` keeps SCAFFOLD's and FedDyn's updates right.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import Strategy

from flwr_prox_strategies import (
    AggregationStalledError,
    FedDyn,
    FedDynRule,
    FedProx,
    FedProxRule,
    NoRoundAggregatedError,
    Scaffold,
    ScaffoldRule,
)
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid

from .lsq import LeastSquares, half_sse
from .test_rules import LR, context, dict_loader, own_client_app, train_message

ROUNDS = 5


@pytest.fixture(scope="module")
def problem() -> LeastSquares:
    return LeastSquares()


def own_loop(strategy: Strategy, app: ClientApp, problem: LeastSquares, rounds=ROUNDS):
    """Run ``strategy`` with Flower's own loop, as a user's ``start()`` would."""
    grid = InProcessGrid(app, num_nodes=len(problem.a))
    result = Strategy.start(
        strategy, grid=grid, initial_arrays=problem.initial(), num_rounds=rounds
    )
    return result, grid


def own_reply_app(problem: LeastSquares, rule_cls, *, flaky=frozenset()) -> ClientApp:
    """A ClientApp that trains with the rule but returns a reply of its own."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        server_round = int(msg.content["config"]["server-round"])
        if server_round in flaky:
            raise RuntimeError(f"flaky round {server_round}")
        k = int(context.node_config["partition-id"])
        model = torch.nn.Linear(problem.dim, 1, bias=False)
        rule = rule_cls.from_message(msg, context, model)
        optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=LR))
        loader = dict_loader(problem, k)
        for batch in loader:
            optimizer.zero_grad()
            half_sse(model(batch["img"]), batch["label"]).backward()
            optimizer.step()
        arrays = ArrayRecord([p.detach().numpy() for p in model.parameters()])
        metrics = MetricRecord({"train_loss": 0.5, "num-examples": len(loader.dataset)})
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    return app


def momentum_sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def test_a_run_that_never_aggregates_stops_inside_a_users_own_loop(problem):
    """SCAFFOLD with momentum kept: the 3rd round raises, naming the reason."""
    strategy = Scaffold(num_clients=4, fraction_evaluate=0.0)
    app = own_client_app(problem, ScaffoldRule, momentum_sgd)
    with pytest.raises(NoRoundAggregatedError) as info:
        own_loop(strategy, app, problem)
    err = info.value
    assert isinstance(err, AggregationStalledError)
    message = str(err)
    assert "no round aggregated in 3 rounds in a row (rounds 1-3" in message
    assert "12 x 'ValueError: ScaffoldRule needs momentum=0" in message
    # It stopped at round 3 (4 nodes a round), holding the initial model.
    assert err.reasons.kept == {"no valid reply": 3}
    np.testing.assert_array_equal(
        err.result.arrays.to_numpy_ndarrays()[0],
        problem.initial().to_numpy_ndarrays()[0],
    )


def test_the_limit_is_an_option_and_check_run_fails_the_run_at_the_end(problem):
    app = own_client_app(problem, ScaffoldRule, momentum_sgd)
    strategy = Scaffold(
        num_clients=4, fraction_evaluate=0.0, max_rounds_without_aggregation=None
    )
    strategy.reset_run()
    result, grid = own_loop(strategy, app, problem)  # all 5 rounds, silently
    assert grid.messages_sent == 4 * ROUNDS and len(result.arrays) == 0
    with pytest.raises(NoRoundAggregatedError, match=r"5 round\(s\), 0 aggregated"):
        strategy.check_run(result)
    assert result.arrays.to_numpy_ndarrays()[0].shape == (1, problem.dim)
    with pytest.raises(ValueError, match="max_rounds_without_aggregation"):
        Scaffold(max_rounds_without_aggregation=0)


def test_an_aggregated_round_resets_the_count_and_a_later_stall_names_it(problem):
    """Rounds 2-3 fail (count 2, reset by round 4); rounds 5-7 fail: it stops."""
    app = own_reply_app(problem, FedProxRule, flaky={2, 3, 5, 6, 7})
    strategy = FedProx(mu=0.1, fraction_evaluate=0.0)
    with pytest.raises(AggregationStalledError) as info:
        own_loop(strategy, app, problem, rounds=8)
    err = info.value
    assert not isinstance(err, NoRoundAggregatedError)
    assert "(rounds 5-7" in str(err) and "last aggregated model" in str(err)
    assert err.reasons.failed == {
        "RuntimeError: flaky round 5": 4,
        **{f"RuntimeError: flaky round {r}": 4 for r in (6, 7)},
    }
    # The model the run holds is round 4's, not the initial one.
    assert not np.array_equal(
        err.result.arrays.to_numpy_ndarrays()[0],
        problem.initial().to_numpy_ndarrays()[0],
    )


def test_the_pack_start_raises_at_its_end_with_flowers_whole_result(problem):
    """A stall in the last round is left to start()'s end, which has the Result."""
    app = own_client_app(problem, ScaffoldRule, momentum_sgd)
    strategy = Scaffold(num_clients=4, fraction_evaluate=0.0)
    grid = InProcessGrid(app, num_nodes=4)
    with pytest.raises(NoRoundAggregatedError) as info:
        strategy.start(grid=grid, initial_arrays=problem.initial(), num_rounds=3)
    assert sorted(info.value.result.train_metrics_clientapp) == [1, 2, 3]


class CustomFedAvg(FedDyn):
    """A user's subclass, named as Flower's advanced-pytorch names its own."""


def test_a_users_own_reply_under_feddyn_is_told_to_return_rule_reply(problem):
    strategy = CustomFedAvg(alpha=0.1, num_clients=4, fraction_evaluate=0.0)
    with pytest.raises(NoRoundAggregatedError) as info:
        own_loop(strategy, own_reply_app(problem, FedDynRule), problem)
    message = str(info.value)
    assert "return rule.reply(...)" in message
    assert "FedDynRule.from_message(msg, context, model)" in message
    assert "the pack's FedDynClient" in message
    assert "CustomFedAvgRule" not in message and "CustomFedAvgClient" not in message


def test_the_wrong_rule_is_named_beside_the_right_one(problem):
    """FedDyn's server, FedProx's rule on the clients: both are named."""
    strategy = CustomFedAvg(alpha=0.1, num_clients=4, fraction_evaluate=0.0)
    app = own_client_app(
        problem, FedProxRule, lambda m: torch.optim.SGD(m.parameters(), lr=LR)
    )
    with pytest.raises(NoRoundAggregatedError) as info:
        own_loop(strategy, app, problem)
    message = str(info.value)
    assert "FedProxRule needs 'proximal-mu'" in message
    assert "The server runs FedDyn" in message and "build FedDynRule" in message


def test_a_protocol_mismatch_is_counted_each_round_and_repeated_at_the_end(
    problem, caplog: pytest.LogCaptureFixture
):
    """FedProx's server, the client's own reply: averaged in, but never quietly."""
    strategy = type("CustomFedAvg", (FedProx,), {})(mu=0.1, fraction_evaluate=0.0)
    grid = InProcessGrid(own_reply_app(problem, FedProxRule), num_nodes=4)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        result = strategy.start(
            grid=grid, initial_arrays=problem.initial(), num_rounds=3
        )
    counts = [
        m["replies-rule-missing"] for m in result.train_metrics_clientapp.values()
    ]
    assert counts == [4, 4, 4]
    warnings = [
        r.getMessage() for r in caplog.records if "FedProxRule" in r.getMessage()
    ]
    assert len(warnings) == 2, warnings  # round 1, and the run's end
    assert "the pack's FedProxClient" in warnings[0]
    assert "return rule.reply(...)" in warnings[0]
    assert "CustomFedAvgRule" not in warnings[0]
    assert warnings[1].startswith("CustomFedAvg: 12 replies from 4 node(s) were")


def test_the_users_metrics_stay_theirs(problem):
    """Without the pack's bookkeeping a round's metrics are the clients' own."""
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=LR)  # noqa: E731
    app = own_client_app(problem, FedProxRule, sgd)  # rule.reply(..., metrics=...)
    quiet = FedProx(mu=0.1, fraction_evaluate=0.0, pack_metrics=False)
    result, _ = own_loop(quiet, app, problem, rounds=1)
    assert set(result.train_metrics_clientapp[1]) == {"train-loss", "num-examples"}
    loud = FedProx(mu=0.1, fraction_evaluate=0.0)
    result, _ = own_loop(loud, app, problem, rounds=1)
    assert {
        "replies-valid",
        "bytes-sent",
        "replies-rule-missing",
        "proximal-mu-applied",
        "local-steps",
    } <= set(result.train_metrics_clientapp[1])


def test_evaluation_metrics_carry_lists_only_when_asked(problem):
    def evaluate_app() -> ClientApp:
        app = own_reply_app(problem, FedProxRule)

        @app.evaluate()
        def evaluate(msg: Message, context: Context) -> Message:
            k = int(context.node_config["partition-id"])
            metrics = {"accuracy": 0.5 + 0.1 * k, "num-examples": 10, "client-key": k}
            return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

        return app

    for per_client in (False, True):
        strategy = FedProx(mu=0.1, min_available_nodes=4, per_client_metrics=per_client)
        result, _ = own_loop(strategy, evaluate_app(), problem, rounds=1)
        metrics = result.evaluate_metrics_clientapp[1]
        lists = {k for k, v in metrics.items() if isinstance(v, list)}
        if not per_client:
            assert not lists and metrics["accuracy-worst"] == pytest.approx(0.5)
        else:
            assert lists == {"eval-client-keys", "accuracy-per-client"}
            assert metrics["eval-client-keys"] == [0, 1, 2, 3]  # integers


def test_the_summary_states_the_weighting_once(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.INFO, logger="flwr"):
        Scaffold(num_clients=4).summary()
    lines = [r.getMessage() for r in caplog.records]
    weighting = [line for line in lines if "eighted by" in line or "eighting" in line]
    assert len(weighting) == 1 and "uniform" in weighting[0], weighting


def two_layer_model(dim: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(dim, 3, bias=False), torch.nn.Linear(3, 1, bias=False)
    )


def test_scaffold_control_variate_counts_only_gradient_after_a_restored_head(problem):
    """Option II's c_i+ is the path's mean gradient, not the head's jump back."""
    lr, steps = 0.05, 3
    model = two_layer_model(problem.dim)
    received = [p.detach().numpy().copy() for p in model.parameters()]
    c = [np.full_like(r, 0.2) for r in received]
    msg = train_message(
        ArrayRecord(received),
        {"server-round": 1, "accepted-round": -1},
        {"control": ArrayRecord(c)},
    )
    rule = ScaffoldRule.from_message(msg, context(1), model)
    with torch.no_grad():  # the user restores a personal head from context.state
        model[1].weight.copy_(torch.full_like(model[1].weight, 0.7))
    optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=lr))
    xs, ys = torch.from_numpy(problem.a[1]), torch.from_numpy(problem.b[1])
    grads = [torch.zeros_like(p) for p in model.parameters()]
    for _ in range(steps):
        optimizer.zero_grad()
        half_sse(model(xs), ys).backward()
        for g, p in zip(grads, model.parameters(), strict=True):
            g += p.grad / steps  # the data gradient, before the correction
        optimizer.step()
    reply = rule.reply(num_examples=len(xs))
    delta = reply.content["control-delta"].to_numpy_ndarrays()
    for got, want in zip(delta, grads, strict=True):  # c_i = 0: delta = c_i+
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-6)


def test_feddyn_drift_is_measured_from_the_global_model_after_a_restored_head(problem):
    """FedDyn's lambda update needs theta_k - theta^t whatever the start point."""
    model = two_layer_model(problem.dim)
    received = [p.detach().numpy().copy() for p in model.parameters()]
    ctx = context(1)
    msg = train_message(
        ArrayRecord(received),
        {"server-round": 1, "accepted-round": -1, "feddyn-alpha": 0.1},
    )
    rule = FedDynRule.from_message(msg, ctx, model)
    with torch.no_grad():
        model[1].weight.copy_(torch.full_like(model[1].weight, 0.7))
    optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=0.05))
    xs, ys = torch.from_numpy(problem.a[1]), torch.from_numpy(problem.b[1])
    optimizer.zero_grad()
    half_sse(model(xs), ys).backward()
    # The regulariser pulls towards the received model, not the restored head.
    optimizer.step()
    rule.reply(num_examples=len(xs))
    pending = [
        v.numpy() for v in ctx.state.array_records["pending:feddyn-drift"].values()
    ]
    final = [p.detach().numpy() for p in model.parameters()]
    for drift, theta, theta_t in zip(pending, final, received, strict=True):
        np.testing.assert_allclose(drift, theta - theta_t, rtol=1e-6, atol=1e-7)

"""Failure semantics: a run that aggregates nothing fails loudly, with reasons.

Also the protocol-mismatch check (the server side of it): a strategy whose
clients must apply a rule warns once per run about replies that do not say
they did, and rejects them with ``strict=True``.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import (
    ArrayRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from torch.utils.data import DataLoader, TensorDataset

from flwr_prox_strategies import (
    FedAvg,
    FedDyn,
    FedProx,
    FedProxClient,
    PFedAvg,
    to_client_app,
)
from flwr_prox_strategies.algorithms.fedprox import PROXIMAL_MU_APPLIED_KEY
from flwr_prox_strategies.core.contract.validation import client_error_text
from flwr_prox_strategies.core.privacy.central import ServerSideFixedClipping
from flwr_prox_strategies.core.server.outcome import (
    NoRoundAggregatedError,
    short_reason,
)
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid

from .helpers import model_arrays, record

# What Flower's engine puts in an error reply when the ClientApp raises.
FLOWER_REASON = "<class 'AttributeError'>:<''str' object has no attribute 'to''>"
SHORT = "AttributeError: 'str' object has no attribute 'to'"


def as_numpy(arrays: ArrayRecord) -> dict[str, np.ndarray]:
    return {key: value.numpy() for key, value in arrays.items()}


def error_app(message: Message, context: Context) -> Message:
    return Message(Error(code=2, reason=FLOWER_REASON), reply_to=message)


def plain_reply(message: Message, metrics: dict | None = None) -> Message:
    """What Flower's quickstart @app.train returns: the model plus 1 added."""
    arrays = message.content["arrays"]
    trained = {key: value.numpy() + 1.0 for key, value in arrays.items()}
    values = {"train_loss": 0.5, "num-examples": 10, **(metrics or {})}
    return Message(
        RecordDict({"arrays": record(trained), "metrics": MetricRecord(values)}),
        reply_to=message,
    )


def flower_plain_app(message: Message, context: Context) -> Message:
    if message.metadata.message_type.startswith("evaluate"):
        metrics = MetricRecord({"eval_loss": 0.1, "num-examples": 10})
        return Message(RecordDict({"metrics": metrics}), reply_to=message)
    return plain_reply(message)


def train_warnings(caplog: pytest.LogCaptureFixture, server_round: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING
        and r.getMessage().startswith(f"aggregate_train: round {server_round}:")
    ]


def run_on(strategy, app, nodes: int, rounds: int, initial=None):
    """``strategy.start`` over ``nodes`` in-process nodes of ``app``."""
    return strategy.start(
        grid=InProcessGrid(app, num_nodes=nodes),
        initial_arrays=record(model_arrays()) if initial is None else initial,
        num_rounds=rounds,
    )


def test_short_reason_reads_flowers_error_format() -> None:
    assert short_reason(FLOWER_REASON) == SHORT
    wrapped = (
        "<class 'flwr.clientapp.client_app.ClientAppException'>:<'\n"
        "Exception ClientAppException occurred. Message: boom'>"
    )
    assert short_reason(wrapped) == "the ClientApp raised: boom"
    # Ray wraps it again, with the actor's traceback: the user's text survives.
    ray = (
        "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'ray::"
        'ClientAppActor.run() (pid=1, ip=127.0.0.1)\n  File "ray_actor.py", line '
        "65, in run\n    raise ClientAppException(str(ex)) from ex\nflwr.clientapp."
        "client_app.ClientAppException: \nException ClientAppException occurred. "
        "Message: " + "x " * 400 + "boom'>"
    )
    assert short_reason(ray).startswith("the ClientApp raised: x x")
    assert client_error_text(ray) == "the ClientApp raised: " + "x " * 400 + "boom"
    # A long text is cut at a word, saying how much was left out; never mid-word.
    long = " ".join(f"word{i}" for i in range(200))
    cut = short_reason(long)
    assert cut.endswith(" more characters]") and len(cut) < len(long)
    kept, left = cut.rsplit(" [", 1)
    assert long.startswith(kept) and long[len(kept)] == " "
    assert int(left.split()[0]) == len(long) - len(kept)
    # A traceback keeps its last line, the exception; a short text is whole.
    trace = "Traceback (most recent call last):\n  File x\n  line\nValueError: bad"
    assert short_reason(trace) == "ValueError: bad"
    assert short_reason("x" * 500) == "x" * 500


def test_all_error_run_raises_at_the_end_with_counted_reasons(
    caplog: pytest.LogCaptureFixture,
) -> None:
    initial = model_arrays()
    strategy = FedAvg(min_available_nodes=4, fraction_evaluate=0.0)
    grid = InProcessGrid(error_app, num_nodes=4)
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(NoRoundAggregatedError) as info,
    ):
        strategy.start(grid=grid, initial_arrays=record(initial), num_rounds=3)
    err = info.value
    assert isinstance(err, RuntimeError)
    message = str(err)
    assert message.startswith("FedAvg: no round aggregated: 3 round(s), 0 aggregated")
    assert f"12 replies failed: 12 x '{SHORT}'" in message
    assert "(3 x no valid reply)" in message
    # Flower ran every round; the result is kept on the exception.
    assert grid.messages_sent == 12
    assert sorted(err.result.train_metrics_clientapp) == [1, 2, 3]
    got = as_numpy(err.result.arrays)
    assert got.keys() == initial.keys()
    for key in initial:
        np.testing.assert_array_equal(got[key], initial[key])
    assert err.reasons.failed == {SHORT: 12}
    # One warning per round, with that round's reasons counted.
    for server_round in (1, 2, 3):
        warnings = train_warnings(caplog, server_round)
        assert len(warnings) == 1, warnings
        assert f"4 replies failed: 4 x '{SHORT}'" in warnings[0]
        assert "keeping the previous model" in warnings[0]


def test_rejections_are_counted_by_kind_in_the_error() -> None:
    def wrong_shape_app(message: Message, context: Context) -> Message:
        reply = plain_reply(message)
        reply.content["arrays"] = record({"w": np.zeros((3, 4), np.float32)})
        return reply

    strategy = FedAvg(min_available_nodes=3, fraction_evaluate=0.0)
    with pytest.raises(NoRoundAggregatedError) as info:
        run_on(strategy, wrong_shape_app, 3, 2)
    assert "6 replies rejected: 6 x 'array-keys: " in str(info.value)
    assert sum(info.value.reasons.rejected.values()) == 6


def test_a_run_that_aggregates_once_keeps_that_model_and_does_not_raise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    initial = model_arrays()

    def first_round_only(message: Message, context: Context) -> Message:
        server_round = message.content["config"]["server-round"]
        if message.metadata.message_type.startswith("evaluate") or server_round > 1:
            return error_app(message, context)
        return plain_reply(message)

    strategy = FedAvg(min_available_nodes=3)
    with caplog.at_level(logging.WARNING):
        result = run_on(strategy, first_round_only, 3, 3, record(initial))
    got = as_numpy(result.arrays)
    for key in initial:  # round 1's model: every node added 1
        np.testing.assert_allclose(got[key], initial[key] + 1.0, rtol=0, atol=1e-6)
    assert result.train_metrics_clientapp[1]["replies-valid"] == 3
    assert result.train_metrics_clientapp[3]["replies-failed"] == 3
    assert len(train_warnings(caplog, 2)) == 1
    assert strategy.run_tally.aggregated == 1


def test_zero_rounds_return_the_initial_model() -> None:
    initial = model_arrays()
    result = run_on(FedAvg(min_available_nodes=1), error_app, 1, 0, record(initial))
    assert as_numpy(result.arrays).keys() == initial.keys()


def test_evaluation_only_run_does_not_raise() -> None:
    result = run_on(
        FedAvg(fraction_train=0.0, min_available_nodes=2), flower_plain_app, 2, 2
    )
    assert len(result.arrays) == 2
    assert result.evaluate_metrics_clientapp[2]["replies-valid"] == 2


def test_pfedavg_fails_loudly_with_every_servers_reasons() -> None:
    initial = model_arrays()
    strategy = PFedAvg(
        servers=2,
        topology="ring",
        assignment={1001 + i: i % 2 for i in range(4)},
        inner=lambda: FedAvg(min_available_nodes=1, min_train_nodes=1),
    )
    with pytest.raises(NoRoundAggregatedError) as info:
        run_on(strategy, error_app, 4, 2, record(initial))
    message = str(info.value)
    assert message.startswith("PFedAvg: no round aggregated: 2 round(s), 0 aggregated")
    assert f"8 replies failed: 8 x '{SHORT}'" in message
    got = as_numpy(info.value.result.arrays)
    for key in initial:
        np.testing.assert_array_equal(got[key], initial[key])


def test_central_dp_wrapper_fails_loudly_too() -> None:
    strategy = ServerSideFixedClipping(
        FedAvg(min_available_nodes=3, fraction_evaluate=0.0),
        noise_multiplier=0.1,
        clipping_norm=1.0,
        num_sampled_clients=3,
    )
    with pytest.raises(NoRoundAggregatedError) as info:
        run_on(strategy, error_app, 3, 2)
    assert f"6 replies failed: 6 x '{SHORT}'" in str(info.value)
    assert str(info.value).startswith("ServerSideFixedClipping(FedAvg)")


# ----------------------------------------------------------- protocol mismatch
def fedprox_client_fn(context: Context) -> FedProxClient:
    pid = int(context.node_config["partition-id"])
    gen = torch.Generator().manual_seed(pid)
    x = torch.randn(16, 4, generator=gen)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    return FedProxClient(
        torch.nn.Linear(4, 1),
        loader,
        local_epochs=1,
        learning_rate=0.05,
        loss_fn=torch.nn.functional.mse_loss,
    )


def linear_model() -> ArrayRecord:
    torch.manual_seed(0)
    return ArrayRecord(torch.nn.Linear(4, 1).state_dict())


def mismatch_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if f"do not report '{PROXIMAL_MU_APPLIED_KEY}'" in r.getMessage()
    ]


def test_flowers_plain_client_under_fedprox_is_named_once_per_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    strategy = FedProx(mu=0.1, min_available_nodes=3)
    grid = InProcessGrid(flower_plain_app, num_nodes=3)
    with caplog.at_level(logging.WARNING):
        result = strategy.start(grid=grid, initial_arrays=linear_model(), num_rounds=3)
    assert result.train_metrics_clientapp[3]["replies-valid"] == 3  # still averaged
    warnings = mismatch_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "nodes [1001, 1002, 1003]" in warnings[0]
    assert "FedProx's proximal term" in warnings[0]
    assert "FedProxClient" in warnings[0] and "FedProxRule" in warnings[0]
    assert "strict=True" in warnings[0]
    # A second run of the same strategy warns again (once per run).
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        strategy.start(grid=grid, initial_arrays=linear_model(), num_rounds=2)
    assert len(mismatch_warnings(caplog)) == 1


def test_the_packs_fedprox_client_is_not_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    strategy = FedProx(mu=0.1, min_available_nodes=3, fraction_evaluate=0.0)
    grid = InProcessGrid(to_client_app(fedprox_client_fn), num_nodes=3)
    with caplog.at_level(logging.WARNING):
        result = strategy.start(grid=grid, initial_arrays=linear_model(), num_rounds=2)
    assert result.train_metrics_clientapp[2]["replies-valid"] == 3
    assert mismatch_warnings(caplog) == []


def test_a_reply_carrying_the_metric_is_not_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def honest(message: Message, context: Context) -> Message:
        if message.metadata.message_type.startswith("evaluate"):
            return flower_plain_app(message, context)
        return plain_reply(message, {PROXIMAL_MU_APPLIED_KEY: 1})

    with caplog.at_level(logging.WARNING):
        run_on(FedProx(mu=0.1, min_available_nodes=2), honest, 2, 2, linear_model())
    assert mismatch_warnings(caplog) == []


def test_strict_rejects_replies_without_the_metric() -> None:
    strategy = FedProx(mu=0.1, min_available_nodes=3, strict=True)
    with pytest.raises(NoRoundAggregatedError) as info:
        run_on(strategy, flower_plain_app, 3, 2, linear_model())
    assert "6 replies rejected: 6 x 'rule-not-applied: " in str(info.value)
    assert strategy.rejections["aggregate_train:rule-not-applied"] == 6


def test_strict_names_the_rule_before_the_client_key() -> None:
    # FedDyn's replies also need client-key; a plain client lacks both, and the
    # rejection says what matters: the client is not running FedDyn.
    strategy = FedDyn(alpha=0.1, strict=True, min_available_nodes=2)
    with pytest.raises(NoRoundAggregatedError) as info:
        run_on(strategy, flower_plain_app, 2, 1, linear_model())
    assert "rule-not-applied: no 'feddyn-applied' metric" in str(info.value)


# ------------------------------------------------------------- the pack's app
def test_the_packs_app_records_the_failure_then_raises(tmp_path) -> None:
    import json

    from apps.client_app import app as client_app
    from flwr_prox_strategies.experiment.server import run_experiment

    run_config = {
        # Every client refuses its settings: no reply can be aggregated.
        "overrides": "num_clients=3 num_rounds=2 model=logreg train.local_epochs=1 "
        "train.learning_rate=-1",
        "output-dir": str(tmp_path),
    }
    grid = InProcessGrid(client_app, num_nodes=3, run_config=run_config)
    with pytest.raises(NoRoundAggregatedError) as info:
        run_experiment(grid, run_config)
    reason = "ValueError: learning_rate must be a finite number > 0, got -1.0"
    assert f"6 replies failed: 6 x '{reason}'" in str(info.value)
    assert str(tmp_path / "results.json") in str(info.value)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["summary"]["complete"] is False
    assert results["rounds-without-valid-reply"] == [1, 2]
    assert f"6 x '{reason}'" in results["failure"]
    assert (tmp_path / "metrics.png").stat().st_size > 1000


def _train_only_app() -> Any:
    """A ClientApp with a train function only, as the algorithm pages show."""
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        (w,) = msg.content["arrays"].to_numpy_ndarrays()
        metrics = MetricRecord({"num-examples": 10})
        content = RecordDict({"arrays": ArrayRecord([w + 1.0]), "metrics": metrics})
        return Message(content, reply_to=msg)

    return app


def test_a_client_app_without_evaluate_is_said_once_and_evaluation_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A ClientApp with only @app.train under a strategy that evaluates: one
    error naming both fixes, then no evaluate message for the rest of the run."""
    strategy = FedAvg(min_available_nodes=3, fraction_evaluate=1.0)
    grid = InProcessGrid(_train_only_app(), num_nodes=3)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        result = strategy.start(
            grid=grid, initial_arrays=ArrayRecord([np.zeros(2)]), num_rounds=3
        )
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    said = [m for m in errors if "no evaluate function" in m]
    assert len(said) == 1
    assert "fraction_evaluate=0.0" in said[0] and "@app.evaluate()" in said[0]
    assert grid.messages_sent == 3 * 3 + 3  # train every round, evaluate once
    np.testing.assert_array_equal(result.arrays.to_numpy_ndarrays()[0], [3.0, 3.0])


def test_evaluation_goes_on_when_one_node_can_evaluate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only a round in which every node lacks the function turns evaluation off."""
    app = _train_only_app()

    def mixed(message: Message, context: Context) -> Message:
        if message.metadata.message_type == "evaluate" and context.node_id == 1001:
            metrics = MetricRecord({"eval_loss": 1.0, "num-examples": 10})
            return Message(RecordDict({"metrics": metrics}), reply_to=message)
        return app(message, context)

    grid = InProcessGrid(mixed, num_nodes=3)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        FedAvg(min_available_nodes=3, fraction_evaluate=1.0).start(
            grid=grid, initial_arrays=ArrayRecord([np.zeros(2)]), num_rounds=3
        )
    assert not [r for r in caplog.records if "no evaluate function" in r.getMessage()]
    assert grid.messages_sent == 3 * 3 + 3 * 3

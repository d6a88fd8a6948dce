"""The conformance kit's client half: the mistakes a plugin's client makes fail it.

Each mistake is one a plugin author made with the public API (a record not
sent, state committed at once, a record without the model's buffers, a
record expected that no client sends), planted in SCAFFOLD's rule or
strategy; the check it fails must name the fix.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import MetricRecord

from flwr_prox_strategies import testing
from flwr_prox_strategies.algorithms import Algorithm
from flwr_prox_strategies.algorithms.clients.scaffold import (
    ScaffoldClient,
    ScaffoldRule,
)
from flwr_prox_strategies.algorithms.scaffold import CONTROL_DELTA_RECORD, Scaffold
from flwr_prox_strategies.core.client.layout import ReplyLayout
from flwr_prox_strategies.core.contract.validation import ValidReply
from flwr_prox_strategies.core.server.commit import ClientBook
from flwr_prox_strategies.core.transport.keys import (
    CLIENT_KEY_METRIC,
    STATE_OUTSIDE_COMMIT_METRIC,
    STATE_ROUND_METRIC,
)
from flwr_prox_strategies.extend import RecordSpec


class CommitsAtOnce(ScaffoldRule):
    """Saves its control variate with ``state.set``: committed before the server says."""

    def finish(self, steps: int, lr: float) -> Any:
        extra, metrics = super().finish(steps, lr)
        pending = self.state.get("pending:" + self.state_names[0])
        if pending is not None:
            self.state.set(self.state_names[0], pending)
            del self.state.records["pending:" + self.state_names[0]]
        return extra, metrics


class SendsNoDelta(ScaffoldRule):
    """Forgets the record its strategy expects."""

    def finish(self, steps: int, lr: float) -> Any:
        _, metrics = super().finish(steps, lr)
        return {}, metrics


class DropsBuffers(ScaffoldRule):
    """Lays its record out per parameter: BatchNorm's statistics are lost."""

    def finish(self, steps: int, lr: float) -> Any:
        extra, metrics = super().finish(steps, lr)
        tensors = self.from_reply_layout(extra[CONTROL_DELTA_RECORD])
        return {CONTROL_DELTA_RECORD: [t.numpy() for t in tensors]}, metrics


class ExpectsMore(Scaffold):
    """Expects a record no client sends."""

    def expected_train_arrays(self, server_round: int) -> dict[str, RecordSpec]:
        expected = super().expected_train_arrays(server_round)
        return {**expected, "scaffold-extra": expected[CONTROL_DELTA_RECORD]}


def with_rule(rule: type[ScaffoldRule], strategy: type = Scaffold) -> Algorithm:
    """SCAFFOLD with ``rule`` in its client (and ``strategy`` on the server)."""
    client = type(f"{rule.__name__}Client", (ScaffoldClient,), {"rule_class": rule})
    return Algorithm(
        strategy, client, rule, cases={"default": lambda n: strategy(num_clients=n)}
    )


def client_failures(algorithm: Algorithm) -> dict[str, str]:
    failures = {}
    for name, check in testing.conformance_checks(algorithm).items():
        if "/client/" not in name:
            continue
        try:
            check()
        except AssertionError as err:
            failures[name.split("/", 1)[1]] = str(err)
    return failures


def test_a_correct_rule_passes_the_same_checks() -> None:
    assert client_failures(with_rule(ScaffoldRule)) == {}


def test_state_committed_at_once_fails_naming_set_pending() -> None:
    failures = client_failures(with_rule(CommitsAtOnce))
    assert set(failures) == {
        "client/rejected-reply-keeps-state",
        "client/state-recognised",
    }
    for message in failures.values():
        assert "set_pending(name, arrays, self.server_round)" in message
    assert "scaffold-c" in failures["client/rejected-reply-keeps-state"]


def test_a_record_not_sent_names_the_record_and_both_files() -> None:
    failures = client_failures(with_rule(SendsNoDelta))
    message = failures["client/replies-pass-screening"]
    assert f"does not send the ArrayRecord '{CONTROL_DELTA_RECORD}'" in message
    assert "SendsNoDelta.finish" in message and "test_client_conformance.py" in message
    assert "Scaffold.expected_train_arrays" in message and "scaffold.py" in message


def test_a_record_without_buffers_names_to_reply_layout() -> None:
    failures = client_failures(with_rule(DropsBuffers))
    message = failures["client/replies-pass-screening"]
    assert "holds 6 arrays, the model's state_dict 9 entries" in message
    assert "rule.to_reply_layout(tensors)" in message


def test_a_record_expected_but_never_sent_names_the_strategy() -> None:
    failures = client_failures(with_rule(ScaffoldRule, ExpectsMore))
    message = failures["client/replies-pass-screening"]
    assert "'scaffold-extra' that ExpectsMore.expected_train_arrays" in message


def test_reply_layout_lays_out_buffers_and_reads_back() -> None:
    model = testing.buffered_model()
    rule = ScaffoldRule.__new__(ScaffoldRule)  # only the layout helpers are used
    rule.model, rule.layout = model, ReplyLayout(model)
    rule.params = [p for p in model.parameters() if p.requires_grad]
    rule.anchor = [p.detach().clone() for p in rule.params]
    tensors = [torch.full_like(p, i + 1.0) for i, p in enumerate(rule.params)]
    zeros = rule.to_reply_layout(tensors)
    kept = rule.to_reply_layout(tensors, buffers="model")
    state = model.state_dict()
    assert len(zeros) == len(state) == 9
    for (key, value), z, k in zip(state.items(), zeros, kept, strict=True):
        assert z.shape == tuple(value.shape)
        if "running" in key or "num_batches" in key:
            assert not z.any()
            np.testing.assert_array_equal(k, value.numpy())
    assert zeros[6].dtype == np.int64  # num_batches_tracked keeps its dtype
    back = rule.from_reply_layout(zeros)
    for t, b in zip(tensors, back, strict=True):
        torch.testing.assert_close(t, b)
    with pytest.raises(ValueError, match="one tensor per trainable parameter"):
        rule.to_reply_layout(tensors[:-1])
    with pytest.raises(ValueError, match="buffers must be"):
        rule.to_reply_layout(tensors, buffers="drop")


def _reply(key: int, state_round: int, outside: int) -> Any:
    metrics = MetricRecord(
        {
            CLIENT_KEY_METRIC: key,
            STATE_ROUND_METRIC: state_round,
            STATE_OUTSIDE_COMMIT_METRIC: outside,
        }
    )
    return ValidReply(node_id=1000 + key, arrays={}, metrics=metrics, num_examples=1.0)


def test_state_saved_outside_the_commit_is_one_error_and_k_does_not_grow(
    caplog: pytest.LogCaptureFixture,
) -> None:
    book = ClientBook()
    book.commit(1, [_reply(k, -1, 0) for k in range(4)])
    counted: list[Any] = []
    with caplog.at_level(logging.WARNING, logger="flwr"):
        for rnd in (2, 3, 4):
            replies = [_reply(k, -1, 1) for k in range(4)]
            kept, rejected = book.reconcile(
                rnd,
                replies,
                keeps_client_sums=True,
                accept_lost_state=True,
                count=lambda node, why: counted.append(why),
            )
            assert len(kept) == 4 and rejected == 0
            book.commit(rnd, kept)
    assert book.retired_states == 0
    assert book.clients_needed(kept) == 4
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "set_pending" in errors[0].getMessage()
    assert not [r for r in caplog.records if "holds no state" in r.getMessage()]
    kept, rejected = book.reconcile(
        5,
        [_reply(0, -1, 1)],
        keeps_client_sums=True,
        accept_lost_state=True,
        count=lambda node, why: counted.append(why),
        strict=True,
    )
    assert kept == [] and rejected == 1 and counted[-1].kind == "state-outside-commit"


def test_a_lost_state_still_retires_and_grows_k() -> None:
    """The real loss (a restarted node) keeps its meaning: retired, K + 1."""
    book = ClientBook()
    book.commit(1, [_reply(k, -1, 0) for k in range(4)])
    kept, _ = book.reconcile(
        2,
        [_reply(0, -1, 0)],
        keeps_client_sums=True,
        accept_lost_state=True,
        count=lambda node, why: None,
    )
    assert len(kept) == 1 and book.retired_states == 1


def test_state_committed_at_once_is_one_error_in_a_run_and_k_stays() -> None:
    """End to end: every client commits at once for three rounds; K stays at 5."""
    run = testing.run_clients(
        with_rule(CommitsAtOnce), lambda n: Scaffold(num_clients=n)
    )
    assert run.k_before == run.k_after == 5
    errors = [line for line in run.log if "outside the two-phase commit" in line]
    assert len(errors) == 1 and "set_pending" in errors[0]
    assert not [line for line in run.log if "holds no state" in line]
    # Every valid reply says so, from round 1 on (node 1002's round-2 reply is
    # rejected, node 1005 is not sampled in round 2).
    assert [m["replies-state-outside-commit"] for m in run.metrics.values()] == [
        5,
        3,
        5,
    ]


@pytest.mark.parametrize("value", [float("nan"), 1.5, -2, float("inf")])
@pytest.mark.parametrize("name", [STATE_ROUND_METRIC, STATE_OUTSIDE_COMMIT_METRIC])
def test_a_hostile_state_metric_is_rejected_not_a_crash(name: str, value: Any) -> None:
    strategy, _, replies = testing.first_round(
        lambda n: Scaffold(num_clients=n, server_learning_rate=0.5)
    )
    replies[0].content["metrics"][name] = value
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and metrics["replies-rejected"] == 1
    assert strategy.rejections[f"aggregate_train:{name}"] == 1

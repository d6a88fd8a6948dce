"""The reply screen on its own: caps, the size limit, the rule warnings, collect.

:class:`ReplyScreen` is built with its caps and fed hand-built replies; no
strategy runs a round here (the one strategy below only checks that its caps
are the screen's).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Any

import pytest
from flwr.app import Message, MessageType, MetricRecord

from flwr_prox_strategies import FedAvg
from flwr_prox_strategies.core.client.rule import LOCAL_STEPS_METRIC, TERM_LOST_METRIC
from flwr_prox_strategies.core.contract.validation import (
    MetricSpec,
    ReplyRejected,
    ValidReply,
)
from flwr_prox_strategies.core.server.rule_report import RuleNames
from flwr_prox_strategies.core.server.screening import ReplyScreen
from flwr_prox_strategies.core.transport.flower import set_task_identity
from flwr_prox_strategies.core.transport.messages import node_messages
from flwr_prox_strategies.core.transport.records import spec_of

from .helpers import error_reply, model_arrays, record, reply

MODEL = model_arrays()
# The model's payload: w (4, 3) and b (3,), float32.
MODEL_BYTES = 15 * 4
EXPECTED = {"arrays": spec_of(record(MODEL))}
METRIC = "proximal-mu-applied"
PROX = RuleNames(
    owner="MyProx",
    server="FedProx",
    metric=METRIC,
    name="FedProx's proximal term",
    client="FedProxClient",
    rule="FedProxRule",
)
# A strategy whose clients need apply no rule (FedAvg's).
NO_RULE = dataclasses.replace(PROX, metric=None)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# ---------------------------------------------------------------------- caps
def claims(*values: float, keys: tuple[int | None, ...] = ()) -> list[ValidReply]:
    """Valid replies from nodes 1001, 1002, ... claiming ``values``."""
    replies = []
    for i, value in enumerate(values):
        key = keys[i] if i < len(keys) else None
        metrics = MetricRecord({} if key is None else {"client-key": key})
        replies.append(ValidReply(1001 + i, {}, metrics, value))
    return replies


def test_no_cap_when_both_are_none(caplog: pytest.LogCaptureFixture) -> None:
    screen = ReplyScreen(max_num_examples=None, max_weight_ratio=None)
    replies = claims(1e12, 1.0)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert screen.cap_claims(1, replies, "aggregate_train") == 0
    assert [r.num_examples for r in replies] == [1e12, 1.0]
    assert [r.capped_from for r in replies] == [None, None]
    assert warnings_of(caplog) == []


def test_max_num_examples_caps_each_claim_above_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    screen = ReplyScreen(max_num_examples=120, max_weight_ratio=None)
    replies = claims(1e12, 100, 130, 120, keys=(7,))
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert screen.cap_claims(3, replies, "aggregate_evaluate") == 2
    assert [r.num_examples for r in replies] == [120, 100, 120, 120]
    assert [r.capped_from for r in replies] == [1e12, None, 130, None]
    assert warnings_of(caplog) == [
        "aggregate_evaluate: round 3: node 1001 (client key 7) claims num-examples "
        "1e+12: capped to 120 (max_num_examples=120)",
        "aggregate_evaluate: round 3: node 1003 (client key not reported) claims "
        "num-examples 130: capped to 120 (max_num_examples=120)",
    ]


def test_the_median_of_an_even_count_is_the_lower_middle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Claims 10, 20, 30, 1000: the lower middle (20) gives a cap of 40; the
    # upper one (30) would give 60, the mean of both 50.
    screen = ReplyScreen(max_weight_ratio=2.0)
    replies = claims(1000, 30, 10, 20)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert screen.cap_claims(1, replies, "aggregate_train") == 1
    assert [r.num_examples for r in replies] == [40, 30, 10, 20]
    assert replies[0].capped_from == 1000
    assert warnings_of(caplog) == [
        "aggregate_train: round 1: node 1001 (client key not reported) claims "
        "num-examples 1000: capped to 40 (max_weight_ratio=2 x the round's "
        "median claim 20)"
    ]


def test_one_inflated_claim_cannot_raise_the_median_of_two() -> None:
    screen = ReplyScreen(max_weight_ratio=100.0)
    replies = claims(1e12, 100)
    assert screen.cap_claims(1, replies, "aggregate_train") == 1
    assert [r.num_examples for r in replies] == [10_000, 100]


@pytest.mark.parametrize(
    ("max_num_examples", "limit", "policy"),
    [
        (50.0, 50, "max_num_examples=50"),
        (500.0, 200, "max_weight_ratio=10 x the round's median claim 20"),
    ],
)
def test_the_smaller_cap_binds(
    caplog: pytest.LogCaptureFixture, max_num_examples: float, limit: int, policy: str
) -> None:
    screen = ReplyScreen(max_num_examples=max_num_examples, max_weight_ratio=10.0)
    replies = claims(20, 10, 1e6)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert screen.cap_claims(2, replies, "aggregate_train") == 1
    assert [r.num_examples for r in replies] == [20, 10, limit]
    assert warnings_of(caplog)[0].endswith(f"capped to {limit} ({policy})")


def test_a_ratio_cap_over_no_reply_caps_nothing() -> None:
    assert ReplyScreen(max_weight_ratio=1.0).cap_claims(1, [], "aggregate_train") == 0


# ---------------------------------------------------------------- reply size
def test_an_explicit_size_limit_is_absolute() -> None:
    assert ReplyScreen(max_reply_bytes=100).reply_size_limit(EXPECTED) == 100
    assert ReplyScreen(max_reply_bytes=100).reply_size_limit({}) == 100


def test_the_default_size_limit_is_twice_the_payload_and_a_mebibyte() -> None:
    assert ReplyScreen().reply_size_limit(EXPECTED) == 2 * MODEL_BYTES + 2**20
    assert ReplyScreen().reply_size_limit({}) == 2**20


def test_the_strategy_caps_are_its_screens() -> None:
    strategy = FedAvg(max_num_examples=5, max_reply_bytes=1000)
    assert strategy.screen.max_num_examples == strategy.max_num_examples == 5
    assert strategy.screen.max_weight_ratio == strategy.max_weight_ratio == 100.0
    assert strategy.screen.max_reply_bytes == strategy.max_reply_bytes == 1000
    assert strategy.reply_size_limit(EXPECTED) == 1000
    replies = claims(4, 6)
    assert strategy.cap_claims(1, replies, "aggregate_train") == 1
    assert [r.num_examples for r in replies] == [4, 5]
    # Set on the strategy, as before the caps moved to the screen: the screen's.
    strategy.max_num_examples = None
    strategy.max_reply_bytes = None
    assert strategy.screen.max_num_examples is None
    assert strategy.reply_size_limit(EXPECTED) > 1000
    replies = claims(4, 6)
    assert strategy.cap_claims(1, replies, "aggregate_train") == 0


# ------------------------------------------------------------ rule warnings
def rule_replies(*steps: tuple[int | None, int]) -> list[ValidReply]:
    """Replies from nodes 1001, ...: (steps that held the term or None, steps)."""
    replies = []
    for i, (applied, total) in enumerate(steps):
        values: dict[str, Any] = {LOCAL_STEPS_METRIC: total}
        if applied is not None:
            values[METRIC] = applied
        replies.append(ValidReply(1001 + i, {}, MetricRecord(values), 10.0))
    return replies


def rounds(
    screen: ReplyScreen, replies: list[ValidReply], *numbers: int
) -> list[tuple[int, int]]:
    """The screen's counts of aggregated rounds ``numbers`` of the same replies."""
    return [
        screen.rule_not_applied(n, replies, aggregated=True, rule=PROX) for n in numbers
    ]


def test_without_a_rule_metric_nothing_is_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    screen = ReplyScreen()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        counts = screen.rule_not_applied(
            1, rule_replies((None, 5), (2, 5)), aggregated=True, rule=NO_RULE
        )
    assert counts == (0, 0)
    assert warnings_of(caplog) == []
    assert screen.run_tally.not_applied == Counter()


@pytest.mark.parametrize(
    ("steps", "counts", "start", "fix"),
    [
        (
            ((None, 5), (5, 5), (None, 5)),
            (2, 0),
            "MyProx: round 1: nodes [1001, 1003] do not report "
            "'proximal-mu-applied', so nothing says their clients apply "
            "FedProx's proximal term; their updates are averaged in as they "
            "are: the reply carries none of FedProxRule's records",
            "(or use the pack's FedProxClient)",
        ),
        (
            ((2, 5), (5, 5), (0, 4)),
            (0, 2),
            "MyProx: round 1: nodes [1001, 1003]: FedProx's proximal term "
            "reached the update in 2 of the client's 5 local steps: 3 without it",
            "FedProxRule.add_gradient()",
        ),
    ],
    ids=["rule-missing", "term-shortfall"],
)
def test_each_kind_is_warned_once_per_run(
    caplog: pytest.LogCaptureFixture,
    steps: tuple[tuple[int | None, int], ...],
    counts: tuple[int, int],
    start: str,
    fix: str,
) -> None:
    screen = ReplyScreen()
    replies = rule_replies(*steps)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert rounds(screen, replies, 1, 2) == [counts, counts]
    (warning,) = warnings_of(caplog)
    assert warning.startswith(start) and fix in warning
    # Every such reply is counted, each round, for the run's end.
    assert sum(screen.run_tally.not_applied.values()) == 4
    assert screen.run_tally.not_applied_nodes == {1001, 1003}
    caplog.clear()
    screen.reset_run()
    assert screen.run_tally.not_applied == Counter()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert rounds(screen, replies, 3) == [counts]
    assert [w[:28] for w in warnings_of(caplog)] == ["MyProx: round 3: nodes [1001"]


def test_steps_lost_are_named_apart_from_steps_without_the_term() -> None:
    screen = ReplyScreen()
    (short,) = rule_replies((1, 5))
    short.metrics[TERM_LOST_METRIC] = 4
    screen.rule_not_applied(1, [short], aggregated=True, rule=PROX)
    (problem,) = screen.run_tally.not_applied
    assert problem.startswith("FedProx's proximal term missed updates: steps lost")


def test_a_round_not_aggregated_counts_but_neither_warns_nor_tallies(
    caplog: pytest.LogCaptureFixture,
) -> None:
    screen = ReplyScreen()
    replies = rule_replies((None, 5), (1, 5), (5, 5))
    with caplog.at_level(logging.WARNING, logger="flwr"):
        counts = screen.rule_not_applied(1, replies, aggregated=False, rule=PROX)
    assert counts == (1, 1)
    assert warnings_of(caplog) == []
    assert screen.run_tally.not_applied == Counter()
    # The warnings were not spent on the round thrown away.
    with caplog.at_level(logging.WARNING, logger="flwr"):
        rounds(screen, replies, 2)
    assert [w.split(":")[1] for w in warnings_of(caplog)] == [" round 2"] * 2


# ------------------------------------------------------------------- collect
def sent(nodes: tuple[int, ...], kind: str = MessageType.TRAIN) -> list[Message]:
    """The messages a round sends to ``nodes``: the model and an empty config."""
    set_task_identity(1)
    return node_messages(
        nodes,
        kind,
        arrays=("arrays", record(MODEL)),
        records={},
        config=("config", {}),
    )


def accept(reply: ValidReply) -> None:
    """A strategy's check that passes every reply."""


def collect(
    screen: ReplyScreen, replies: list[Message], **options: Any
) -> tuple[list[ValidReply], int, int, int]:
    """Round 1 of nodes 1001-1003, replies expected to carry the model."""
    options = {
        "expected_arrays": EXPECTED,
        "sampled": {1001, 1002, 1003},
        "phase": "aggregate_train",
        "check": accept,
        "retired": set(),
        "rule": NO_RULE,
        **options,
    }
    return screen.collect(1, replies, **options)


def test_collect_names_unsampled_duplicate_failed_and_silent_nodes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    screen = ReplyScreen()
    to = sent((1001, 1002, 1003, 1004))
    replies = [
        reply(to[0], MODEL),
        reply(to[0], MODEL),  # a second reply from node 1001
        error_reply(to[1], "boom"),
        reply(to[3], MODEL),  # node 1004 was not sampled
    ]
    with caplog.at_level(logging.INFO, logger="flwr"):
        valid, failed, rejected, absent = collect(screen, replies)
    assert [r.node_id for r in valid] == [1001]
    assert (failed, rejected, absent) == (2, 2, 0)
    assert screen.rejections == {
        "aggregate_train:duplicate": 1,
        "aggregate_train:error-reply": 1,
        "aggregate_train:unsampled": 1,
        "aggregate_train:no-reply": 1,
    }
    assert screen.round_tally.failed == {
        "boom": 1,
        "no reply before the round timeout": 1,
    }
    assert screen.round_tally.nodes == {1001, 1002, 1003, 1004}
    assert screen.run_tally.nodes == {1001, 1002, 1003, 1004}
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "aggregate_train: round 1: reply from node 1001 not used (duplicate): "
        "second reply from this node",
        "aggregate_train: round 1: reply from node 1002 not used (error-reply): "
        "error reply: boom",
        "aggregate_train: round 1: reply from node 1004 not used (unsampled): "
        "node was not sampled this round",
        "aggregate_train: round 1: reply from node 1003 not used (no-reply): "
        "no reply before the round timeout",
        "aggregate_train: round 1: 1 valid, 2 failed, 2 rejected",
    ]


@pytest.mark.parametrize(
    ("phase", "retires"), [("aggregate_train", True), ("aggregate_evaluate", False)]
)
def test_a_spent_budget_is_absent_not_failed(
    caplog: pytest.LogCaptureFixture, phase: str, retires: bool
) -> None:
    screen = ReplyScreen()
    retired: set[int] = {1005}
    to = sent((1001, 1002))
    replies = [
        reply(to[0], MODEL),
        error_reply(to[1], "PrivacyBudgetExhausted: epsilon 3.1 > 3"),
    ]
    with caplog.at_level(logging.INFO, logger="flwr"):
        valid, failed, rejected, absent = collect(
            screen, replies, sampled={1001, 1002}, retired=retired, phase=phase
        )
    assert len(valid) == 1 and (failed, rejected, absent) == (0, 0, 1)
    assert retired == ({1002, 1005} if retires else {1005})
    assert screen.rejections == Counter()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"{phase}: round 1: node 1002 retires: error reply: PrivacyBudgetExhausted: "
        "epsilon 3.1 > 3",
        f"{phase}: round 1: 1 valid, 0 failed, 0 rejected, 1 out of privacy budget",
    ]


def test_declared_metrics_are_checked_before_the_strategys_check() -> None:
    screen = ReplyScreen()
    to = sent((1001, 1002, 1003))
    replies = [
        reply(to[0], MODEL, metrics={"accuracy": 0.5}),
        reply(to[1], MODEL, metrics={}),  # no accuracy: the check never sees it
        reply(to[2], MODEL, metrics={"accuracy": 0.5}),
    ]
    checked: list[int] = []

    def refuse_1003(reply: ValidReply) -> None:
        checked.append(reply.node_id)
        if reply.node_id == 1003:
            raise ReplyRejected("custom", "the strategy says no")

    valid, failed, rejected, _ = collect(
        screen,
        replies,
        check=refuse_1003,
        expected_metrics={"accuracy": MetricSpec(minimum=0.0, maximum=1.0)},
    )
    assert [r.node_id for r in valid] == [1001]
    assert (failed, rejected) == (0, 2)
    assert checked == [1001, 1003]
    assert screen.rejections == {
        "aggregate_train:metric": 1,
        "aggregate_train:custom": 1,
    }


def test_evaluation_replies_skip_the_strategys_check_and_keep_the_round_tally() -> None:
    screen = ReplyScreen()
    round_tally = screen.round_tally
    to = sent((1001, 1002), MessageType.EVALUATE)

    def refuse(reply: ValidReply) -> None:
        raise ReplyRejected("custom", "never called without expected records")

    valid, failed, rejected, absent = collect(
        screen,
        [reply(to[0], None, 4), error_reply(to[1])],
        expected_arrays={},
        sampled={1001, 1002},
        phase="aggregate_evaluate",
        check=refuse,
    )
    assert [(r.node_id, r.num_examples) for r in valid] == [(1001, 4)]
    assert (failed, rejected, absent) == (1, 0, 0)
    assert screen.round_tally is round_tally and screen.run_tally.nodes == set()
    assert screen.rejections == {"aggregate_evaluate:error-reply": 1}


def test_a_reply_over_the_size_limit_is_rejected() -> None:
    screen = ReplyScreen(max_reply_bytes=100)
    to = sent((1001, 1002))
    valid, failed, rejected, _ = collect(
        screen, [reply(m, MODEL) for m in to], sampled={1001, 1002}
    )
    assert (len(valid), failed, rejected) == (0, 0, 2)
    assert screen.rejections == {"aggregate_train:too-large": 2}


@pytest.mark.parametrize(
    ("rule", "hint"),
    [
        (PROX, ": the reply carries none of FedProxRule's records"),
        (NO_RULE, ""),
    ],
)
def test_missing_records_are_explained_by_the_rule(
    caplog: pytest.LogCaptureFixture, rule: RuleNames, hint: str
) -> None:
    screen = ReplyScreen()
    to = sent((1001, 1002))
    replies = [reply(to[0], MODEL), reply(to[1], None)]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        valid, _, rejected, _ = collect(
            screen, replies, sampled={1001, 1002}, rule=rule
        )
    assert len(valid) == 1 and rejected == 1
    (line,) = warnings_of(caplog)
    expected = (
        "aggregate_train: round 1: reply from node 1002 not used (records): "
        "ArrayRecords [], expected ['arrays']"
    )
    assert line.startswith(expected + hint)
    assert line == expected if not hint else len(line) > len(expected + hint)

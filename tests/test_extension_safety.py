"""A strategy of one's own cannot get the state, the metrics or NaN wrong silently.

The state handed to ``server_update`` is read-only and holds only declared
fields; declared reply metrics are enforced with a reason naming them; a rule
of one's own gets every reply's model checked for NaN/inf unless it declares
that its model is a positive combination of the replies'.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord

from flwr_prox_strategies import testing
from flwr_prox_strategies.core.contract.frozen import (
    StateMutationError,
    UndeclaredStateError,
)
from flwr_prox_strategies.extend import (
    Algorithm,
    MetricSpec,
    RoundUpdate,
    ValidatedFedAvg,
    dict_to_record,
)


class Momentum(ValidatedFedAvg):
    """Server momentum: the official FedNova code's buffer, kept as state."""

    state_fields = ("buffer",)

    def __init__(self, *, in_place: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.in_place = in_place
        self.buffer: dict[str, np.ndarray] | None = None

    def server_update(self, server_round, state, replies):
        mean = self.weighted_mean(replies)
        buffer = state["buffer"]
        if buffer is None:
            new = {k: v.copy() for k, v in mean.items()}
        elif self.in_place:  # buf.mul_(0.9).add_(mean) as torch code writes it
            for key in buffer:
                buffer[key] *= 0.9
                buffer[key] += mean[key]
            new = dict(buffer)
        else:
            new = {k: 0.9 * buffer[k] + mean[k] for k in buffer}
        return RoundUpdate(dict_to_record(new), {"buffer": new})


def two_rounds(strategy) -> None:
    _, messages, _ = testing.first_round(lambda n: strategy)
    for rnd in (1, 2):
        if rnd == 2:
            messages = list(
                strategy.configure_train(
                    2,
                    testing.record(testing.model_arrays()),
                    ConfigRecord(),
                    testing.sampling_grid(),
                )
            )
        replies = [
            testing.valid_reply(strategy, m, seed=i) for i, m in enumerate(messages)
        ]
        assert strategy.aggregate_train(rnd, replies)[0] is not None


def test_a_rule_that_writes_into_its_state_fails_at_once_saying_what_to_do() -> None:
    two_rounds_ok = Momentum(min_available_nodes=5)
    two_rounds(two_rounds_ok)
    assert (
        two_rounds_ok.buffer is not None and two_rounds_ok.buffer["w"].flags.writeable
    )
    with pytest.raises(StateMutationError, match=r"return new values in RoundUpdate"):
        two_rounds(Momentum(in_place=True, min_available_nodes=5))


def test_assigning_into_the_state_fails_saying_what_to_do() -> None:
    class Assigns(Momentum):
        def server_update(self, server_round, state, replies):
            state["buffer"] = {}
            return super().server_update(server_round, state, replies)

    with pytest.raises(StateMutationError, match=r"assigned state\['buffer'\]"):
        two_rounds(Assigns(min_available_nodes=5))


def test_reading_an_undeclared_field_names_state_fields() -> None:
    class Undeclared(Momentum):
        def server_update(self, server_round, state, replies):
            _ = state["velocity"]
            return super().server_update(server_round, state, replies)

    with pytest.raises(UndeclaredStateError, match=r"not in Undeclared.state_fields"):
        two_rounds(Undeclared(min_available_nodes=5))


def test_a_value_returned_unchanged_is_committed_as_the_original() -> None:
    class Keeps(Momentum):
        def server_update(self, server_round, state, replies):
            update = super().server_update(server_round, state, replies)
            if state["buffer"] is not None:
                update.state = {"buffer": state["buffer"]}  # the given value itself
            return update

    strategy = Keeps(min_available_nodes=5)
    two_rounds(strategy)
    assert isinstance(strategy.buffer, dict)
    assert all(v.flags.writeable for v in strategy.buffer.values())


class Tau(ValidatedFedAvg):
    """Replies must carry an integer step count of at least 1."""

    def expected_train_metrics(self, server_round):
        return {"tau": MetricSpec(kind="int", minimum=1)}


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (None, "no 'tau'"),
        (0, "metric 'tau' is 0, below its minimum 1"),
        (2.5, "metric 'tau' is 2.5, not an int"),
    ],
)
def test_a_declared_metric_is_enforced_naming_it(value, reason, caplog) -> None:
    strategy, messages, _ = testing.first_round(lambda n: Tau(min_available_nodes=n))
    replies = [testing.valid_reply(strategy, m, seed=i) for i, m in enumerate(messages)]
    assert replies[1].content["metrics"]["tau"] == 1  # built from the declaration
    if value is None:
        del replies[0].content["metrics"]["tau"]
    else:
        replies[0].content["metrics"]["tau"] = value
    with caplog.at_level("INFO", logger="flwr"):
        _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["replies-rejected"] == 1 and metrics["replies-valid"] == 4
    assert any(reason in r.getMessage() for r in caplog.records), caplog.text


def test_the_kit_checks_a_strategy_with_declared_metrics() -> None:
    testing.check_algorithm(Algorithm(Tau, None, None))


def test_metric_spec_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="kind"):
        MetricSpec(kind="str")
    with pytest.raises(ValueError, match="above maximum"):
        MetricSpec(minimum=2, maximum=1)


class FromOtherRecord(ValidatedFedAvg):
    """Builds its model from an update record, not from the replies' models."""

    def expected_train_arrays(self, server_round):
        expected = super().expected_train_arrays(server_round)
        expected["update"] = expected[self.arrayrecord_key]
        return expected

    def server_update(self, server_round, state, replies):
        return RoundUpdate(dict_to_record(self.weighted_mean(replies, "update")))


def test_a_rule_of_ones_own_gets_every_reply_checked_for_nan() -> None:
    assert FromOtherRecord.model_linear_in_replies is False
    assert ValidatedFedAvg.model_linear_in_replies is True
    testing.check_bad_reply(lambda n: FromOtherRecord(min_available_nodes=n), "nan")


def test_the_old_name_of_the_declaration_still_works_with_a_warning() -> None:
    with pytest.warns(FutureWarning, match="model_linear_in_replies"):

        class Old(ValidatedFedAvg):
            linear_aggregate = False

    assert Old.model_linear_in_replies is False


def test_torch_tensors_in_the_state_are_refused_naming_the_field() -> None:
    import torch

    class Tensors(Momentum):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.buffer = {"w": torch.zeros(4, 3)}

    with pytest.raises(TypeError, match=r"Tensors.buffer holds a Tensor"):
        two_rounds(Tensors(min_available_nodes=5))

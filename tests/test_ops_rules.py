"""The server and client rules of ``ops``, each against a computation done by hand.

Every expected value below is worked out in the comment beside it, on numbers
small enough to check by eye; each pure function is also shown to leave its
inputs untouched. The last tests check the strategies' side of the contract:
``server_update`` (and ``grown_state``) never mutate the state they are given.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord

from flwr_prox_strategies.ops.control import control_update, rescaled, zeros_like
from flwr_prox_strategies.ops.drift import drift_corrected, drift_sum, norm, summed

from .helpers import sampling_grid
from .test_contract import (
    NUM_NODES,
    STRATEGIES,
    build_reply,
    good_content,
    setup_round,
)


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def assert_identical(a: Any, b: Any, where: str = "state") -> None:
    """Same structure, same types, same dtypes and bits (NaN equal to NaN)."""
    assert type(a) is type(b), where
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), where


# ---------------------------------------------------------------- ops.drift
THETA_T = {"w": f32(1.0, 2.0), "count": np.array([5], dtype=np.int64)}
MODELS = [
    {"w": f32(2.0, 0.0), "count": np.array([7], dtype=np.int64)},
    {"w": f32(1.5, 3.0), "count": np.array([9], dtype=np.int64)},
]


def test_drift_sum_from_zero_adds_each_models_step_from_theta_t() -> None:
    # (2 - 1) + (1.5 - 1) = 1.5;  (0 - 2) + (3 - 2) = -1. The integer counter
    # takes no part (only floating arrays carry a drift).
    inputs = copy.deepcopy((THETA_T, MODELS))
    total = drift_sum(None, THETA_T, MODELS)
    assert list(total) == ["w"]
    assert_identical(total["w"], f32(1.5, -1.0))
    assert_identical((THETA_T, MODELS), inputs)
    assert drift_sum({}, THETA_T, MODELS)["w"].tolist() == [1.5, -1.0]


def test_drift_sum_continues_the_previous_sum_without_touching_it() -> None:
    # [0.5, 0.5] + [1.5, -1] = [2, -0.5]
    previous = {"w": f32(0.5, 0.5)}
    total = drift_sum(previous, THETA_T, MODELS)
    assert_identical(total["w"], f32(2.0, -0.5))
    assert_identical(previous, {"w": f32(0.5, 0.5)})
    assert total["w"] is not previous["w"]


def test_drift_corrected_adds_the_sum_over_k_in_the_averages_dtype() -> None:
    # [1, 1] + [3, -6] / 3 = [2, -1], float32 as the average (the sum is float64)
    average = {"w": f32(1.0, 1.0), "count": np.array([4], dtype=np.int64)}
    drift = {"w": np.array([3.0, -6.0])}
    model = drift_corrected(average, drift, 3)
    assert_identical(model["w"], f32(2.0, -1.0))
    assert_identical(model["count"], np.array([4], dtype=np.int64))
    assert_identical(average["w"], f32(1.0, 1.0))


def test_summed_adds_every_change_to_a_copy_of_the_start() -> None:
    # [1, 2] + [10, 20] + [100, 200] = [111, 222]
    start = {"a": np.array([1.0, 2.0])}
    total = summed(
        start, [{"a": np.array([10.0, 20.0])}, {"a": np.array([100.0, 200.0])}]
    )
    assert_identical(total, {"a": np.array([111.0, 222.0])})
    assert_identical(start, {"a": np.array([1.0, 2.0])})
    assert_identical(summed(start, []), start)


def test_norm_takes_all_arrays_as_one_vector() -> None:
    # sqrt(3^2 + 0^2 + 4^2) = 5
    assert norm({"a": np.array([3.0, 0.0]), "b": np.array([[4.0]])}) == 5.0
    assert norm({}) == 0.0


# -------------------------------------------------------------- ops.control
def test_zeros_like_keeps_every_key_shape_and_dtype() -> None:
    c = zeros_like(THETA_T)
    assert_identical(c, {"w": f32(0.0, 0.0), "count": np.array([0], dtype=np.int64)})


C = {"w": f32(0.5, -1.0), "count": np.array([3], dtype=np.int64)}
DELTAS = [
    {"w": f32(2.0, 4.0), "count": np.array([9], dtype=np.int64)},
    {"w": f32(-1.0, 2.0), "count": np.array([9], dtype=np.int64)},
]


def test_control_update_adds_the_deltas_over_all_n_clients() -> None:
    # N = 4 clients, 2 of them reply:
    # 0.5 + (2 - 1) / 4 = 0.75;  -1 + (4 + 2) / 4 = 0.5; the counter is kept.
    inputs = copy.deepcopy((C, DELTAS))
    new = control_update(C, DELTAS, 4)
    assert_identical(new, {"w": f32(0.75, 0.5), "count": np.array([3], dtype=np.int64)})
    assert_identical((C, DELTAS), inputs)
    assert new["count"] is not C["count"]


def test_control_update_weights_each_delta_by_its_scale() -> None:
    # scale (2, 1): 0.5 + (2*2 - 1) / 4 = 1.25;  -1 + (2*4 + 2) / 4 = 1.5
    new = control_update(C, DELTAS, 4, scale=[2.0, 1.0])
    assert_identical(new["w"], f32(1.25, 1.5))
    with pytest.raises(ValueError, match="1 scale weight"):
        control_update(C, DELTAS, 4, scale=[1.0])


def test_control_update_without_replies_is_a_copy() -> None:
    new = control_update(C, [], 4)
    assert_identical(new, C)
    assert new["w"] is not C["w"]


def test_rescaled_multiplies_the_floating_arrays_only() -> None:
    # K grows 2 -> 4: c is a mean over K, so c * 2/4 = [0.25, -0.5]; counter kept.
    new = rescaled(C, 2 / 4)
    assert_identical(
        new, {"w": f32(0.25, -0.5), "count": np.array([3], dtype=np.int64)}
    )
    assert_identical(C["w"], f32(0.5, -1.0))


# ------------------------------------------- strategies: state is not mutated
def spy_on_server_updates(strategy) -> list[tuple[dict, dict]]:
    """Record (deep copy at entry, the dict itself) for each server_update call."""
    calls: list[tuple[dict, dict]] = []
    for server in getattr(strategy, "inner", [strategy]):  # P-FedAvg: its servers
        rule = server.server_update

        def spy(server_round, state, replies, rule=rule):
            calls.append((copy.deepcopy(state), state))
            return rule(server_round, state, replies)

        server.server_update = spy
    return calls


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_server_update_does_not_mutate_the_state_it_is_given(name: str) -> None:
    """Round 2 (state from round 1 in hand): the given state is as it came in."""
    strategy, _, good = setup_round(name)
    arrays, _ = strategy.aggregate_train(1, good)
    assert arrays is not None
    calls = spy_on_server_updates(strategy)
    messages = list(
        strategy.configure_train(2, arrays, ConfigRecord(), sampling_grid(NUM_NODES))
    )
    replies = [
        build_reply(m, good_content(strategy, i + 3), strategy=strategy, n=12 + i)
        for i, m in enumerate(messages)
    ]
    new, _ = strategy.aggregate_train(2, replies)
    assert new is not None and calls
    for at_entry, given in calls:  # checked after the round was committed
        assert_identical(given, at_entry)


@pytest.mark.parametrize("name", ["scaffold", "feddc"])
def test_grown_state_does_not_mutate_the_state_it_is_given(name: str) -> None:
    strategy, _, good = setup_round(name)
    strategy.aggregate_train(1, good)
    state = {field: getattr(strategy, field) for field in strategy.state_fields}
    at_entry = copy.deepcopy(state)
    grown = strategy.grown_state(state, NUM_NODES, NUM_NODES + 1)
    assert_identical(state, at_entry)
    assert grown["control"] is not state["control"]

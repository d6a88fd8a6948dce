"""The server and client rules of ``ops``, each against a computation done by hand.

Every expected value below is worked out in the comment beside it, on numbers
small enough to check by eye; each pure function is also shown to leave its
inputs untouched. The last tests check the strategies' side of the contract:
``server_update`` (and ``grown_state``) never mutate the state they are given.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord

from flwr_prox_strategies.core.contract.frozen import FrozenState
from flwr_prox_strategies.ops.apfl import (
    add_weighted,
    alpha_gradient,
    alpha_update,
    averaging_weight,
    averaging_weight_sum,
    caught_up,
    decay_rate,
    mix,
    mixture,
    normalised,
    personal_gradient,
)
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
    # N grows 2 -> 4: c is a mean over N, so c * 2/4 = [0.25, -0.5]; counter kept.
    new = rescaled(C, 2 / 4)
    assert_identical(
        new, {"w": f32(0.25, -0.5), "count": np.array([3], dtype=np.int64)}
    )
    assert_identical(C["w"], f32(0.5, -1.0))


# ----------------------------------------------------------------- ops.apfl
def t(*values: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def assert_tensor(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert torch.equal(got, want), (got, want)


def test_averaging_weights_are_the_squares_of_t_plus_a() -> None:
    # p_2 = (2 + 1.5)^2 = 12.25;  p_2 + p_3 at a = 1: 3^2 + 4^2 = 25
    assert averaging_weight(2, 1.5) == 12.25
    assert averaging_weight_sum(2, 3, 1.0) == 25.0
    assert averaging_weight_sum(1, 1, 1.0) == averaging_weight(1, 1.0) == 4.0
    assert averaging_weight_sum(3, 2, 1.0) == 0.0  # no step
    with pytest.raises(ValueError, match="from 1"):
        averaging_weight_sum(0, 2, 1.0)


def test_decay_rate_is_16_over_mu_t_plus_a() -> None:
    # 16 / (4 * (2 + 2)) = 1
    assert decay_rate(2, 4.0, 2.0) == 1.0


def test_mix_of_numbers_tensors_and_a_learned_alpha() -> None:
    # 0.25 * 4 + 0.75 * 8 = 7;  0.25 * 0 + 0.75 * (-4) = -3
    assert mix(0.25, 4.0, 8.0) == 7.0
    assert_tensor(mix(0.25, t(4.0, 0.0), t(8.0, -4.0)), t(7.0, -3.0))
    # d/dalpha of alpha * 4 + (1 - alpha) * 8 is 4 - 8 = -4 (output mixing's alpha)
    alpha = torch.tensor(0.25, dtype=torch.float64, requires_grad=True)
    mix(
        alpha, t(4.0, dtype=torch.float64), t(8.0, dtype=torch.float64)
    ).sum().backward()
    assert alpha.grad is not None and float(alpha.grad) == -4.0


def test_mixture_mixes_parameter_by_parameter() -> None:
    # 0.5 * [2, 4] + 0.5 * [0, 2] = [1, 3];  0.5 * [[6]] + 0.5 * [[-2]] = [[2]]
    omega = [t(2.0, 4.0), torch.tensor([[6.0]])]
    theta = [t(0.0, 2.0), torch.tensor([[-2.0]])]
    point = mixture(0.5, omega, theta)
    assert_tensor(point[0], t(1.0, 3.0))
    assert_tensor(point[1], torch.tensor([[2.0]]))
    assert_tensor(omega[0], t(2.0, 4.0))


def test_personal_gradient_mixture_or_chain_rule() -> None:
    # mixture: grad f at the mixture itself; chain: alpha times it, 0.25 * [2, -4]
    grads = [t(2.0, -4.0)]
    assert_tensor(personal_gradient(grads, 0.25, "mixture")[0], t(2.0, -4.0))
    assert_tensor(personal_gradient(grads, 0.25, "chain")[0], t(0.5, -1.0))
    assert_tensor(grads[0], t(2.0, -4.0))
    with pytest.raises(ValueError, match="mixture or chain"):
        personal_gradient(grads, 0.25, "outputs")


def test_personal_gradient_is_the_gradient_in_omega_of_the_mixed_loss() -> None:
    # f(x) = 1/2 ||x - y||^2 at x = alpha w + (1 - alpha) th, alpha = 0.5:
    # x = 0.5 [3, 1] + 0.5 [1, 1] = [2, 1], grad f(x) = x - y = [2, 1] - [0, 3] = [2, -2];
    # d f / d w = alpha * grad f = [1, -1] (chain); d f / d alpha = <w - th, grad f>
    # = [2, 0] . [2, -2] = 4.
    w, th, y = t(3.0, 1.0), t(1.0, 1.0), t(0.0, 3.0)
    x = mixture(0.5, [w], [th])[0].requires_grad_()
    (grad_x,) = torch.autograd.grad(0.5 * ((x - y) ** 2).sum(), [x])
    assert_tensor(grad_x, t(2.0, -2.0))
    assert_tensor(personal_gradient([grad_x], 0.5, "chain")[0], t(1.0, -1.0))
    assert alpha_gradient([w], [th], [grad_x]) == 4.0


def test_alpha_gradient_sums_over_parameters() -> None:
    # <[3, 1] - [1, 1], [0.5, 7]> = 2 * 0.5 + 0 * 7 = 1;  <[[1]] - [[-1]], [[2]]> = 4
    omega = [t(3.0, 1.0), torch.tensor([[1.0]])]
    theta = [t(1.0, 1.0), torch.tensor([[-1.0]])]
    grads = [t(0.5, 7.0), torch.tensor([[2.0]])]
    assert alpha_gradient(omega, theta, grads) == 5.0


def test_alpha_update_steps_and_clips_to_the_unit_interval() -> None:
    # 0.5 - 0.1 * 2 = 0.3;  0.05 - 0.2 < 0 -> 0;  0.95 + 0.2 > 1 -> 1
    assert alpha_update(0.5, 0.1, 2.0) == pytest.approx(0.3, abs=1e-15)
    assert alpha_update(0.05, 0.1, 2.0) == 0.0
    assert alpha_update(0.95, 0.1, -2.0) == 1.0


def test_normalised_divides_the_weighted_sums_into_the_models_dtype() -> None:
    # [10, 20] / 4 = [2.5, 5], float64 sums back to the float32 parameters
    sums = [t(10.0, 20.0, dtype=torch.float64)]
    out = normalised(sums, 4.0, [t(0.0, 0.0)])
    assert_tensor(out[0], t(2.5, 5.0))


def test_caught_up_adds_the_idle_steps_with_the_unchanged_omega() -> None:
    # [1, 1] + 3 * [2, -1] = [7, -2], in float64
    sums = [t(1.0, 1.0, dtype=torch.float64)]
    out = caught_up(sums, [t(2.0, -1.0)], 3.0)
    assert_tensor(out[0], t(7.0, -2.0, dtype=torch.float64))
    assert_tensor(sums[0], t(1.0, 1.0, dtype=torch.float64))


def test_add_weighted_accumulates_the_rounds_in_float64() -> None:
    # from zero: 0.5 * [1, 2] = [0.5, 1];  then + 2 * [4, -2] = [8.5, -3]
    first = add_weighted(None, {"w": f32(1.0, 2.0)}, 0.5)
    assert_identical(first, {"w": np.array([0.5, 1.0])})
    second = add_weighted(first, {"w": f32(4.0, -2.0)}, 2.0)
    assert_identical(second, {"w": np.array([8.5, -3.0])})
    assert_identical(first, {"w": np.array([0.5, 1.0])})


# ------------------------------------------- strategies: state is not mutated
def spy_on_server_updates(strategy) -> list[Mapping]:
    """Record the state each server_update call is given."""
    calls: list[Mapping] = []
    for server in getattr(strategy, "inner", [strategy]):  # P-FedAvg: its servers
        rule = server.server_update

        def spy(server_round, state, replies, rule=rule):
            calls.append(state)
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
    for given in calls:  # read-only: a rule cannot have changed it
        assert isinstance(given, FrozenState)
        for value in given.values():
            arrays = value.values() if isinstance(value, Mapping) else [value]
            for array in arrays:
                if isinstance(array, np.ndarray):
                    assert not array.flags.writeable


@pytest.mark.parametrize("name", ["scaffold", "feddc"])
def test_grown_state_does_not_mutate_the_state_it_is_given(name: str) -> None:
    strategy, _, good = setup_round(name)
    strategy.aggregate_train(1, good)
    state = {field: getattr(strategy, field) for field in strategy.state_fields}
    at_entry = copy.deepcopy(state)
    grown = strategy.grown_state(state, NUM_NODES, NUM_NODES + 1)
    assert_identical(state, at_entry)
    assert grown["control"] is not state["control"]

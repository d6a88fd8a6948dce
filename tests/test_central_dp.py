"""Central DP: the pack's strategies inside Flower's fixed-clipping wrappers.

The contract suite again, with every strategy wrapped: a bad reply must leave the
released model, the metrics and the strategy's state exactly as the same round
without it (the wrapper's Gaussian noise is seeded identically for both rounds).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
)

from flwr_prox_strategies import (
    ClientSideFixedClipping,
    FedAvg,
    FedDyn,
    ServerSideFixedClipping,
)
from flwr_prox_strategies.core.privacy.central import dp_caveats, extra_reply_records

from .helpers import model_arrays, record, sampling_grid
from .test_contract import (
    BAD_REPLIES,
    NUM_NODES,
    STRATEGIES,
    assert_same_state,
    build_reply,
    good_content,
    to_np,
)

# P-FedAvg sends each server group its own model: not a single global release.
PACK = sorted(name for name in STRATEGIES if not name.startswith("pfedavg"))
WRAPPERS: dict[str, Callable] = {
    "server-side": ServerSideFixedClipping,
    "client-side": ClientSideFixedClipping,
    # Flower's own client-side wrapper needs no screening: clipping is the
    # clients' job, and the wrapped strategy sees every reply first.
    "flower-client-side": DifferentialPrivacyClientSideFixedClipping,
}


def wrapped(wrapper: str, name: str):
    inner = STRATEGIES[name]()
    return WRAPPERS[wrapper](
        inner, noise_multiplier=0.3, clipping_norm=5.0, num_sampled_clients=NUM_NODES
    )


def setup(wrapper: str, name: str):
    strategy = wrapped(wrapper, name)
    messages = list(
        strategy.configure_train(
            1, record(model_arrays()), ConfigRecord(), sampling_grid(NUM_NODES)
        )
    )
    good = [
        build_reply(
            m, good_content(strategy.strategy, i), n=10 + i, strategy=strategy.strategy
        )
        for i, m in enumerate(messages)
    ]
    return strategy, messages, good


def aggregate(strategy, replies):
    np.random.seed(1234)  # Flower's noise draws from numpy's global generator
    return strategy.aggregate_train(1, replies)


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("name", PACK)
# Error replies (a failed ClientApp, a dead node's) follow Flower's policy: below.
@pytest.mark.parametrize(
    "kind", sorted(set(BAD_REPLIES) - {"error-reply", "dead-node"})
)
def test_bad_reply_is_as_if_absent_inside_the_wrapper(wrapper, name, kind) -> None:
    if wrapper == "server-side" and extra_reply_records(STRATEGIES[name]()):
        pytest.skip("server-side clipping treats every reply record as a model")
    with_bad, messages, good = setup(wrapper, name)
    without_bad, _, good_b = setup(wrapper, name)
    bad = BAD_REPLIES[kind](with_bad.strategy, messages[0], good)
    if kind == "duplicate":
        replies_a, replies_b = [good[0], bad, *good[1:]], good_b
    else:
        replies_a, replies_b = [bad, *good[1:]], good_b[1:]
    arrays_a, metrics_a = aggregate(with_bad, replies_a)
    arrays_b, metrics_b = aggregate(without_bad, replies_b)
    a, b = to_np(arrays_a), to_np(arrays_b)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].tobytes() == b[key].tobytes(), key
    assert_same_state(with_bad.strategy.state_dict(), without_bad.strategy.state_dict())
    ignore = {"replies-failed", "replies-rejected"}
    assert {k: v for k, v in metrics_a.items() if k not in ignore} == {
        k: v for k, v in metrics_b.items() if k not in ignore
    }
    # The bad reply is counted once; a sampled node that sent nothing (the bad
    # reply came from another node) is counted once more, as no-reply.
    silent = sum(
        n for k, n in with_bad.strategy.rejections.items() if k.endswith(":no-reply")
    )
    assert sum(with_bad.strategy.rejections.values()) - silent == 1


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("name", PACK)
@pytest.mark.parametrize("kind", ["error-reply", "dead-node"])
def test_error_reply_skips_the_round_and_touches_nothing(wrapper, name, kind) -> None:
    """Flower's policy: no aggregation with an error in the round (noise is
    calibrated to the number of sampled clients)."""
    strategy, messages, good = setup(wrapper, name)
    reference, _, _ = setup(wrapper, name)
    bad = BAD_REPLIES[kind](strategy.strategy, messages[0], good)
    arrays, _ = aggregate(strategy, [bad, *good[1:]])
    assert arrays is None
    assert_same_state(reference.strategy.state_dict(), strategy.strategy.state_dict())


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_released_model_is_the_clipped_aggregate_plus_noise(wrapper) -> None:
    strategy, _, good = setup(wrapper, "fedavg-uniform")
    _, _, good_plain = setup(wrapper, "fedavg-uniform")
    noisy = to_np(aggregate(strategy, good)[0])
    # The replies' updates are far outside the clipping norm: clip by hand.
    base = model_arrays()
    updates = []
    for reply in good_plain:
        sent = {k: v.numpy() for k, v in reply.content["arrays"].items()}
        delta = {k: sent[k] - base[k] for k in base}
        norm = np.sqrt(
            sum(float((d.astype(np.float64) ** 2).sum()) for d in delta.values())
        )
        factor = min(1.0, 5.0 / norm)
        updates.append({k: base[k] + factor * d for k, d in delta.items()})
    if wrapper != "server-side":  # clients clip (fixedclipping_mod): not here
        updates = [
            {k: v.numpy() for k, v in r.content["arrays"].items()} for r in good_plain
        ]
    mean = {k: np.mean([u[k] for u in updates], axis=0) for k in base}
    np.random.seed(1234)
    std = 0.3 * 5.0 / NUM_NODES
    for key in base:  # Flower draws noise array by array, in record order
        expected = mean[key] + np.random.normal(0, std, mean[key].shape)
        np.testing.assert_allclose(noisy[key], expected, rtol=1e-5, atol=1e-5)


def test_caveats_name_what_central_dp_does_not_cover(caplog) -> None:
    assert dp_caveats(FedAvg(min_available_nodes=2)) == []
    caveats = dp_caveats(FedDyn(alpha=0.1, num_clients=2))
    assert any("h" in c and "understates" in c for c in caveats)
    scaffold = STRATEGIES["scaffold"]()
    assert any("control" in c for c in dp_caveats(scaffold))
    ServerSideFixedClipping(scaffold, 1.0, 1.0, 5)
    assert "SCAFFOLD" in caplog.text


@pytest.mark.parametrize("clipping", ["server", "client"])
def test_central_dp_from_the_privacy_group_clips_every_update(
    tmp_path, clipping
) -> None:
    """privacy=central through the app's ServerApp/ClientApp: with a clipping norm
    of 1e-6 and no noise, the released model cannot move from the initial one."""
    import json

    from flwr_prox_strategies.experiment.sweeps.sweep import run_inprocess

    overrides = [
        "strategy=fedprox",
        "privacy=central",
        f"privacy.central.clipping={clipping}",
        "privacy.central.noise_multiplier=0.0",
        "privacy.central.clipping_norm=1e-6",
        "num_clients=3",
        "num_rounds=2",
        "model=logreg",
        "train.local_epochs=1",
    ]
    results = json.loads(run_inprocess(overrides, tmp_path, 3).read_text())
    assert results["central-dp"] == f"{clipping.title()}SideFixedClipping"
    accuracy = [r["central"]["accuracy"] for r in results["rounds"]]
    loss = [r["central"]["loss"] for r in results["rounds"]]
    assert accuracy[-1] == accuracy[0] and loss[-1] == pytest.approx(loss[0], abs=1e-5)
    assert results["rounds"][-1]["train"]["replies-valid"] == 3
    # The same run without the clipping learns: the test can fail.
    free = json.loads(
        run_inprocess(overrides[:1] + overrides[5:], tmp_path / "free", 3).read_text()
    )
    assert free["rounds"][-1]["central"]["loss"] < loss[0] - 0.1


def test_central_dp_refuses_what_it_cannot_wrap() -> None:
    from flwr_prox_strategies.core.privacy.central import central_dp

    settings = {"noise_multiplier": 1.0, "clipping_norm": 1.0, "num_sampled_clients": 5}
    with pytest.raises(ValueError, match="one model per server"):
        central_dp(STRATEGIES["pfedavg-ring"](), clipping="server", **settings)
    with pytest.raises(ValueError, match="clipping must be one of"):
        central_dp(STRATEGIES["fedavg"](), clipping="both", **settings)

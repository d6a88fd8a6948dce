"""Flower's names and habits: its keyword names, errors naming the class called,
and ``num_clients`` learned from the grid."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from flwr_prox_strategies import (
    APFL,
    FedAvg,
    FedDC,
    FedDyn,
    FedEPM,
    FedProx,
    PFedAvg,
    Scaffold,
    SFedAvg,
    SFedProx,
)
from flwr_prox_strategies.algorithms.fedepm import default_eta
from flwr_prox_strategies.core.server.strategy import ValidatedFedAvg
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid

from .helpers import configure, logged, model_arrays, record, reply, sampling_grid


# ------------------------------------------------------------- Flower's names
def test_proximal_mu_is_flowers_name_for_mu() -> None:
    strategy = FedProx(proximal_mu=0.3, min_available_nodes=2)
    assert strategy.mu == 0.3
    messages = configure(strategy, model_arrays(), sampling_grid(2))
    assert [m.content["config"]["proximal-mu"] for m in messages] == [0.3, 0.3]
    assert FedProx().mu == 0.01
    assert FedProx(mu=0.0).mu == 0.0  # 0 is a value, not "not given"
    assert SFedProx(proximal_mu=0.2, num_clients=4).mu == 0.2


@pytest.mark.parametrize("cls", [FedProx, SFedProx])
def test_mu_and_proximal_mu_together_name_both(cls) -> None:
    with pytest.raises(TypeError) as info:
        cls(mu=0.1, proximal_mu=0.2)
    message = str(info.value)
    assert message.startswith(f"{cls.__name__}()")
    assert "mu=0.1" in message and "proximal_mu=0.2" in message


def test_weighted_by_key_num_examples_is_the_default_weighting() -> None:
    assert FedAvg(weighted_by_key="num-examples").weighting == "num-examples"
    assert FedDyn().weighting == "uniform"  # the class's own default ...
    dyn = FedDyn(weighted_by_key="num-examples")  # ... which Flower's name overrides
    assert dyn.weighting == "num-examples"
    assert FedDC(correction="official", weighted_by_key="num-examples").weighting == (
        "num-examples"
    )
    assert FedDC(correction="official").weighting == "uniform"
    with pytest.raises(TypeError, match=r"weighting='uniform' and weighted_by_key"):
        FedAvg(weighting="uniform", weighted_by_key="num-examples")
    with pytest.raises(ValueError, match="weighted_by_key=<metric>"):
        FedAvg(weighting="my-weight")
    with pytest.raises(ValueError, match="FedEPM sets weighted_by_key itself"):
        FedEPM(num_clients=4, weighted_by_key="num-examples")


def metric_weighted_round(weights: list, keys_seen: list[str] | None = None):
    """One round of FedAvg(weighted_by_key="my-weight"); node i sends i + 1."""

    def custom(contents: list[RecordDict], key: str) -> MetricRecord:
        if keys_seen is not None:
            keys_seen.append(key)
        return MetricRecord({"replies": len(contents)})

    strategy = FedAvg(
        weighted_by_key="my-weight",
        min_available_nodes=len(weights),
        train_metrics_aggr_fn=custom if keys_seen is not None else None,
    )
    arrays = model_arrays()
    messages = configure(strategy, arrays, sampling_grid(len(weights)))
    replies = []
    for i, (message, weight) in enumerate(zip(messages, weights, strict=True)):
        metrics = {"train-loss": 1.0}
        if weight is not None:
            metrics["my-weight"] = weight
        sent = {k: np.full_like(v, i + 1) for k, v in arrays.items()}
        # num-examples differs wildly: it must not weigh anything here.
        replies.append(reply(message, sent, 10 ** (i + 1), metrics=metrics))
    new, metrics = strategy.aggregate_train(1, replies)
    return strategy, new, metrics


def test_weighted_by_another_key_weights_by_that_metric() -> None:
    _, new, metrics = metric_weighted_round([1.0, 3.0])
    assert new is not None and metrics["replies-valid"] == 2
    expected = (1.0 * 1 + 3.0 * 2) / 4.0
    for value in new.values():
        np.testing.assert_allclose(value.numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("bad", [None, 0.0, -1.0, math.nan, math.inf, [1.0]])
def test_a_reply_without_a_valid_weight_is_rejected(bad) -> None:
    strategy, new, metrics = metric_weighted_round([2.0, bad, 2.0])
    assert metrics["replies-valid"] == 2 and metrics["replies-rejected"] == 1
    assert strategy.rejections["aggregate_train:weight"] == 1
    for value in new.values():  # nodes 1 and 3 (values 1 and 3), equal weights
        np.testing.assert_allclose(value.numpy(), 2.0, rtol=1e-6)


def test_custom_metric_aggregation_gets_the_weighting_key_as_in_flower() -> None:
    seen: list[str] = []
    metric_weighted_round([1.0, 1.0], keys_seen=seen)
    assert seen == ["my-weight"]


# ------------------------------------------------- errors name the class called
BUILDERS: dict[str, Callable[..., object]] = {
    "FedAvg": FedAvg,
    "FedProx": FedProx,
    "FedDyn": FedDyn,
    "FedDC": FedDC,
    "Scaffold": Scaffold,
    "APFL": APFL,
    "FedEPM": FedEPM,
    "SFedAvg": SFedAvg,
    "SFedProx": SFedProx,
    "ValidatedFedAvg": ValidatedFedAvg,
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_unknown_keyword_names_the_class_and_the_closest_name(name: str) -> None:
    with pytest.raises(TypeError) as info:
        BUILDERS[name](fraction_trian=0.5)
    message = str(info.value)
    assert message.startswith(f"{name}() got unexpected keyword argument(s)")
    assert "'fraction_trian' (did you mean 'fraction_train'?)" in message
    if name != "ValidatedFedAvg":
        assert "ValidatedFedAvg" not in message


def test_the_issues_example_and_legacy_names() -> None:
    with pytest.raises(TypeError) as info:
        FedDyn(proximal_mu=0.1)
    message = str(info.value)
    assert message.startswith(
        "FedDyn() got unexpected keyword argument(s) 'proximal_mu'"
    )
    assert "alpha" in message  # the accepted names include FedDyn's own
    with pytest.raises(TypeError, match="use 'min_train_nodes'"):
        FedAvg(min_fit_clients=2)
    with pytest.raises(TypeError, match=r"^PFedAvg\(\).*did you mean 'topology'"):
        PFedAvg(servers=2, topolgy="ring")


# ------------------------------------------------------ num_clients from the grid
LEARNERS: dict[str, Callable[..., ValidatedFedAvg]] = {
    "FedDyn": lambda **kw: FedDyn(alpha=0.1, **kw),
    "Scaffold": lambda **kw: Scaffold(**kw),
    "FedDC": lambda **kw: FedDC(alpha=0.1, **kw),
    "FedEPM": lambda **kw: FedEPM(**kw),
    "SFedAvg": lambda **kw: SFedAvg(**kw),
    "SFedProx": lambda **kw: SFedProx(**kw),
}


@pytest.mark.parametrize("name", sorted(LEARNERS))
def test_num_clients_is_learned_at_round_one_and_checked_later(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = LEARNERS[name]()
    assert strategy.num_clients is None
    with caplog.at_level(logging.INFO, logger="flwr"):
        configure(strategy, model_arrays(), sampling_grid(5))
    assert strategy.num_clients == 5
    assert logged(
        caplog, "num_clients not given: using the 5 nodes connected at round 1"
    )
    # N is not "the nodes connected now": a sixth node is logged, and N grows
    # only when a sixth client replies (tests/test_churn.py).
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flwr"):
        configure(strategy, model_arrays(), sampling_grid(6), server_round=2)
    assert strategy.num_clients == 5
    assert logged(
        caplog, "6 node(s) connected, N=5 clients (learned from the grid at round 1)"
    )


def test_fedepm_derives_its_sampling_and_eta_from_the_learned_count() -> None:
    strategy = FedEPM(rho=0.5)
    messages = configure(strategy, model_arrays(), sampling_grid(5))
    assert strategy.min_train_nodes == 3 and len(messages) == 3  # ceil(0.5 * 5)
    assert strategy.eta == default_eta(5, 0.5) and strategy.lam == strategy.eta / 2
    assert messages[0].content["config"]["fedepm-eta"] == strategy.eta
    assert strategy.uploads is not None
    assert next(iter(strategy.uploads.values())).shape[0] == 5
    given = FedEPM(num_clients=5, rho=0.5)  # the same numbers when given
    assert (given.eta, given.min_train_nodes) == (strategy.eta, 3)
    sfed = SFedAvg(rho=0.5)
    configure(sfed, model_arrays(), sampling_grid(5))
    assert sfed.min_train_nodes == 3


def test_an_explicit_num_clients_is_kept_when_nodes_are_missing(caplog) -> None:
    strategy = FedDyn(num_clients=5, min_available_nodes=2)
    with caplog.at_level(logging.INFO, logger="flwr"):
        configure(strategy, model_arrays(), sampling_grid(4))
    assert strategy.num_clients == 5
    assert logged(caplog, "4 node(s) connected, N=5 clients (given)")


@pytest.mark.parametrize("name", sorted(LEARNERS))
def test_a_learned_num_clients_is_saved_and_adopted_on_resume(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = LEARNERS[name]()
    configure(strategy, model_arrays(), sampling_grid(5))
    state = strategy.state_dict()
    assert state["num-clients"] == 5

    resumed = LEARNERS[name]()
    resumed.load_state_dict(state)
    assert resumed.num_clients == 5
    assert resumed.num_clients_source.startswith("learned from the grid")
    assert resumed.min_train_nodes == strategy.min_train_nodes
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flwr"):
        configure(resumed, model_arrays(), sampling_grid(5), server_round=1)
    assert not logged(caplog, "num_clients not given")
    configure(resumed, model_arrays(), sampling_grid(4), server_round=2)
    assert resumed.num_clients == 5  # a lost node does not change N

    LEARNERS[name](num_clients=5).load_state_dict(state)  # agrees: fine
    with pytest.raises(ValueError, match="num-clients=5"):
        LEARNERS[name](num_clients=4).load_state_dict(state)
    # A checkpoint made before N was learned resumes into a strategy given N.
    LEARNERS[name](num_clients=4).load_state_dict(LEARNERS[name]().state_dict())


def test_a_whole_run_learns_num_clients_from_the_grid() -> None:
    def feddyn_reply(message: Message, context: Context) -> Message:
        if message.metadata.message_type.startswith("evaluate"):
            metrics = MetricRecord({"loss": 0.1, "num-examples": 10})
            return Message(RecordDict({"metrics": metrics}), reply_to=message)
        arrays = message.content["arrays"]
        trained = {k: v.numpy() + 1.0 for k, v in arrays.items()}
        metrics = {
            "train-loss": 0.5,
            "client-key": context.node_id,
            "feddyn-applied": 1,
        }
        return reply(message, trained, 10, metrics=metrics)

    strategy = FedDyn(alpha=0.5, fraction_train=0.5, min_available_nodes=4)
    result = strategy.start(
        grid=InProcessGrid(feddyn_reply, num_nodes=4),
        initial_arrays=record(model_arrays()),
        num_rounds=2,
    )
    assert strategy.num_clients == 4
    assert result.train_metrics_clientapp[2]["replies-valid"] == 2
    # N = 4 entered the update: theta <- mean_S theta_k + Lambda / N, where every
    # client adds 1 and Lambda sums the drifts (2 per round): +1.5, then +2.
    assert strategy.drift_sum is not None
    for value in strategy.drift_sum.values():
        np.testing.assert_allclose(value, 4.0, rtol=1e-6)
    for key, value in model_arrays().items():
        np.testing.assert_allclose(result.arrays[key].numpy(), value + 3.5, rtol=1e-6)


def test_config_record_type_is_unchanged_by_learning() -> None:
    strategy = Scaffold()
    messages = configure(strategy, model_arrays(), sampling_grid(3))
    assert all(isinstance(m.content["config"], ConfigRecord) for m in messages)

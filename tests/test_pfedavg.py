"""P-FedAvg: M inner strategies over groups of nodes, mixed over a server graph."""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytest

from flwr_prox_strategies import FedAvg, FedAvgClient, FedProx, PFedAvg, to_client_app
from flwr_prox_strategies.core.inprocess import InProcessGrid
from flwr_prox_strategies.ops.mixing import consensus_rate

from .lsq import LeastSquares

logging.getLogger("flwr").setLevel(logging.WARNING)

GD = {"learning_rate": 0.02, "local_epochs": 1}  # one full-batch step: plain GD


def inner_fedavg(**kwargs):
    return functools.partial(
        FedAvg,
        min_available_nodes=1,
        min_train_nodes=1,
        fraction_evaluate=0.0,
        weighting="uniform",
        **kwargs,
    )


def run(problem: LeastSquares, strategy, rounds: int, **client_kwargs):
    grid = InProcessGrid(
        to_client_app(problem.client_fn(FedAvgClient, **client_kwargs)),
        num_nodes=len(problem.a),
    )
    result = strategy.start(
        grid=grid, initial_arrays=problem.initial(), num_rounds=rounds
    )
    return result, grid


def test_nodes_are_assigned_by_partition_id_modulo_servers() -> None:
    problem = LeastSquares(num_clients=6)
    strategy = PFedAvg(servers=3, topology="ring", inner=inner_fedavg())
    run(problem, strategy, 1, **GD)
    assert strategy.groups is not None
    # InProcessGrid node i (id 1001 + i) holds partition i: groups {0,3}, {1,4}, {2,5}
    assert strategy.groups == [[1001, 1004], [1002, 1005], [1003, 1006]]


def test_complete_graph_with_uniform_weights_is_fedavg_over_all_clients() -> None:
    """W = 11^T/M and equal groups: every server ends each round on the mean of all
    clients' models, FedAvg's (uniform weights, full participation, same seeds).
    Equal to float rounding, not bit for bit: the sums are grouped differently."""
    problem = LeastSquares(num_clients=6)
    pfedavg = PFedAvg(
        servers=3, topology="complete", mixing="uniform", inner=inner_fedavg()
    )
    fedavg = FedAvg(min_available_nodes=6, fraction_evaluate=0.0, weighting="uniform")
    kwargs = {"learning_rate": 0.05, "local_epochs": 3}
    got, _ = run(problem, pfedavg, 5, **kwargs)
    want, _ = run(problem, fedavg, 5, **kwargs)
    np.testing.assert_allclose(
        got.arrays.to_numpy_ndarrays()[0], want.arrays.to_numpy_ndarrays()[0], rtol=1e-6
    )
    assert got.train_metrics_clientapp[5]["consensus-distance"] < 1e-10


def test_a_sparser_graph_reaches_consensus_and_the_optimum_more_slowly() -> None:
    """Least squares, one GD step per round: smaller rho(W), faster consensus and a
    consensus average nearer the minimiser after the same number of rounds."""
    problem = LeastSquares(num_clients=8)
    errors, distances, rates = {}, {}, {}
    for name, kwargs in {
        "complete": {"topology": "complete", "mixing": "uniform"},
        "ring-sdp": {"topology": "ring", "mixing": "sdp"},
        "ring": {"topology": "ring", "mixing": "metropolis"},
    }.items():
        strategy = PFedAvg(servers=8, inner=inner_fedavg(), **kwargs)
        result, _ = run(problem, strategy, 40, **GD)
        theta = result.arrays.to_numpy_ndarrays()[0][0]
        errors[name] = problem.relative_error(theta)
        distances[name] = result.train_metrics_clientapp[40]["consensus-distance"]
        rates[name] = consensus_rate(strategy.weights)
    assert rates["complete"] < rates["ring-sdp"] < rates["ring"]
    assert distances["complete"] < distances["ring-sdp"] < distances["ring"]
    assert errors["complete"] < errors["ring-sdp"] < errors["ring"]


def test_every_server_model_is_reported_and_evaluated() -> None:
    problem = LeastSquares(num_clients=4)
    strategy = PFedAvg(servers=2, topology="complete", inner=inner_fedavg())
    run(problem, strategy, 2, **GD)
    models = strategy.central_models()
    assert sorted(models) == ["server-0", "server-1"]


def test_any_inner_strategy_per_server() -> None:
    problem = LeastSquares(num_clients=4)
    strategy = PFedAvg(
        servers=2,
        topology="complete",
        inner=functools.partial(
            FedProx,
            mu=0.1,
            min_available_nodes=1,
            min_train_nodes=1,
            fraction_evaluate=0.0,
        ),
    )
    result, _ = run(problem, strategy, 3, **GD)
    assert result.train_metrics_clientapp[3]["replies-valid"] == 4
    assert all(isinstance(s, FedProx) for s in strategy.inner)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"servers": 0}, "servers"),
        ({"servers": 3, "topology": "moebius"}, "topology"),
        ({"servers": 3, "mixing": "magic"}, "mixing"),
        ({"servers": 4, "topology": "complete", "mixing": "metropolis"}, None),
        ({"servers": 2, "weights": [[0.5, 0.6], [0.5, 0.4]]}, "weights"),
        ({"servers": 4, "topology": "ring", "mixing": "uniform"}, "mixing"),
        ({"servers": 2, "assignment": {1: 5}}, "assignment"),
        ({"servers": 2, "inner": lambda: _SHARED}, "new strategy"),
    ],
)
def test_invalid_settings_are_rejected(kwargs, match) -> None:
    if match is None:  # a valid setting, as a control
        assert PFedAvg(**kwargs).rho < 1
        return
    with pytest.raises(ValueError, match=match):
        PFedAvg(**kwargs)


_SHARED = FedAvg()


def test_merged_metrics_keep_maxima_minima_and_counts() -> None:
    from flwr.app import MetricRecord

    from flwr_prox_strategies.algorithms.pfedavg import merge_metrics

    merged = merge_metrics(
        [
            MetricRecord(
                {
                    "num-examples": 10,
                    "replies-valid": 2,
                    "loss": 1.0,
                    "dp-epsilon-total-max": 3.0,
                    "accuracy-worst": 0.5,
                }
            ),
            MetricRecord(
                {
                    "num-examples": 30,
                    "replies-valid": 3,
                    "loss": 2.0,
                    "dp-epsilon-total-max": 1.0,
                    "accuracy-worst": 0.2,
                }
            ),
        ]
    )
    assert merged["replies-valid"] == 5 and merged["num-examples"] == 40
    assert merged["loss"] == pytest.approx(1.75)
    assert merged["dp-epsilon-total-max"] == 3.0 and merged["accuracy-worst"] == 0.2

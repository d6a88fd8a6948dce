"""P-FedAvg: M inner strategies over groups of nodes, mixed over a server graph."""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytest

from flwr_prox_strategies import FedAvg, FedAvgClient, FedProx, PFedAvg, to_client_app
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
from flwr_prox_strategies.ops.graphs import adjacency
from flwr_prox_strategies.ops.mixing import (
    check_mixing,
    consensus_average,
    consensus_distance,
    consensus_model,
    consensus_rate,
    mix_models,
    mix_row,
    mixing_graph,
    mixing_matrix,
)

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


# ------------------------------------------- the server-side mixing, by hand

# A path 0 - 1 - 2 with dyadic weights, so every product below is exact.
PATH_W = np.array([[0.75, 0.25, 0.0], [0.25, 0.5, 0.25], [0.0, 0.25, 0.75]])


def path_models() -> list[dict[str, np.ndarray]]:
    return [
        {"w": np.array(w, dtype=np.float32), "steps": np.array([s])}
        for w, s in (([4, 0], 1), ([0, 8], 2), ([8, 4], 3))
    ]


def test_mix_models_by_hand() -> None:
    """x_0 = .75 (4, 0) + .25 (0, 8)            = (3, 2)
    x_1 = .25 (4, 0) + .5 (0, 8) + .25 (8, 4) = (1 + 2, 4 + 1) = (3, 5)
    x_2 =              .25 (0, 8) + .75 (8, 4) = (6, 2 + 3)     = (6, 5)
    Server 0 never reads server 2 (W_02 = 0); integer arrays are each server's own.
    """
    check_mixing(PATH_W, adjacency("grid", 3, rows=1))
    mixed = mix_models(PATH_W, path_models())
    for got, want, steps in zip(
        mixed, ([3, 2], [3, 5], [6, 5]), (1, 2, 3), strict=True
    ):
        assert got["w"].dtype == np.float32
        np.testing.assert_array_equal(got["w"], want)
        np.testing.assert_array_equal(got["steps"], [steps])


def test_mix_row_renormalises_over_the_models_at_hand_by_hand() -> None:
    """Server 1 of the path, W_1 = (.25, .5, .25), y = (4, 0), (0, 8), (8, 4).
    All at hand: x_1 = (3, 5) as mix_models, weight 1. Server 2 lost: weights
    (.25, .5) / .75 = (1/3, 2/3): x_1 = (4/3, 0) + (0, 16/3) = (4/3, 16/3).
    Only itself: x_1 = y_1. Server 0 never needs server 2 (W_02 = 0)."""
    y = dict(enumerate(path_models()))
    mixed, weight = mix_row(PATH_W[1], 1, y)
    assert weight == 1.0
    np.testing.assert_array_equal(mixed["w"], mix_models(PATH_W, path_models())[1]["w"])
    mixed, weight = mix_row(PATH_W[1], 1, {0: y[0], 1: y[1]})
    assert weight == pytest.approx(0.75)
    np.testing.assert_allclose(mixed["w"], [4 / 3, 16 / 3], rtol=1e-6)
    assert mixed["w"].dtype == np.float32 and mixed["steps"] is y[1]["steps"]
    mixed, weight = mix_row(PATH_W[1], 1, {1: y[1]})
    assert weight == pytest.approx(0.5)
    np.testing.assert_array_equal(mixed["w"], y[1]["w"])
    mixed, weight = mix_row(PATH_W[0], 0, {0: y[0], 1: y[1]})  # 2 is no neighbour
    assert weight == 1.0
    np.testing.assert_array_equal(mixed["w"], [3, 2])
    with pytest.raises(ValueError, match=r"model 1 .* is missing"):
        mix_row(PATH_W[1], 1, {0: y[0]})


def test_consensus_average_model_and_distance_by_hand() -> None:
    """Mixed models (3, 2), (3, 5), (6, 5): mean (4, 4); squared distances to it
    (1 + 4) + (1 + 1) + (4 + 1) = 12; before mixing, (4, 0), (0, 8), (8, 4) have the
    same mean (4, 4) and distance (0 + 16) + (16 + 16) + (16 + 0) = 64."""
    before = path_models()
    after = mix_models(PATH_W, before)
    for models, distance in ((before, 64.0), (after, 12.0)):
        average = consensus_average(models)
        assert list(average) == ["w"] and average["w"].dtype == np.float64
        np.testing.assert_array_equal(average["w"], [4.0, 4.0])
        assert consensus_distance(models) == consensus_distance(models, average)
        assert consensus_distance(models) == distance
    model = consensus_model(after)
    assert model["w"].dtype == np.float32 and model["steps"] is after[0]["steps"]
    np.testing.assert_array_equal(model["w"], [4.0, 4.0])


MIXINGS_TO_CHECK = [
    ("ring", {}, "metropolis"),
    ("star", {}, "max-degree"),
    ("torus", {}, "metropolis"),
    ("random-regular", {"degree": 3}, "metropolis"),
]


@pytest.mark.parametrize(("kind", "params", "method"), MIXINGS_TO_CHECK)
def test_consensus_is_a_fixed_point(kind, params, method) -> None:
    weights = mixing_matrix(adjacency(kind, 8, **params), method)
    rng = np.random.default_rng(0)
    same = {"a": rng.normal(size=(3, 2)), "b": rng.normal(size=4).astype(np.float32)}
    mixed = mix_models(weights, [same] * 8)
    for model in mixed:
        for key, value in same.items():
            # Rows sum to one up to rounding: unchanged to a few ulps.
            np.testing.assert_allclose(model[key], value, rtol=1e-6, atol=1e-12)
    assert consensus_distance(mixed) < 1e-20


@pytest.mark.parametrize(("kind", "params", "method"), MIXINGS_TO_CHECK)
def test_the_mean_is_kept_and_the_disagreement_shrinks_by_rho_squared(
    kind, params, method
) -> None:
    weights = mixing_matrix(adjacency(kind, 8, **params), method)
    rng = np.random.default_rng(1)
    models = [{"a": rng.normal(size=(3, 2)) + 5 * i} for i in range(8)]
    mixed = mix_models(weights, models)
    np.testing.assert_allclose(
        consensus_average(mixed)["a"], consensus_average(models)["a"], atol=1e-12
    )
    rho = consensus_rate(weights)
    assert consensus_distance(mixed) <= rho**2 * consensus_distance(models) + 1e-12


def test_mixing_graph_is_the_support_off_the_diagonal() -> None:
    np.testing.assert_array_equal(
        mixing_graph(PATH_W), [[0, 1, 0], [1, 0, 1], [0, 1, 0]]
    )


def test_mix_models_rejects_what_would_broadcast() -> None:
    models = path_models()
    with pytest.raises(ValueError, match=r"mixing is \(2, 2\) for 3 models"):
        mix_models(np.eye(2), models)
    models[1]["w"] = np.zeros(1, dtype=np.float32)
    with pytest.raises(ValueError, match="model 1 has 'w' of shape"):
        mix_models(PATH_W, models)
    del models[1]["w"]
    with pytest.raises(ValueError, match="model 1 has 'w' missing"):
        mix_models(PATH_W, models)

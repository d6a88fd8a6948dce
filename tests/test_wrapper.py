"""One ``start()`` for the pack; a wrapper forwards what it does not change.

Every strategy of the pack runs Flower's loop through
``RunLifecycle.start``; secure aggregation, central DP, tracking and
P-FedAvg's servers say only what their run needs before and after it. The
wrappers compose in the documented orders, and a failure names each wrapper
around the strategy.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

import flwr_prox_strategies
from flwr_prox_strategies import (
    FedAvg,
    FedAvgClient,
    NoRoundAggregatedError,
    SecAggPlus,
    SecAggPlusMod,
    ServerSideFixedClipping,
    to_client_app,
)
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
from flwr_prox_strategies.core.wrapper import RunLifecycle, StrategyWrapper
from flwr_prox_strategies.testing.federation import LeastSquares
from flwr_prox_strategies.tracking import Tracked

from .test_tracking import Recording

NODES = 4
CLIENT = {"learning_rate": 0.05, "local_epochs": 2}


def fedavg() -> FedAvg:
    return FedAvg(
        min_train_nodes=NODES, min_available_nodes=NODES, fraction_evaluate=0.0
    )


def federation(*, fail: bool = False) -> tuple[LeastSquares, InProcessGrid]:
    problem = LeastSquares(num_clients=NODES, dim=5)
    client_fn = problem.client_fn(FedAvgClient, **CLIENT)

    def broken(context):
        raise RuntimeError("cannot load my data")

    app = to_client_app(broken if fail else client_fn, mods=[SecAggPlusMod()])
    return problem, InProcessGrid(app, num_nodes=NODES)


def model(result) -> np.ndarray:
    return result.arrays.to_numpy_ndarrays()[0]


def test_the_pack_has_one_start():
    """No class of the package re-spells Flower's ``start``: only the lifecycle."""
    package = Path(flwr_prox_strategies.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "start":
                        names = [a.arg for a in item.args.args]
                        if "grid" in names and "initial_arrays" in names:
                            found.append(f"{path.relative_to(package)}:{node.name}")
    assert found == ["core/wrapper.py:RunLifecycle"]


def test_a_wrapper_that_changes_nothing_runs_as_the_strategy():
    class Nothing(StrategyWrapper):
        pass

    problem, grid = federation()
    bare = fedavg().start(grid=grid, initial_arrays=problem.initial(), num_rounds=2)
    inner = fedavg()
    wrapped = Nothing(inner)
    problem, grid = federation()
    result = wrapped.start(grid=grid, initial_arrays=problem.initial(), num_rounds=2)
    np.testing.assert_array_equal(model(result), model(bare))
    # Every attribute the wrapper lacks is the strategy's.
    assert wrapped.run_tally is inner.run_tally
    assert wrapped.run_tally.aggregated == 2
    assert wrapped.state_dict().keys() == inner.state_dict().keys()
    with pytest.raises(AttributeError):
        _ = wrapped.no_such_attribute


def composed(order: str, backend: Recording):
    inner = fedavg()
    if order == "tracked(secaggplus(fedavg))":
        return inner, Tracked(
            SecAggPlus(inner, clipping_range=64.0), backend, background=False
        )
    if order == "tracked(central-dp(fedavg))":
        dp = ServerSideFixedClipping(
            inner, noise_multiplier=0.0, clipping_norm=100.0, num_sampled_clients=4
        )
        return inner, Tracked(dp, backend, background=False)
    assert order == "tracked(tracked(fedavg))"
    return inner, Tracked(Tracked(inner, Recording(), background=False), backend)


ORDERS = [
    "tracked(secaggplus(fedavg))",
    "tracked(central-dp(fedavg))",
    "tracked(tracked(fedavg))",
]


@pytest.mark.parametrize("order", ORDERS)
def test_wrappers_compose(order):
    """Each composition runs the strategy's rounds, within its documented error
    of the plain run, and the outer tracker logs every round."""
    problem, grid = federation()
    plain = fedavg().start(grid=grid, initial_arrays=problem.initial(), num_rounds=2)
    backend = Recording()
    inner, strategy = composed(order, backend)
    problem, grid = federation()
    result = strategy.start(grid=grid, initial_arrays=problem.initial(), num_rounds=2)
    assert inner.run_tally.aggregated == 2
    # Secure aggregation's quantisation moves each round by at most its
    # reported bound; the others are exact up to float rounding.
    bound = sum(
        m.get("secagg-error-bound", 0.0)
        for m in result.train_metrics_clientapp.values()
    )
    assert np.abs(model(result) - model(plain)).max() <= bound + 1e-6
    steps = [payload[0] for kind, payload in backend.calls if kind == "metrics"]
    assert steps == [1, 2]
    if order.startswith("tracked(secaggplus"):
        logged = [p[1] for k, p in backend.calls if k == "metrics"]
        assert all(m["train/secagg-contributors"] == NODES for m in logged)


@pytest.mark.parametrize("order", ORDERS)
def test_a_failure_names_every_wrapper_and_marks_the_tracked_run_failed(order):
    backend = Recording()
    _, strategy = composed(order, backend)
    problem, grid = federation(fail=True)
    with pytest.raises(NoRoundAggregatedError) as info:
        strategy.start(grid=grid, initial_arrays=problem.initial(), num_rounds=2)
    expected = {
        "tracked(secaggplus(fedavg))": "Tracked(SecAggPlus(FedAvg))",
        "tracked(central-dp(fedavg))": "Tracked(ServerSideFixedClipping(FedAvg))",
        "tracked(tracked(fedavg))": "Tracked(Tracked(FedAvg))",
    }[order]
    assert str(info.value).startswith(f"{expected}: no round aggregated")
    assert backend.calls[-1] == ("close", True)


def test_the_run_is_closed_when_its_beginning_fails():
    """What ``begin_run`` opened is released even when it raised (P-FedAvg's
    server opens its exchange there)."""
    events = []

    class Opens(RunLifecycle, FlowerFedAvg):
        def begin_run(self, initial_arrays, num_rounds):
            events.append("begin")
            raise ConnectionError("neighbours unreachable")

        def close_run(self, failed):
            events.append(("close", failed))

    problem, grid = federation()
    with pytest.raises(ConnectionError):
        Opens().start(grid=grid, initial_arrays=problem.initial(), num_rounds=1)
    assert events == ["begin", ("close", True)]


def test_a_wrapper_of_flowers_own_strategy_runs_flowers_loop():
    """Flower's FedAvg has no run checks: the wrapper's start ends as Flower's."""
    backend = Recording()
    strategy = Tracked(FlowerFedAvg(fraction_evaluate=0.0), backend, background=False)
    problem, grid = federation()
    result = strategy.start(grid=grid, initial_arrays=problem.initial(), num_rounds=2)
    assert isinstance(result.arrays, ArrayRecord)
    assert strategy.run_name == "Tracked(FedAvg)"
    assert backend.calls[-1] == ("close", False)

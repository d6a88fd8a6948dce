"""Nodes come and go, and the stateful algorithms' sums stay right.

SCAFFOLD's server keeps c = (1/N) sum_i c_i and FedDyn's keeps
Lambda = sum_k lambda_k over *all* clients. After a node is lost, restarted
with empty state, replaced by one holding a stale state, or joined by a new
client, the server's sums must still equal the sums of what the clients hold
(plus the retired states the server announced), and N must count them.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, RecordDict

from flwr_prox_strategies import FedDyn, FedDynClient, Scaffold, ScaffoldClient
from flwr_prox_strategies.algorithms.feddyn import DRIFT_STATE
from flwr_prox_strategies.algorithms.scaffold import CONTROL_STATE
from flwr_prox_strategies.core.client.state import ClientState
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid

from .helpers import logged, node_context
from .lsq import LeastSquares

LOCAL = {"local_epochs": 3, "learning_rate": 0.1}


@pytest.fixture
def problem() -> LeastSquares:
    return LeastSquares(num_clients=5)


def held(strategy, context: Context, name: str) -> np.ndarray:
    """What a client holds once the server's last confirmation reaches it."""
    key = int(context.node_config["partition-id"])
    state = ClientState(context)
    state.resolve(strategy.book.accepted.get(key, -1))  # the two-phase commit
    saved = state.get(name)
    return np.zeros(5) if saved is None else np.ravel(saved[0])


def grid_of(problem: LeastSquares, client_cls, nodes: int = 4) -> InProcessGrid:
    from flwr_prox_strategies import to_client_app

    app = to_client_app(problem.client_fn(client_cls, **LOCAL))
    return InProcessGrid(app, num_nodes=nodes)


def add_node(grid: InProcessGrid, node_id: int, partition: int) -> Context:
    context = node_context(node_id, partition, 5)
    grid.contexts[node_id] = context
    return context


def run_rounds(strategy, grid, arrays, rounds: int):
    strategy.round_offset = strategy.rounds_completed  # continue the numbering
    return strategy.start(grid=grid, initial_arrays=arrays, num_rounds=rounds).arrays


def scaffold_sum(strategy: Scaffold) -> np.ndarray:
    assert strategy.control is not None
    return strategy.num_clients * np.ravel(next(iter(strategy.control.values())))


def assert_c_sums_the_clients(strategy: Scaffold, contexts, retired=None) -> None:
    """The server's c times N is the sum of the c_i the contexts hold (+ retired)."""
    total = sum(held(strategy, c, CONTROL_STATE) for c in contexts)
    if retired is not None:
        total = total + retired
    np.testing.assert_allclose(scaffold_sum(strategy), total, rtol=1e-5, atol=1e-6)


def scaffold(**kwargs) -> Scaffold:
    return Scaffold(num_clients=4, fraction_evaluate=0.0, min_round_nodes=1, **kwargs)


def test_lost_node_the_run_goes_on_and_k_stays(problem):
    grid = grid_of(problem, ScaffoldClient)
    strategy = scaffold()
    arrays = run_rounds(strategy, grid, problem.initial(), 2)
    lost = grid.contexts.pop(1002)  # SIGKILLed: never comes back
    arrays = run_rounds(strategy, grid, arrays, 2)
    assert strategy.num_clients == 4
    assert_c_sums_the_clients(strategy, [*grid.contexts.values(), lost])


def test_restarted_node_without_state_is_retired_and_counted(problem, caplog):
    grid = grid_of(problem, ScaffoldClient)
    strategy = scaffold()
    arrays = run_rounds(strategy, grid, problem.initial(), 3)
    old = grid.contexts.pop(1002)
    retired = held(strategy, old, CONTROL_STATE)
    assert np.abs(retired).sum() > 0
    add_node(grid, 2002, partition=1)  # same client, new node id, empty state
    with caplog.at_level(logging.WARNING, logger="flwr"):
        run_rounds(strategy, grid, arrays, 3)
    assert strategy.book.retired_states == 1 and strategy.num_clients == 5
    assert logged(caplog, "client 1 (node 2002) holds no state")
    assert_c_sums_the_clients(strategy, grid.contexts.values(), retired)


def test_another_runs_state_is_ignored_and_retired(problem, caplog):
    grid = grid_of(problem, ScaffoldClient)
    strategy = scaffold()
    arrays = run_rounds(strategy, grid, problem.initial(), 3)
    # Node 1003 comes back holding the state of another run (a stale state_dir):
    # the client ignores it (the run tags differ), so the server sees lost state.
    other = grid_of(problem, ScaffoldClient)
    run_rounds(scaffold(), other, problem.initial(), 2)
    retired = held(strategy, grid.contexts[1003], CONTROL_STATE)
    grid.contexts[1003].state = other.contexts[1003].state
    with caplog.at_level(logging.WARNING, logger="flwr"):
        run_rounds(strategy, grid, arrays, 3)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert f"belongs to run {strategy.book.run_tag}" not in text
    assert f"not to this run ({strategy.book.run_tag}); ignored" in text
    assert "client 2 (node 1003) holds no state" in text
    assert not strategy.rejections.get("aggregate_train:stale-state")
    assert strategy.book.retired_states == 1 and strategy.num_clients == 5
    assert_c_sums_the_clients(strategy, grid.contexts.values(), retired)


def test_stale_state_is_refused_reset_and_retired(problem, caplog):
    grid = grid_of(problem, ScaffoldClient)
    strategy = scaffold()
    arrays = run_rounds(strategy, grid, problem.initial(), 2)
    # Node 1003 later comes back holding this run's state of round 1 (a copy
    # restored from an old backup, taken when round 1 was its committed state
    # and round 2's pending): same run tag, wrong round.
    old = RecordDict()
    for name, record in grid.contexts[1003].state.array_records.items():
        old[name] = ArrayRecord({k: Array(v.numpy().copy()) for k, v in record.items()})
    arrays = run_rounds(strategy, grid, arrays, 1)
    retired = held(strategy, grid.contexts[1003], CONTROL_STATE)
    grid.contexts[1003].state = old
    with caplog.at_level(logging.WARNING, logger="flwr"):
        run_rounds(strategy, grid, arrays, 3)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "client 2 (node 1003) holds the state of round 1" in text
    assert strategy.rejections["aggregate_train:stale-state"] == 1
    assert strategy.book.retired_states == 1 and strategy.num_clients == 5
    assert not strategy.book.reset_keys  # the client started afresh and was accepted
    assert_c_sums_the_clients(strategy, grid.contexts.values(), retired)


def test_a_joining_node_grows_k_and_keeps_c_a_mean(problem):
    grid = grid_of(problem, ScaffoldClient)
    strategy = scaffold()
    arrays = run_rounds(strategy, grid, problem.initial(), 2)
    add_node(grid, 2005, partition=4)
    run_rounds(strategy, grid, arrays, 2)
    assert strategy.num_clients == 5
    assert_c_sums_the_clients(strategy, grid.contexts.values())


def test_feddyn_drift_sum_survives_a_restart(problem):
    grid = grid_of(problem, FedDynClient)
    strategy = FedDyn(
        alpha=0.3, num_clients=4, fraction_evaluate=0.0, min_round_nodes=1
    )
    arrays = run_rounds(strategy, grid, problem.initial(), 3)
    retired = held(strategy, grid.contexts.pop(1004), DRIFT_STATE)
    add_node(grid, 2004, partition=3)
    run_rounds(strategy, grid, arrays, 3)
    assert strategy.num_clients == 5
    assert strategy.drift_sum is not None
    total = sum(held(strategy, c, DRIFT_STATE) for c in grid.contexts.values())
    np.testing.assert_allclose(
        np.ravel(next(iter(strategy.drift_sum.values()))),
        total + retired,
        rtol=1e-5,
        atol=1e-5,
    )


def test_churn_state_survives_a_checkpoint(problem):
    grid = grid_of(problem, ScaffoldClient)
    strategy = scaffold()
    arrays = run_rounds(strategy, grid, problem.initial(), 2)
    grid.contexts.pop(1002)
    add_node(grid, 2002, partition=1)
    run_rounds(strategy, grid, arrays, 1)
    again = Scaffold(num_clients=4, fraction_evaluate=0.0, min_round_nodes=1)
    again.load_state_dict(strategy.state_dict())
    assert (again.num_clients, again.book.retired_states) == (5, 1)
    assert again.book.client_keys_seen == strategy.book.client_keys_seen


def test_a_dead_runs_state_dir_is_ignored_and_a_resume_keeps_it(
    problem, tmp_path, caplog
):
    def grid_with_files() -> InProcessGrid:
        from flwr_prox_strategies import to_client_app

        client_fn = problem.client_fn(ScaffoldClient, state_dir=str(tmp_path), **LOCAL)
        return InProcessGrid(to_client_app(client_fn), num_nodes=4)

    dead = scaffold()
    run_rounds(dead, grid_with_files(), problem.initial(), 3)
    assert sorted(p.name for p in tmp_path.glob("*.npz")) == [
        f"{k}.npz" for k in range(4)
    ]
    # A new run on the same folder (new SuperNodes: empty context.state).
    rerun, grid = scaffold(), grid_with_files()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        arrays = run_rounds(rerun, grid, problem.initial(), 2)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert text.count(f"belongs to run {dead.book.run_tag}, not to this run") == 4
    assert str(tmp_path / "0.npz") in text
    # Nothing of the dead run reached the sums: the clients started from zero.
    assert rerun.book.retired_states == 0 and not rerun.rejections
    fresh = scaffold()
    fresh_arrays = run_rounds(
        fresh, grid_of(problem, ScaffoldClient), problem.initial(), 2
    )
    np.testing.assert_array_equal(scaffold_sum(rerun), scaffold_sum(fresh))
    np.testing.assert_array_equal(
        arrays.to_numpy_ndarrays()[0], fresh_arrays.to_numpy_ndarrays()[0]
    )
    # A resume of the rerun keeps its tag: the files are read back, no warning.
    resumed = scaffold()
    resumed.load_state_dict(rerun.state_dict())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        run_rounds(resumed, grid_with_files(), arrays, 1)
    assert "belongs to run" not in caplog.text
    assert resumed.book.retired_states == 0 and not resumed.rejections

"""Client state kept on disk only (``client_state=disk``): the same rounds, no memory.

A simulation holds every node's ``context.state`` in its process; with the
state in ``<state_dir>/<client>.npz`` only, it holds none. These tests check
that nothing else changes: the same models, the same state in the files as in
memory (committed, pending, run tag, privacy ledger), a failed call keeping
what it did as ``context.state`` would, and the configuration refusing a disk
it cannot name.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Context, Message, RecordDict
from omegaconf import OmegaConf

from flwr_prox_strategies import DPSGD, to_client_app
from flwr_prox_strategies.algorithms.clients.fedavg import FedAvgClient
from flwr_prox_strategies.algorithms.clients.feddc import FedDCClient
from flwr_prox_strategies.algorithms.clients.feddyn import FedDynClient
from flwr_prox_strategies.algorithms.clients.scaffold import (
    ScaffoldClient,
    ScaffoldRule,
)
from flwr_prox_strategies.algorithms.fedavg import FedAvg
from flwr_prox_strategies.algorithms.feddc import FedDC
from flwr_prox_strategies.algorithms.feddyn import FedDyn
from flwr_prox_strategies.algorithms.scaffold import Scaffold
from flwr_prox_strategies.core.client.state import ClientState
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
from flwr_prox_strategies.experiment.checkpoint import (
    checkpointing,
    client_state_on_disk,
)

from .lsq import LeastSquares, half_sse

LOCAL = {"local_epochs": 3, "learning_rate": 0.1, "seed": 0}
DP = DPSGD(noise_multiplier=1.0, clipping_norm=1.0, poisson_sampling=False)
# name -> (strategy, client class, client options)
CASES: dict[str, tuple[Any, type, dict[str, Any]]] = {
    "feddyn": (
        lambda: FedDyn(alpha=0.5, num_clients=4, fraction_train=0.5, seed=1),
        FedDynClient,
        {},
    ),
    "scaffold": (
        lambda: Scaffold(num_clients=4, fraction_train=0.5, seed=1),
        ScaffoldClient,
        {},
    ),
    "feddc": (
        lambda: FedDC(alpha=0.1, num_clients=4, fraction_train=0.5, seed=1),
        FedDCClient,
        {},
    ),
    # DP-SGD's privacy ledger lives in the same state, outside the commit.
    "fedavg+dp-sgd": (
        lambda: FedAvg(fraction_train=0.5, min_available_nodes=4),
        FedAvgClient,
        {"dp": DP},
    ),
}


@pytest.fixture(scope="module")
def problem() -> LeastSquares:
    return LeastSquares()


def grid_of(problem: LeastSquares, case: str, state_dir: Path, *, in_memory: bool):
    _, client_cls, options = CASES[case]
    client_fn = problem.client_fn(
        client_cls,
        state_dir=str(state_dir),
        state_in_memory=in_memory,
        **LOCAL,
        **options,
    )
    return InProcessGrid(to_client_app(client_fn), num_nodes=4)


def held(records: RecordDict) -> dict[str, list[bytes]]:
    """Every array record, as bytes: what a client holds (each run's tag is its own)."""
    return {
        name: [array.numpy().tobytes() for array in record.values()]
        for name, record in records.array_records.items()
        if name != "run-tag"
    }


def on_disk(state_dir: Path, key: int) -> dict[str, list[bytes]]:
    state = ClientState(None, state_dir=str(state_dir), client_key=str(key))
    return held(state.records)


@pytest.mark.parametrize("case", sorted(CASES))
def test_rounds_with_the_state_on_disk_equal_rounds_in_memory(
    problem: LeastSquares, tmp_path: Path, case: str
) -> None:
    make = CASES[case][0]
    memory_grid = grid_of(problem, case, tmp_path / "mirror", in_memory=True)
    disk_grid = grid_of(problem, case, tmp_path / "disk", in_memory=False)
    memory = make().start(
        grid=memory_grid, initial_arrays=problem.initial(), num_rounds=6
    )
    disk = make().start(grid=disk_grid, initial_arrays=problem.initial(), num_rounds=6)
    for a, b in zip(
        memory.arrays.to_numpy_ndarrays(), disk.arrays.to_numpy_ndarrays(), strict=True
    ):
        assert a.tobytes() == b.tobytes()
    # The nodes' contexts hold none of the state; the files hold all of it,
    # exactly what the in-memory nodes hold (the last round's pending included).
    assert all(not c.state.array_records for c in disk_grid.contexts.values())
    trained = 0
    for context in memory_grid.contexts.values():
        key = int(context.node_config["partition-id"])
        if context.state.array_records:
            trained += 1
            assert on_disk(tmp_path / "disk", key) == held(context.state)
    assert trained >= 3  # 6 rounds of 2 clients out of 4
    if case == "fedavg+dp-sgd":  # every trained client's ledger is in its file
        files = sorted((tmp_path / "disk").glob("*.npz"))
        assert len(files) >= 3
        for path in files:
            ledger = on_disk(tmp_path / "disk", int(path.stem))
            assert {"dp-accountant-history", "scalar:dp-sgd-epsilon"} <= set(ledger)


def assert_round_one_committed_on_disk_as_in_memory(
    grids: dict[str, InProcessGrid], disk: Path
) -> None:
    """Partition 0 failed in round 2 after its rule committed round 1's state.

    In memory, ``context.state`` keeps that commit; on disk, the file must hold
    exactly the same records.
    """
    memory = next(
        c
        for c in grids["memory"].contexts.values()
        if int(c.node_config["partition-id"]) == 0
    )
    assert memory.state.array_records["scalar:committed-round"]["0"].numpy() == 1.0
    assert not any(n.startswith("pending:") for n in memory.state.array_records)
    assert on_disk(disk, 0) == held(memory.state)


class FailsInRoundTwo(ScaffoldClient):
    """Partition 0 fails in round 2 after training (its commit of round 1 done)."""

    def after_training(self, config, report):  # type: ignore[no-untyped-def]
        if self.server_round == 2 and self.client_key == 0:
            raise RuntimeError("the node crashed before its reply")
        return super().after_training(config, report)


def test_a_call_that_fails_keeps_on_disk_what_it_did_as_memory_would(
    problem: LeastSquares, tmp_path: Path
) -> None:
    grids = {}
    for name, in_memory in (("memory", True), ("disk", False)):
        client_fn = problem.client_fn(
            FailsInRoundTwo,
            state_dir=str(tmp_path / name),
            state_in_memory=in_memory,
            **LOCAL,
        )
        grids[name] = InProcessGrid(to_client_app(client_fn), num_nodes=2)
        strategy = Scaffold(num_clients=2, min_round_nodes=1, seed=1)
        strategy.start(grid=grids[name], initial_arrays=problem.initial(), num_rounds=2)
        assert strategy.book.accepted[0] == 1  # round 2's reply was an error
    assert_round_one_committed_on_disk_as_in_memory(grids, tmp_path / "disk")


def rule_loop_app(
    problem: LeastSquares, state_dir: Path, *, in_memory: bool, fail_round: int = 0
):
    """A user's Message-API loop on SCAFFOLD's rule; partition 0 may raise mid-round."""

    def app(message: Message, context: Context) -> Message:
        k = int(context.node_config["partition-id"])
        model = torch.nn.Linear(problem.dim, 1, bias=False)
        rule = ScaffoldRule.from_message(
            message,
            context,
            model,
            state_dir=str(state_dir),
            state_in_memory=in_memory,
        )
        if rule.server_round == fail_round and k == 0:
            raise RuntimeError("the node crashed before its reply")
        optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(3):
            for x, y in problem.loader(k):
                optimizer.zero_grad()
                half_sse(model(x), y).backward()
                optimizer.step()
        return rule.reply(num_examples=len(problem.a[k]))

    return app


def test_a_rule_in_ones_own_loop_keeps_its_state_on_disk_only(
    problem: LeastSquares, tmp_path: Path
) -> None:
    grids, results = {}, {}
    for name, in_memory in (("memory", True), ("disk", False)):
        app = rule_loop_app(problem, tmp_path / name, in_memory=in_memory)
        grids[name] = InProcessGrid(app, num_nodes=4)
        strategy = Scaffold(
            num_clients=4, fraction_train=0.5, fraction_evaluate=0.0, seed=1
        )
        results[name] = strategy.start(
            grid=grids[name], initial_arrays=problem.initial(), num_rounds=6
        )
        assert not strategy.rejections
    for a, b in zip(
        results["memory"].arrays.to_numpy_ndarrays(),
        results["disk"].arrays.to_numpy_ndarrays(),
        strict=True,
    ):
        assert a.tobytes() == b.tobytes()
    assert all(not c.state.array_records for c in grids["disk"].contexts.values())
    trained = [c for c in grids["memory"].contexts.values() if c.state.array_records]
    assert len(trained) >= 3
    for context in trained:
        key = int(context.node_config["partition-id"])
        assert on_disk(tmp_path / "disk", key) == held(context.state)


def test_a_loop_that_raises_after_from_message_keeps_on_disk_what_memory_would(
    problem: LeastSquares, tmp_path: Path
) -> None:
    grids = {}
    for name, in_memory in (("memory", True), ("disk", False)):
        app = rule_loop_app(problem, tmp_path / name, in_memory=in_memory, fail_round=2)
        grids[name] = InProcessGrid(app, num_nodes=2)
        strategy = Scaffold(
            num_clients=2, min_round_nodes=1, fraction_evaluate=0.0, seed=1
        )
        strategy.start(grid=grids[name], initial_arrays=problem.initial(), num_rounds=2)
        assert strategy.book.accepted[0] == 1  # round 2's reply was an error
    assert_round_one_committed_on_disk_as_in_memory(grids, tmp_path / "disk")


def test_a_rule_with_its_state_on_disk_only_needs_a_folder() -> None:
    with pytest.raises(ValueError, match=r"state_in_memory=False .* needs a state_dir"):
        ScaffoldRule.from_message(
            Message(RecordDict(), dst_node_id=1, message_type="train"),
            Context(1, 1, {}, RecordDict(), {}),
            torch.nn.Linear(2, 1),
            state_in_memory=False,
        )


def committed_control(state_dir: Path, key: int, strategy: Scaffold) -> np.ndarray:
    """Client ``key``'s c_i as the server counts it (its file, resolved)."""
    state = ClientState(None, state_dir=str(state_dir), client_key=str(key))
    state.resolve(strategy.book.accepted.get(key, -1))
    control = state.get("scaffold-control")
    return np.zeros(0) if control is None else np.ravel(control[0])


def test_a_lost_state_file_is_a_client_restarted_and_the_sums_stay_true(
    problem: LeastSquares, tmp_path: Path
) -> None:
    client_fn = problem.client_fn(
        ScaffoldClient, state_dir=str(tmp_path), state_in_memory=False, **LOCAL
    )
    grid = InProcessGrid(to_client_app(client_fn), num_nodes=4)
    strategy = Scaffold(num_clients=4, fraction_evaluate=0.0, min_round_nodes=1)
    arrays = strategy.start(
        grid=grid, initial_arrays=problem.initial(), num_rounds=2
    ).arrays
    lost = committed_control(tmp_path, 1, strategy)
    (tmp_path / "1.npz").unlink()  # the node's disk is wiped between rounds
    strategy.round_offset = strategy.rounds_completed
    strategy.start(grid=grid, initial_arrays=arrays, num_rounds=2)
    # The client came back with no state: its last c_i stays in the server's
    # sum (retired), it goes on from zero as a new client, N grows by one.
    assert strategy.book.retired_states == 1 and strategy.num_clients == 5
    assert not strategy.rejections
    held_now = sum(committed_control(tmp_path, k, strategy) for k in range(4))
    assert strategy.control is not None
    server = strategy.num_clients * np.ravel(next(iter(strategy.control.values())))
    np.testing.assert_allclose(server, held_now + lost, rtol=1e-5, atol=1e-6)


def test_a_call_that_changes_nothing_writes_nothing(tmp_path: Path) -> None:
    context = Context(
        run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={}
    )
    state = ClientState(context, state_dir=str(tmp_path), in_memory=False)
    state.set_pending("h", [np.ones(3)], 1)
    state.close()
    path = tmp_path / "client.npz"
    written = path.stat().st_mtime_ns
    reader = ClientState(context, state_dir=str(tmp_path), in_memory=False)
    assert reader.resolve(None) == "committed"
    np.testing.assert_array_equal(reader.get("h")[0], np.ones(3))  # type: ignore[index]
    untouched = ClientState(context, state_dir=str(tmp_path), in_memory=False)
    assert untouched.get("h") is None  # the commit above was never written
    untouched.close()
    assert path.stat().st_mtime_ns == written
    reader.close()
    assert ClientState(context, state_dir=str(tmp_path), in_memory=False).get("h")
    assert not context.state.array_records


def _disk_state(folder: Path) -> ClientState:
    """A state on disk holding a committed and a pending record of two arrays."""
    state = ClientState(None, state_dir=str(folder), in_memory=False)
    state.set("h", [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4)])
    state.set_pending("h", [np.full((2, 3), 2, np.float32), np.zeros(4)], 3)
    state.close()
    return state


def _arrays(state: ClientState) -> dict[str, list[np.ndarray]]:
    return {name: state.get(name) or [] for name in state.records.array_records}


def test_the_state_file_is_numpys_npz_and_reads_back_byte_for_byte(
    tmp_path: Path,
) -> None:
    written = _disk_state(tmp_path)
    path = tmp_path / "client.npz"
    with np.load(path) as data:  # users can open it with numpy
        assert sorted(data.files) == sorted(
            f"{name}\x1f{key}"
            for name, record in written.records.array_records.items()
            for key in record
        )
        np.testing.assert_array_equal(data["h\x1f0"], np.arange(6).reshape(2, 3))
    read = ClientState(None, state_dir=str(tmp_path), in_memory=False)
    for name, record in written.records.array_records.items():
        assert list(read.records[name].keys()) == list(record.keys())
        assert all(read.records[name][k].data == a.data for k, a in record.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["client.npz"]


def test_a_state_file_numpy_wrote_reads_the_same(tmp_path: Path) -> None:
    """Files of earlier versions (``np.savez`` of every array) resume as they were."""
    written = _disk_state(tmp_path / "pack")
    payload = {
        f"{name}\x1f{key}": array.numpy()
        for name, record in written.records.array_records.items()
        for key, array in record.items()
    }
    (tmp_path / "numpy").mkdir()
    np.savez(tmp_path / "numpy" / "client.npz", **payload)  # type: ignore[arg-type]
    read = ClientState(None, state_dir=str(tmp_path / "numpy"), in_memory=False)
    assert read.records.array_records.keys() == written.records.array_records.keys()
    for name, arrays in _arrays(written).items():
        for ours, theirs in zip(_arrays(read)[name], arrays, strict=True):
            assert ours.dtype == theirs.dtype
            np.testing.assert_array_equal(ours, theirs)


def test_a_write_cut_short_leaves_the_state_before_it(tmp_path: Path) -> None:
    """A crash between the write's two moves: ``<stem>.old.npz`` is read, then replaced.

    The call that crashed never replied, so the state before it is the one
    the server's sums count; a leftover ``.tmp.npz`` is never read.
    """
    before = _arrays(_disk_state(tmp_path))
    path = tmp_path / "client.npz"
    path.replace(tmp_path / "client.old.npz")  # the first move done, not the second
    (tmp_path / "client.tmp.npz").write_bytes(b"half a zip")
    state = ClientState(None, state_dir=str(tmp_path), in_memory=False)
    assert set(_arrays(state)) == set(before)
    for name, arrays in before.items():
        for ours, theirs in zip(_arrays(state)[name], arrays, strict=True):
            np.testing.assert_array_equal(ours, theirs)
    assert state.resolve(None) == "committed"
    state.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["client.npz"]
    again = ClientState(None, state_dir=str(tmp_path), in_memory=False)
    np.testing.assert_array_equal(again.get("h")[0], np.full((2, 3), 2))  # type: ignore[index]


def test_a_corrupt_state_file_is_refused_not_read(tmp_path: Path) -> None:
    _disk_state(tmp_path)
    path = tmp_path / "client.npz"
    data = bytearray(path.read_bytes())
    # the last float of the first array: the zip still parses, its CRC fails
    at = data.index(np.arange(6, dtype=np.float32).tobytes()) + 20
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(zipfile.BadZipFile, match="bad CRC"):
        ClientState(None, state_dir=str(tmp_path), in_memory=False)
    path.write_bytes(b"not a zip at all")
    with pytest.raises(zipfile.BadZipFile):
        ClientState(None, state_dir=str(tmp_path), in_memory=False)


def test_a_state_file_claiming_more_than_it_holds_is_refused(tmp_path: Path) -> None:
    """A member whose declared size overruns the file is refused before it is read."""
    _disk_state(tmp_path)
    path = tmp_path / "client.npz"
    data = bytearray(path.read_bytes())
    directory = data.index(b"PK\x01\x02")  # the first central directory entry
    # its uncompressed size (bytes 24-27), and compressed size (20-23), to 2 GB
    data[directory + 20 : directory + 28] = (2**31 - 1).to_bytes(4, "little") * 2
    path.write_bytes(bytes(data))
    with pytest.raises(zipfile.BadZipFile, match="overruns"):
        ClientState(None, state_dir=str(tmp_path), in_memory=False)


def test_a_state_file_holding_objects_is_refused(tmp_path: Path) -> None:
    archive = zipfile.ZipFile(tmp_path / "client.npz", "w")
    with archive, archive.open("h\x1f0.npy", "w") as member:
        np.save(member, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="allow_pickle"):
        ClientState(None, state_dir=str(tmp_path), in_memory=False)


def test_the_state_on_disk_needs_a_folder(problem: LeastSquares, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"in_memory=False .* needs a state_dir"):
        ClientState(None, in_memory=False)
    with pytest.raises(ValueError, match=r"state_in_memory=False .* needs a state_dir"):
        ScaffoldClient(problem.model(), problem.loader(0), state_in_memory=False)
    with pytest.raises(ValueError, match="client_state must be one of memory, disk"):
        client_state_on_disk(OmegaConf.create({"client_state": "tape"}))
    cfg = OmegaConf.create({"client_state": "disk", "checkpoint_every": 0})
    with pytest.raises(ValueError, match=r"client_state=disk .* give the run config"):
        checkpointing(cfg, Scaffold(num_clients=2), {}, lambda: tmp_path / "run")


def test_the_app_runs_with_its_clients_state_on_disk(tmp_path: Path) -> None:
    from flwr_prox_strategies.experiment.sweeps.sweep import run_inprocess

    common = [
        "strategy=feddc",
        "num_clients=3",
        "num_rounds=3",
        "model=logreg",
        "train.local_epochs=1",
    ]
    runs = {}
    for place in ("memory", "disk"):
        out = tmp_path / place
        results = run_inprocess([*common, f"client_state={place}"], out, 3)
        runs[place] = json.loads(results.read_text())
    central = [
        [r["central"] for r in runs[place]["rounds"]] for place in ("memory", "disk")
    ]
    assert central[0] == central[1]
    for k in range(3):
        assert on_disk(tmp_path / "disk" / "client-state", k) == on_disk(
            tmp_path / "memory" / "client-state", k
        )

"""P-FedAvg's deployed servers equal the logical P-FedAvg; a lost server is mixed out.

Each server is a PFedAvgServer on an in-process grid of its own clients, in a
thread of its own, exchanging over real gRPC on loopback (the same exchange the
system test runs between real SuperLinks, tests/system/test_pfedavg_deploy.py).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from flwr_prox_strategies import FedAvgClient, PFedAvg, PFedAvgServer, to_client_app
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
from flwr_prox_strategies.core.transport.records import dict_to_record, record_to_dict
from flwr_prox_strategies.ops.mixing import mix_row
from flwr_prox_strategies.pfedavg_deploy.exchange import PeerExchange

from .lsq import LeastSquares
from .test_pfedavg import GD, inner_fedavg, run

logging.getLogger("flwr").setLevel(logging.WARNING)

SERVERS, PER_SERVER = 4, 2  # a ring of 4 is not complete: servers differ


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_grid(problem: LeastSquares, index: int) -> InProcessGrid:
    """Server ``index``'s own clients: partitions index, index + M, ... (as the
    logical P-FedAvg's partition-id modulo M)."""
    return InProcessGrid(
        to_client_app(problem.client_fn(FedAvgClient, **GD)),
        num_nodes=PER_SERVER,
        node_config=lambda k: {
            "partition-id": index + SERVERS * k,
            "num-partitions": SERVERS * PER_SERVER,
        },
    )


def deployed(
    problem, rounds, *, started=range(SERVERS), topology="ring", spy=None, **kwargs
):
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(SERVERS)]
    servers = {
        i: PFedAvgServer(
            index=i,
            servers=SERVERS,
            addresses=",".join(addresses),
            topology=topology,
            inner=inner_fedavg(),
            timeout=30,
            **kwargs,
        )
        for i in started
    }
    for server in servers.values():
        if spy is not None:
            spy(server)
    results, errors = {}, []

    def one(i):
        try:
            results[i] = servers[i].start(
                grid=server_grid(problem, i),
                initial_arrays=problem.initial(),
                num_rounds=rounds,
            )
        except Exception as err:  # raised in the test below
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in started]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    return servers, results


@pytest.mark.parametrize("rounds", [1, 5])
def test_every_server_equals_the_logical_servers_model(rounds) -> None:
    problem = LeastSquares(num_clients=SERVERS * PER_SERVER)
    logical = PFedAvg(servers=SERVERS, topology="ring", inner=inner_fedavg())
    run(problem, logical, rounds, **GD)
    _, results = deployed(problem, rounds)
    for i in range(SERVERS):
        mine = record_to_dict(results[i].arrays)
        assert mine.keys() == logical.models[i].keys()
        for key, value in mine.items():
            np.testing.assert_array_equal(value, logical.models[i][key])
    assert not np.array_equal(  # the servers really differ: the check means something
        next(iter(logical.models[0].values())), next(iter(logical.models[1].values()))
    )


def test_a_server_that_never_comes_is_mixed_out_with_renormalised_weights() -> None:
    """Server 3 never starts: its ring neighbours 0 and 2 mix over what they
    have, (W_00 y_0 + W_01 y_1) / (W_00 + W_01) = (y_0 + y_1) / 2 for server 0,
    round after round, and say so; server 1 (neighbours 0, 2) mixes as usual."""
    problem = LeastSquares(num_clients=SERVERS * PER_SERVER)
    seen = {}

    def spy(server):
        exchange = server.exchange.exchange

        def recorded(rnd, model):
            got = exchange(rnd, model)
            seen[(server.index, rnd)] = (record_to_dict(model), got)
            return got

        server.exchange.exchange = recorded

    _, results = deployed(
        problem, 2, started=[0, 1, 2], rejoin_grace=0.5, join_timeout=1.0, spy=spy
    )
    metrics = {i: results[i].train_metrics_clientapp for i in (0, 1, 2)}
    assert [metrics[0][r]["neighbours-missing"] for r in (1, 2)] == [1, 1]
    assert metrics[1][2]["neighbours-missing"] == 0
    assert metrics[0][2]["mixing-weight-at-hand"] == pytest.approx(2 / 3)
    assert metrics[1][2]["mixing-weight-at-hand"] == 1.0
    own, got = seen[(0, 2)]
    assert got.missing == [3] and sorted(got.models) == [1]
    y1 = record_to_dict(got.models[1])
    for key, value in y1.items():  # what server 1 sent is what it mixed itself
        np.testing.assert_array_equal(value, seen[(1, 2)][0][key])
    x0 = record_to_dict(results[0].arrays)
    for key in x0:
        expected = (own[key].astype(np.float64) + y1[key]) / 2
        np.testing.assert_allclose(x0[key], expected, rtol=1e-6)


def test_a_late_server_skips_to_its_neighbours_round() -> None:
    """Two neighbours published their round-3 models: a server starting at round
    0 (or resumed from round 1) takes their W-weighted mix, without its own."""
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    models = {j: {"w": np.full((1, 5), float(j), np.float32)} for j in (1, 2)}
    peers = {}
    try:
        for j in (1, 2):
            peers[j] = PeerExchange(
                index=j, addresses=addresses, neighbours=[k for k in range(3) if k != j]
            )
            peers[j].start(1 << 20)
            peers[j].publish(3, dict_to_record(models[j]))
        late = PFedAvgServer(
            index=0,
            servers=3,
            addresses=addresses,
            inner=inner_fedavg(),
            join_timeout=5,
        )
        initial = dict_to_record({"w": np.zeros((1, 5), np.float32)})
        arrays, done = late.rejoin(initial, 1)
        late.exchange.stop()
    finally:
        for peer in peers.values():
            peer.stop()
    assert done == 3 and late.round_offset == 3 and late.local.round_offset == 3
    # Ring of 3 (complete), Metropolis: W_01 = W_02 = 1/3 -> (1 + 2) / 2 = 1.5.
    np.testing.assert_allclose(record_to_dict(arrays)["w"], 1.5)
    expected, _ = mix_row(np.array([0.0, 0.5, 0.5]), 1, models)
    np.testing.assert_array_equal(record_to_dict(arrays)["w"], expected["w"])


def test_bad_settings_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="index must be < servers=3"):
        PFedAvgServer(index=3, servers=3, addresses="a:1,b:2,c:3")
    with pytest.raises(ValueError, match="addresses must name all 3"):
        PFedAvgServer(index=0, servers=3, addresses="a:1,b:2")
    with pytest.raises(ValueError, match="timeout"):
        PFedAvgServer(index=0, servers=2, addresses="a:1,b:2", timeout=0)
    with pytest.raises(ValueError, match="together"):
        PFedAvgServer(index=0, servers=2, addresses="a:1,b:2", certificate=__file__)


def serve(overrides: str, output: str, index: int, threads: int) -> None:
    """Run one P-FedAvg server of the app on its two in-process clients (a process).

    ``threads``: the parent's torch thread count (a spawned process starts with
    torch's default, and another count rounds the sums differently).
    """
    from apps.client_app import app as client_app
    from flwr_prox_strategies.experiment.server import run_experiment

    torch.set_num_threads(threads)

    run_config = {"overrides": overrides, "output-dir": output}
    grid = InProcessGrid(
        client_app,
        num_nodes=2,
        run_config=run_config,
        node_config=lambda k: {"partition-id": index + 3 * k, "num-partitions": 6},
    )
    run_experiment(grid, run_config)


@pytest.mark.long
def test_the_app_runs_three_servers_as_the_logical_p_fedavg(tmp_path) -> None:
    """The app's own path (conf deploy=peers, run_experiment, checkpoints): three
    servers, each a process with an in-process grid of its two clients, against
    the same app with strategy=pfedavg on all six. Each server's final model is
    the logical server's, bit for bit, on a path of three servers. (Processes: the servers seed torch's
    global generator, which threads would share.)"""
    import multiprocessing

    from apps.client_app import app as client_app
    from flwr_prox_strategies.experiment.checkpoint import read_checkpoint
    from flwr_prox_strategies.experiment.server import run_experiment

    common = (
        "strategy=pfedavg topology=grid topology.rows=1 topology.servers=3 model=logreg "
        "num_rounds=2 num_partitions=6"
    )
    logical_cfg = {
        "overrides": f"{common} num_clients=6",
        "output-dir": str(tmp_path / "logical"),
    }
    run_experiment(
        InProcessGrid(client_app, num_nodes=6, run_config=logical_cfg), logical_cfg
    )
    logical = read_checkpoint(tmp_path / "logical")["strategy"]["models"]

    addresses = "[" + ",".join(f"127.0.0.1:{free_port()}" for _ in range(3)) + "]"
    spawn = multiprocessing.get_context("spawn")
    procs = [
        spawn.Process(
            target=serve,
            args=(
                f"{common} num_clients=2 deploy=peers deploy.index={i} "
                f"deploy.addresses={addresses}",
                str(tmp_path / f"server-{i}"),
                i,
                torch.get_num_threads(),
            ),
        )
        for i in range(3)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(300)
    assert [proc.exitcode for proc in procs] == [0, 0, 0]
    for i in range(3):
        checkpoint = read_checkpoint(tmp_path / f"server-{i}")
        assert checkpoint["strategy"]["strategy"] == "PFedAvgServer"
        model = checkpoint["model"]
        for name, value in zip(model["names"], model["arrays"], strict=True):
            np.testing.assert_array_equal(value, logical[str(i)][name])
    # A path 0 - 1 - 2: the servers' models differ (the check above means something).
    assert not np.array_equal(
        logical["0"]["linear.weight"], logical["1"]["linear.weight"]
    )


def test_the_launcher_waits_while_a_run_is_pending_or_starting(tmp_path) -> None:
    """`flwr ls` says pending/starting before running: not an ended run.

    (The launcher once stopped watching a server whose run was still starting
    under load, and reported the run failed.)
    """
    from flwr_prox_strategies.pfedavg_deploy.deployment import Server

    server = Server(
        index=0, home=tmp_path, link_port=1, exchange="127.0.0.1:2", partitions=[0]
    )
    assert not server.active  # nothing submitted yet
    server.run_id = "1"
    for status in ("running", "pending", "starting"):
        server.status = status
        assert server.active, status
    for status in ("finished:completed", "finished:failed", "killed"):
        server.status = status
        assert not server.active, status


def test_the_launcher_builds_its_servers_and_knows_when_one_is_ending(
    tmp_path,
) -> None:
    """The launcher's plan (ports, partitions, Hydra overrides) from its command
    line, and the cheap check that paces its `flwr ls` calls (each a Python
    start): a server is ending once its results hold the last round or a
    failure."""
    import json

    from flwr_prox_strategies.pfedavg_deploy.launcher import Launcher, parse_args

    repo = str(Path(__file__).resolve().parents[1])
    args = parse_args(
        [
            *("--servers", "3", "--clients-per-server", "2", "--rounds", "4"),
            *("--output", str(tmp_path), "--app", repo, "--overrides", "model=logreg"),
        ]
    )
    launcher = Launcher(args)
    assert [s.partitions for s in launcher.servers] == [[0, 3], [1, 4], [2, 5]]
    ports = [s.link_port for s in launcher.servers]
    ports += [int(s.exchange.split(":")[1]) for s in launcher.servers]
    assert len(set(ports)) == 6  # every SuperLink and exchange its own port
    overrides = launcher.overrides(launcher.servers[1]).split()
    assert "deploy.index=1" in overrides and "num_clients=2" in overrides
    assert "num_partitions=6" in overrides and overrides[-1] == "model=logreg"
    assert launcher.env["PATH"].split(":")[0] == str(Path(sys.executable).parent)

    server = launcher.servers[0]
    folder = tmp_path / "server-0"
    folder.mkdir()
    assert not launcher.reached_its_end(server, {})  # nothing written yet
    assert not launcher.reached_its_end(server, {0: {}, 1: {}, 3: {}})
    assert launcher.reached_its_end(server, {4: {}})
    (folder / "results.json").write_text(json.dumps({"failure": "RuntimeError: x"}))
    assert launcher.reached_its_end(server, {1: {}})
    (folder / "results.json").write_text("{half a file")
    assert not launcher.reached_its_end(server, {1: {}})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--servers", "0"], "must be >= 1"),
        (["--app", "/"], "holds no pyproject.toml"),
        (["--kill-server", "3"], "--kill-server must be in 0..2"),
    ],
)
def test_the_launcher_refuses_a_bad_command_line(argv, message, capsys) -> None:
    from flwr_prox_strategies.pfedavg_deploy.launcher import parse_args

    repo = str(Path(__file__).resolve().parents[1])
    with pytest.raises(SystemExit):
        parse_args(["--app", repo, *argv])
    assert message in capsys.readouterr().err

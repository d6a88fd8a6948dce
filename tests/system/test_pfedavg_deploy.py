"""System test: P-FedAvg as three real Flower deployments on loopback.

One launch of ``python -m flwr_prox_strategies.pfedavg_deploy`` starts three
SuperLinks, a SuperNode each and three ServerApps (``flwr run``,
``deploy=peers``), which mix over gRPC, and proves two things:

* **Equivalence**: until a server is killed (rounds 1 and 2), every server's
  model equals the logical P-FedAvg's server model (the app's
  ``strategy=pfedavg`` on one grid of all three clients, same seeds, assignment
  and W); each round's accuracies and consensus distance equal the logical
  run's. The models are read from the servers' checkpoints while the launch
  runs (a checkpoint is replaced atomically as each round is written).
* **Faults**: server 2 is killed after round 2; its neighbours go on without it
  (re-normalised weights), it is restarted from its checkpoint and rejoins
  before the end.

The servers' exchange itself (equal to the logical P-FedAvg bit for bit after 5
rounds, a dead neighbour mixed out) is checked in process by
``tests/test_pfedavg_server.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
from flwr_prox_strategies.experiment.checkpoint import CheckpointError, read_checkpoint
from flwr_prox_strategies.experiment.server import run_experiment

from .engine import REPO

pytestmark = pytest.mark.slow

OVERRIDES = "model=logreg train.local_epochs=1"
# One client a server: each round starts one ClientApp process a client (about
# 30 s a round with two a server on 2 cores); the inner strategy's aggregation of
# several clients is the same code in process (tests/test_pfedavg_server.py).
SERVERS, CLIENTS_PER_SERVER, ROUNDS, KILLED, KILL_AFTER = 3, 1, 6, 2, 2
CLIENTS = SERVERS * CLIENTS_PER_SERVER


def launch_and_watch(
    output: Path,
    *extra: str,
    timeout: float = 1200,
    once_seen: tuple[int, Callable[[], object]] | None = None,
):
    """Run the launcher to its end; meanwhile keep every server's model of every
    round seen in its checkpoint. ``once_seen=(rnd, call)``: ``call()`` once
    every server's round ``rnd`` has been seen. Return (completed process,
    {(server, round): {name: array}})."""
    env = {k: v for k, v in os.environ.items() if k != "FLWR_HOME"}
    log = output.parent / f"{output.name}.launcher.log"
    command = [
        *(sys.executable, "-m", "flwr_prox_strategies.pfedavg_deploy"),
        *("--servers", str(SERVERS), "--clients-per-server", str(CLIENTS_PER_SERVER)),
        *("--rounds", str(ROUNDS), "--overrides", OVERRIDES),
        *("--output", str(output), "--app", str(REPO), *extra),
    ]
    seen: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    deadline = time.monotonic() + timeout
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=REPO
        )
        try:
            while proc.poll() is None:
                assert time.monotonic() < deadline, "the launch did not end"
                for i in range(SERVERS):
                    try:
                        checkpoint = read_checkpoint(output / f"server-{i}")
                    except CheckpointError:
                        continue
                    model = checkpoint["model"]
                    seen.setdefault(
                        (i, int(checkpoint["round"])),
                        dict(zip(model["names"], model["arrays"], strict=True)),
                    )
                if once_seen is not None and all(
                    (i, once_seen[0]) in seen for i in range(SERVERS)
                ):
                    once_seen[1]()
                    once_seen = None
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                proc.terminate()  # the launcher stops everything it started
                proc.wait(60)
    out = subprocess.CompletedProcess(command, proc.returncode, log.read_text(), "")
    return out, seen


def server_results(output: Path, i: int) -> dict:
    return json.loads((output / f"server-{i}" / "results.json").read_text())


def logical_p_fedavg(folder: Path, rounds: int) -> None:
    """The same app, seeds and W, all the clients on one grid (partition-id
    modulo 3 gives each server the same clients), its output in ``folder``."""
    from apps.client_app import app as client_app

    run_config = {
        "overrides": f"strategy=pfedavg topology=ring topology.servers={SERVERS} "
        f"num_clients={CLIENTS} num_partitions={CLIENTS} num_rounds={rounds} "
        f"seed=0 {OVERRIDES}",
        "output-dir": str(folder),
    }
    run_experiment(
        InProcessGrid(client_app, num_nodes=CLIENTS, run_config=run_config), run_config
    )


def start_logical_p_fedavg(folder: Path, rounds: int) -> subprocess.Popen:
    """:func:`logical_p_fedavg` in a process of its own, its output in ``folder``.

    Started once the deployments' rounds to compare are seen: it then runs while
    they wait on their killed server (exchange timeouts, the restart), not after.
    """
    code = (
        "import sys; from pathlib import Path; "
        "from tests.system.test_pfedavg_deploy import logical_p_fedavg; "
        "logical_p_fedavg(Path(sys.argv[1]), int(sys.argv[2]))"
    )
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.log", "w") as sink:
        return subprocess.Popen(
            [sys.executable, "-c", code, str(folder), str(rounds)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )


def read_logical_p_fedavg(folder: Path) -> tuple[dict, dict[int, dict]]:
    """The logical run's servers' models after its last round, each round's record."""
    models = read_checkpoint(folder)["strategy"]["models"]
    records = json.loads((folder / "results.json").read_text())["rounds"]
    return models, {r["round"]: r for r in records}


def test_three_deployments_equal_the_logical_p_fedavg_and_survive_a_killed_server(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "deploy"
    logical_folder = tmp_path / "logical"
    logical: list[subprocess.Popen] = []
    out, seen = launch_and_watch(
        folder,
        *("--kill-server", str(KILLED), "--kill-after", str(KILL_AFTER)),
        *("--restart-after", "3", "--exchange-timeout", "60", "--rejoin-grace", "4"),
        once_seen=(
            KILL_AFTER,
            lambda: logical.append(start_logical_p_fedavg(logical_folder, KILL_AFTER)),
        ),
    )
    if not logical:  # (the launch ended before its rounds were seen)
        logical.append(start_logical_p_fedavg(logical_folder, KILL_AFTER))
    try:
        logical_code = logical[0].wait(600)
    finally:
        if logical[0].poll() is None:
            logical[0].kill()
    assert out.returncode == 0, out.stdout[-6000:]
    assert f"killing server {KILLED}" in out.stdout
    assert f"restarting server {KILLED}" in out.stdout
    assert out.stdout.count("[pfedavg-deploy] round ") == ROUNDS
    combined = json.loads((folder / "results.json").read_text())
    assert (folder / "pfedavg-deploy.png").stat().st_size > 10_000

    # Equivalence, until the kill.
    logical_log = (tmp_path / "logical.log").read_text()
    assert logical_code == 0, logical_log[-6000:]
    logical_models, logical_rounds = read_logical_p_fedavg(logical_folder)
    worst = 0.0
    for i in range(SERVERS):
        assert (i, KILL_AFTER) in seen, f"server {i}'s round {KILL_AFTER} not seen"
        for name, value in seen[(i, KILL_AFTER)].items():
            reference = logical_models[str(i)][name]
            worst = max(worst, float(np.max(np.abs(value - reference))))
            # Float tolerance: the clients ran in other processes (thread pools).
            np.testing.assert_allclose(value, reference, rtol=1e-4, atol=1e-5)
        mine = {r["round"]: r for r in server_results(folder, i)["rounds"]}
        for rnd in range(1, KILL_AFTER + 1):
            assert mine[rnd]["train"]["neighbours-missing"] == 0
            assert mine[rnd]["central"]["accuracy"] == pytest.approx(
                logical_rounds[rnd][f"server-{i}"]["accuracy"], abs=1 / 360
            )
    rows = {r["round"]: r for r in combined["rounds"]}
    for rnd in range(1, KILL_AFTER + 1):
        # (A ring of 3 is complete: the distance is float noise, ~1e-17.)
        assert rows[rnd]["consensus-distance"] == pytest.approx(
            logical_rounds[rnd]["train"]["consensus-distance"], rel=1e-3, abs=1e-9
        )
    print(f"round {KILL_AFTER}: largest |deployed - logical| = {worst:.3g}")

    # Faults: server 2 mixed out, then back from its checkpoint.
    survivors = [
        {
            r["round"]: r["train"]
            for r in server_results(folder, i)["rounds"]
            if "train" in r
        }
        for i in range(SERVERS)
        if i != KILLED
    ]
    missing = [
        [t["neighbours-missing"] for _, t in sorted(s.items())] for s in survivors
    ]
    for series in missing:
        assert len(series) == ROUNDS
        assert any(m == 1 for m in series), series  # server 2 was down...
        assert series[-1] == 0, series  # ...and back by the end
    down = [r for r, t in survivors[0].items() if t["neighbours-missing"]]
    assert survivors[0][down[0]]["mixing-weight-at-hand"] == pytest.approx(2 / 3)
    restarted = server_results(folder, KILLED)
    assert restarted["summary"]["complete"]
    assert restarted["resumed"][0]["from-round"] == KILL_AFTER
    assert max(r["round"] for r in restarted["rounds"]) == ROUNDS
    final = [server_results(folder, i)["summary"]["final-accuracy"] for i in range(3)]
    assert min(final) > 0.8, final
    print(
        f"server {KILLED} rejoined {restarted.get('rejoined', [])}; "
        f"survivors' missing neighbours {missing}"
    )

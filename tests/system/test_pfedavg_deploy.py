"""System test: P-FedAvg as three real Flower deployments on loopback.

``python -m flwr_prox_strategies.pfedavg_deploy`` starts three SuperLinks, two
SuperNodes each and three ServerApps (``flwr run``, ``deploy=peers``), which mix
over gRPC. Equivalence: every server's model equals the logical P-FedAvg's
server model (the app's ``strategy=pfedavg`` on one grid of all six clients) for
the same seeds, assignment and W. Faults: a server killed mid-run; its
neighbours go on without it, it is restarted from its checkpoint and rejoins.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flwr_prox_strategies.core.inprocess import InProcessGrid
from flwr_prox_strategies.experiment.checkpoint import read_checkpoint
from flwr_prox_strategies.experiment.server import run_experiment

from .engine import REPO

pytestmark = pytest.mark.slow

OVERRIDES = "model=logreg train.local_epochs=1"


def launch(output: Path, *extra: str, rounds: int, timeout: float = 1200):
    """Run the launcher to its end.

    One launch at a time: two side by side took 17 min against 12.5 (each round
    starts a ClientApp process per client), and they shared ports once: gRPC's
    SO_REUSEPORT let two exchanges bind one port (now refused, test_exchange.py).
    """
    env = {k: v for k, v in os.environ.items() if k != "FLWR_HOME"}
    return subprocess.run(
        [
            *(sys.executable, "-m", "flwr_prox_strategies.pfedavg_deploy"),
            *("--servers", "3", "--clients-per-server", "2", "--rounds", str(rounds)),
            *("--overrides", OVERRIDES, "--output", str(output), "--app", str(REPO)),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
        check=False,
    )


def server_results(output: Path, i: int) -> dict:
    return json.loads((output / f"server-{i}" / "results.json").read_text())


def test_three_deployments_equal_the_logical_p_fedavg(tmp_path) -> None:
    from apps.client_app import app as client_app

    rounds = 5
    deployed = tmp_path / "deploy"
    out = launch(deployed, rounds=rounds)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("[pfedavg-deploy] round ") == rounds
    combined = json.loads((deployed / "results.json").read_text())
    assert combined["summary"]["complete"]
    assert all(r["consensus-distance"] is not None for r in combined["rounds"])
    assert (deployed / "pfedavg-deploy.png").stat().st_size > 10_000

    # The logical P-FedAvg: the same app, seeds and W, all six clients on one grid
    # (partition-id modulo 3 gives each server the same two clients).
    run_config = {
        "overrides": f"strategy=pfedavg topology=ring topology.servers=3 "
        f"num_clients=6 num_partitions=6 num_rounds={rounds} seed=0 {OVERRIDES}",
        "output-dir": str(tmp_path / "logical"),
    }
    run_experiment(
        InProcessGrid(client_app, num_nodes=6, run_config=run_config), run_config
    )
    logical = read_checkpoint(tmp_path / "logical")
    logical_rounds = {
        r["round"]: r
        for r in json.loads((tmp_path / "logical" / "results.json").read_text())[
            "rounds"
        ]
    }
    worst = 0.0
    for i in range(3):
        checkpoint = read_checkpoint(deployed / f"server-{i}")
        assert checkpoint["round"] == rounds
        model = checkpoint["model"]
        for name, value in zip(model["names"], model["arrays"], strict=True):
            reference = logical["strategy"]["models"][str(i)][name]
            worst = max(worst, float(np.max(np.abs(value - reference))))
            # Float tolerance: the clients ran in other processes (thread pools).
            np.testing.assert_allclose(value, reference, rtol=1e-4, atol=1e-5)
        mine = {r["round"]: r for r in server_results(deployed, i)["rounds"]}
        for rnd in range(1, rounds + 1):
            assert mine[rnd]["train"]["neighbours-missing"] == 0
            assert mine[rnd]["central"]["accuracy"] == pytest.approx(
                logical_rounds[rnd][f"server-{i}"]["accuracy"], abs=1 / 360
            )
    print(f"largest |deployed - logical| over the servers' models: {worst:.3g}")


def test_a_killed_server_is_mixed_out_then_rejoins_from_its_checkpoint(
    tmp_path,
) -> None:
    rounds = 6
    folder = tmp_path
    out = launch(
        folder,
        *("--kill-server", "2", "--kill-after", "2", "--restart-after", "3"),
        *("--exchange-timeout", "60", "--rejoin-grace", "4"),
        rounds=rounds,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "killing server 2" in out.stdout and "restarting server 2" in out.stdout
    survivors = [
        {
            r["round"]: r["train"]
            for r in server_results(folder, i)["rounds"]
            if "train" in r
        }
        for i in (0, 1)
    ]
    missing = [
        [t["neighbours-missing"] for _, t in sorted(s.items())] for s in survivors
    ]
    for series in missing:
        assert len(series) == rounds
        assert any(m == 1 for m in series), series  # server 2 was down...
        assert series[-1] == 0, series  # ...and back by the end
    down = [r for r, t in survivors[0].items() if t["neighbours-missing"]]
    assert survivors[0][down[0]]["mixing-weight-at-hand"] == pytest.approx(2 / 3)
    restarted = server_results(folder, 2)
    assert restarted["summary"]["complete"]
    assert restarted["resumed"][0]["from-round"] == 2
    rejoined = restarted.get("rejoined", [])
    last = max(r["round"] for r in restarted["rounds"])
    assert last == rounds
    final = [server_results(folder, i)["summary"]["final-accuracy"] for i in range(3)]
    assert min(final) > 0.8, final
    print(f"server 2 rejoined {rejoined}; survivors' missing neighbours {missing}")

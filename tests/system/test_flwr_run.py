"""System tests: the real Flower engine, `flwr run .`, SuperLink and SuperNodes.

Slow (each starts the engine) but run in CI. Every process started is killed
by process group at the end.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .engine import REPO, loopback_deployment, managed_engine, run_log, run_status

pytestmark = pytest.mark.slow

SMALL = "num_clients=4 num_rounds=3 model=logreg train.local_epochs=1"


def flwr_run(env, *args: str, timeout: float = 300) -> dict:
    out = subprocess.run(
        ["flwr", "run", ".", *args, "--stream", "--format", "json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=timeout,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def check_results(output: Path, rounds: int, strategy: str) -> dict:
    results = json.loads((output / "results.json").read_text())
    assert results["summary"]["complete"] is True
    assert results["strategy"] == strategy
    assert [r["round"] for r in results["rounds"]] == list(range(rounds + 1))
    assert results["rounds"][-1]["train"]["replies-valid"] == results["num-clients"]
    assert results["summary"]["final-accuracy"] > 0.5  # logreg on digits, 3 rounds
    assert (output / "metrics.png").stat().st_size > 10_000
    return results


def simulate(tmp_path: Path, overrides: str) -> Path:
    """`flwr run` on 4 simulated SuperNodes; assert it completed; return its output."""
    output = tmp_path / "out"
    with managed_engine(tmp_path / "home") as env:
        reply = flwr_run(
            env,
            "--federation-config",
            "num-supernodes=4 client-resources-num-cpus=1",
            "--run-config",
            f"overrides='{overrides}' output-dir='{output}'",
        )
        status = run_status(reply["run-id"], env)
        assert status["status"] == "finished:completed", run_log(reply["run-id"], env)[
            -3000:
        ]
    return output


def test_flwr_run_simulation(tmp_path: Path) -> None:
    output = simulate(tmp_path, f"strategy=fedprox strategy.mu=0.1 {SMALL}")
    results = check_results(output, 3, "FedProx")
    assert results["config"]["strategy"]["mu"] == 0.1


def test_pfedavg_through_the_engine(tmp_path: Path) -> None:
    """The issue's override string on the real engine: the node-config query, the
    per-group messages and the mixing all go through Flower's simulation."""
    output = simulate(
        tmp_path, f"strategy=pfedavg topology=ring topology.servers=4 {SMALL}"
    )
    results = check_results(output, 3, "PFedAvg")
    last = results["rounds"][-1]
    assert all(f"server-{i}" in last for i in range(4))
    assert last["train"]["consensus-distance"] > 0  # a ring of 4 is not complete


def test_dp_sgd_through_the_engine(tmp_path: Path) -> None:
    """opacus inside the simulation's workers; epsilon per client in results.json;
    a client whose budget runs out retires and the run goes on."""
    output = simulate(
        tmp_path,
        f"strategy=feddyn privacy=dp-sgd privacy.dp.target_epsilon=3.3 {SMALL}",
    )
    results = json.loads((output / "results.json").read_text())
    assert results["summary"]["complete"] is True
    trained = [r["train"] for r in results["rounds"] if "train" in r]
    spent = trained[-1]["dp-epsilon-total-per-client"]
    assert len(spent) == 4 and max(spent) <= 3.3
    assert sum(t["replies-absent"] for t in trained) >= 1  # someone retired
    assert all(t["replies-failed"] == 0 for t in trained)
    assert results["summary"]["final-epsilon-max"] == max(spent)
    assert (output / "privacy.png").stat().st_size > 10_000


def test_node_count_mismatch_fails_fast_with_the_fix(tmp_path: Path) -> None:
    with managed_engine(tmp_path / "home") as env:
        reply = flwr_run(
            env,
            "--federation-config",
            "num-supernodes=3 client-resources-num-cpus=1",
            "--run-config",
            f"overrides='{SMALL} node_wait_timeout=0' output-dir='{tmp_path}/o'",
            timeout=180,
        )
        status = run_status(reply["run-id"], env)
        assert status["status"] == "finished:failed", status
        log = run_log(reply["run-id"], env)
    assert "num-supernodes=4" in log and "num_clients=4" in log


def test_loopback_deployment(tmp_path: Path) -> None:
    output = tmp_path / "out"
    with loopback_deployment(tmp_path / "home", num_nodes=3) as (env, connection):
        reply = flwr_run(
            env,
            connection,
            "--run-config",
            f"overrides='strategy=fedavg num_clients=3 num_rounds=2 model=logreg' output-dir='{output}'",
            timeout=400,
        )
        status = run_status(reply["run-id"], env, connection)
        log = run_log(reply["run-id"], env, connection)
        assert status["status"] == "finished:completed", log[-3000:]
    check_results(output, 2, "FedAvg")


def test_sweep_through_flwr_run(tmp_path: Path) -> None:
    """A 2-job Hydra multirun where every job is a real `flwr run`."""
    import csv
    import sys

    sweep_dir = tmp_path / "sweep"
    with managed_engine(tmp_path / "home") as env:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "flwr_prox_strategies.experiment",
                "-m",
                "strategy=fedavg,fedprox",
                "num_clients=3",
                "num_rounds=2",
                "model=logreg",
                f"hydra.sweep.dir={sweep_dir}",
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=600,
            check=False,
        )
    assert out.returncode == 0, out.stderr[-3000:]
    with open(sweep_dir / "summary.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["strategy"] for r in rows] == ["FedAvg", "FedProx"]
    assert all(r["engine"] == "flwr" and float(r["final-accuracy"]) > 0.3 for r in rows)
    assert (sweep_dir / "comparison.png").is_file()
    assert (sweep_dir / "0" / "flwr.log").is_file()

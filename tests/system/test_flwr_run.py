"""System tests: the pack's app through `flwr run` on Flower's simulation engine.

Slow (each run starts Ray and the app's ClientApps). The runs share one managed
local SuperLink (the ``engine`` fixture), except a sweep's jobs, which start
SuperLinks of their own; every process is killed by process group at the end. The fast suite runs the main job the same way
(``tests/test_main_job.py``); real SuperLinks with SuperNodes are in
``test_faults.py`` and ``test_tls.py``.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flwr_prox_strategies.experiment.appdir import write_app_dir

from .engine import check_results, flwr_run, run_log, run_status, simulate

pytestmark = pytest.mark.slow

SMALL = "num_clients=4 num_rounds=3 model=logreg train.local_epochs=1"


def test_pfedavg_through_the_engine(engine: dict[str, str], tmp_path: Path) -> None:
    """The node-config query, the per-group messages and the mixing all go
    through Flower's simulation."""
    output = simulate(
        engine,
        f"strategy=pfedavg topology=ring topology.servers=4 {SMALL}",
        tmp_path / "out",
    )
    results = check_results(output, 3, "PFedAvg")
    last = results["rounds"][-1]
    assert all(f"server-{i}" in last for i in range(4))
    assert last["train"]["consensus-distance"] > 0  # a ring of 4 is not complete


def test_dp_sgd_through_the_engine(engine: dict[str, str], tmp_path: Path) -> None:
    """opacus inside the simulation's workers; epsilon per client in results.json;
    a client whose budget runs out retires and the run goes on."""
    output = simulate(
        engine,
        f"strategy=feddyn privacy=dp-sgd privacy.dp.target_epsilon=3.3 {SMALL}",
        tmp_path / "out",
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


def test_node_count_mismatch_fails_fast_with_the_fix(
    engine: dict[str, str], tmp_path: Path
) -> None:
    reply = flwr_run(
        engine,
        "--federation-config",
        "num-supernodes=3 client-resources-num-cpus=1",
        "--run-config",
        f"overrides='{SMALL} node_wait_timeout=0' output-dir='{tmp_path}/o'",
        timeout=180,
    )
    status = run_status(reply["run-id"], engine)
    assert status["status"] == "finished:failed", status
    log = run_log(reply["run-id"], engine)
    assert "num-supernodes=4" in log and "num_clients=4" in log


def test_a_parallel_sweep_outside_a_checkout_runs_engine_jobs_side_by_side(
    tmp_path: Path,
) -> None:
    """Two `engine=flwr` jobs at once through Hydra's joblib launcher, started
    outside any checkout: each runs the Flower app the pack writes for itself
    (a folder holding only a pyproject.toml whose components are the
    package's), as a pip-installed pack does. Flower's managed SuperLink
    listens on fixed ports, so the second job failed to start one ("Failed to
    start local SuperLink"): each job now runs on a SuperLink of its own (its
    port, Flower home and working folder) with a Ray of its share of the CPUs
    (2 jobs on 2 cores: 1 each). One job fails in its ServerApp (FedProx's
    mu = -1): the other still completes and logs to the sweep's MLflow
    experiment, a run named by its swept key, Flower's lines in its log once;
    the summary keeps the failed job's row with Flower's status of its run
    (`flwr run --stream` exits 0 when the ServerApp fails), the sweep exits 1
    naming it, and no process of theirs is left."""
    from flwr_prox_strategies._processes import process_cmdlines

    app = write_app_dir(tmp_path / "app")
    assert [p.name for p in app.iterdir()] == ["pyproject.toml"]
    sweep = tmp_path / "sweep"
    command = [
        sys.executable,
        "-m",
        "flwr_prox_strategies.experiment",
        "-m",
        "engine=flwr",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "strategy=fedprox",
        "strategy.mu=0.5,-1",
        "num_clients=2",
        "num_rounds=2",
        "model=logreg",
        "train.local_epochs=1",
        "logger=mlflow",
        f"hydra.sweep.dir={sweep}",
    ]
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "FLWR_PROX_APP_DIR": str(app)},
        timeout=600,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    printed = out.stdout + out.stderr
    assert "1 job(s) of the sweep did not complete" in out.stderr, out.stderr[-3000:]
    assert f"flwr run {app} job --stream" in printed, printed[-2000:]
    # The console ends with what the completed job produced, as other routes do.
    assert "Finished: final accuracy" in printed, printed[-2000:]
    assert f"Output folder: {sweep / '0'}" in printed, printed[-2000:]
    with open(sweep / "summary.csv") as handle:
        rows = {r["job"]: r for r in csv.DictReader(handle)}
    assert (
        rows["0"]["status"] == "completed" and float(rows["0"]["final-accuracy"]) > 0.5
    )
    assert rows["1"]["status"] == "failed"
    assert "finished:failed" in rows["1"]["error"] and "mu" in rows["1"]["error"]
    assert {r["cpus"] for r in rows.values()} == {"1"}
    assert {r["engine"] for r in rows.values()} == {"flwr"}
    ports, starts, ends = set(), [], []
    for job in ("0", "1"):
        log = (sweep / job / "flwr.log").read_text()
        ports |= {
            line.split("SuperLink: job (")[1].split(")")[0]
            for line in log.splitlines()
            if "SuperLink: job (" in line
        }
        starts.append((sweep / job / ".hydra" / "config.yaml").stat().st_mtime)
        ends.append((sweep / job / "job.json").stat().st_mtime)
    assert len(ports) == 2, ports  # two SuperLinks, not one shared
    assert max(starts) < min(ends)  # both ran at once
    assert "init-args-num-cpus=1" in printed
    assert (sweep / "comparison.png").is_file()
    # Each of Flower's records once in a flwr run's log, in Flower's format.
    log = (sweep / "0" / "flwr.log").read_text().splitlines()
    assert len([line for line in log if "configure_train: sampled" in line]) == 2
    assert not [line for line in log if "][flwr][" in line]
    # The completed job's ServerApp logged to the sweep's MLflow experiment.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{sweep.resolve() / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name != "Default"]
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert runs["strategy.mu=0.5"].info.status == "FINISHED", sorted(runs)
    accuracy = runs["strategy.mu=0.5"].data.metrics["central/accuracy"]
    assert accuracy == float(rows["0"]["final-accuracy"])
    assert not [c for c in process_cmdlines().values() if "flwr-prox-superlink-" in c]

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


def test_a_sweep_outside_a_checkout_runs_its_job_through_flwr_run(
    engine: dict[str, str], tmp_path: Path
) -> None:
    """A Hydra multirun whose job is a real `flwr run`, started outside any
    checkout: it runs the Flower app the pack writes for itself (a folder
    holding only a pyproject.toml whose components are the package's), as a
    pip-installed pack does. The job's ServerApp logs to the sweep's MLflow
    experiment, a run named by its swept key, and Flower's lines are in the
    job's log once. (The comparison of several settings is the same code in
    process, tests/test_experiment.py.)"""
    app = write_app_dir(tmp_path / "app")
    assert [p.name for p in app.iterdir()] == ["pyproject.toml"]
    sweep_dir = tmp_path / "sweep"
    out = subprocess.run(
        [
            *(sys.executable, "-m", "flwr_prox_strategies.experiment", "-m"),
            "strategy=fedprox",
            "num_clients=3",
            "num_rounds=2",
            "model=logreg",
            "seed=choice(0)",  # one job, its swept key names its run
            "logger=mlflow",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        capture_output=True,
        text=True,
        env={**engine, "FLWR_PROX_APP_DIR": str(app)},
        cwd=tmp_path,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"flwr run {app} job --stream" in out.stdout + out.stderr, out.stderr[-2000:]
    with open(sweep_dir / "summary.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["strategy"] for r in rows] == ["FedProx"]
    assert all(r["engine"] == "flwr" and float(r["final-accuracy"]) > 0.3 for r in rows)
    assert (sweep_dir / "comparison.png").is_file()
    # Each of Flower's records once in a flwr run's log, in Flower's format.
    log = (sweep_dir / "0" / "flwr.log").read_text().splitlines()
    assert len([line for line in log if "configure_train: sampled" in line]) == 2
    assert not [line for line in log if "][flwr][" in line]
    # The ServerApp of each flwr run logged to the sweep's MLflow experiment.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{sweep_dir.resolve() / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name != "Default"]
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["seed=0"]
    for run, row in zip(sorted(runs, key=lambda r: r.info.run_name), rows, strict=True):
        assert run.info.status == "FINISHED"
        assert run.data.metrics["central/accuracy"] == float(row["final-accuracy"])


def test_two_engine_jobs_run_side_by_side_on_their_own_superlinks(
    tmp_path: Path,
) -> None:
    """Two `engine=flwr` jobs at once: Flower's managed SuperLink listens on
    fixed ports, so the second job failed to start one ("Failed to start local
    SuperLink"). Each job now runs on a SuperLink of its own (its port, its
    Flower home, the job folder as its working folder), both finish, and no
    process of theirs is left once they return."""
    from concurrent.futures import ThreadPoolExecutor

    from flwr_prox_strategies._processes import process_cmdlines
    from flwr_prox_strategies.experiment.sweep import flwr_run as job_run

    small = ["num_clients=2", "num_rounds=2", "model=logreg", "train.local_epochs=1"]
    jobs = {
        "fedavg": tmp_path / "fedavg",
        "fedprox": tmp_path / "fedprox",
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(
                job_run, [f"strategy={name}", *small], folder, num_supernodes=2
            )
            for name, folder in jobs.items()
        }
        results = {name: future.result(timeout=600) for name, future in futures.items()}
    ports = set()
    for name, path in results.items():
        summary = json.loads(path.read_text())
        assert summary["summary"]["complete"], name
        assert summary["strategy"] == {"fedavg": "FedAvg", "fedprox": "FedProx"}[name]
        log = (jobs[name] / "flwr.log").read_text()
        assert "Successfully started run" in log
        ports |= {
            line.split("SuperLink: job (")[1].split(")")[0]
            for line in log.splitlines()
            if "SuperLink: job (" in line
        }
        assert (jobs[name] / "superlink.log").is_file()
    assert len(ports) == 2, ports  # two SuperLinks, not one shared
    assert not [c for c in process_cmdlines().values() if "flwr-prox-superlink-" in c]


def test_a_failed_engine_job_names_flowers_status_of_its_run(tmp_path: Path) -> None:
    """`flwr run --stream` exits 0 when the ServerApp fails; the job's error
    says the run failed as Flower recorded it (its status and details, read
    from the job's own SuperLink before it stops), and no process is left."""
    from flwr_prox_strategies._processes import process_cmdlines
    from flwr_prox_strategies.experiment.sweep import flwr_run as job_run

    with pytest.raises(RuntimeError) as failed:
        job_run(
            ["strategy=nosuchstrategy", "num_clients=2", "num_rounds=1"],
            tmp_path / "job",
            num_supernodes=2,
            timeout=600,
        )
    message = str(failed.value)
    assert "finished:failed" in message, message[:2000]
    assert "nosuchstrategy" in message, message[:2000]
    assert not [c for c in process_cmdlines().values() if "flwr-prox-superlink-" in c]

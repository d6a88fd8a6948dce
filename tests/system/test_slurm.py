"""A Hydra sweep submitted to a real SLURM cluster through submitit's launcher.

The test starts a single-node SLURM of its own (``slurm_cluster.py``: MUNGE,
slurmctld and slurmd in tmp_path, on free ports) and runs a 2-job sweep with
``hydra/launcher=submitit_slurm``: one SLURM job array, each task a Hydra job
that runs the experiment in-process on the CPU it asked for and writes
results.json and job.json; the submitting process waits for both and writes
summary.csv. That the jobs ran under SLURM is SLURM's own word: the job ids
Hydra records (``hydra.job.id``, which the launcher reads from the job's SLURM
environment) are jobs slurmctld ran to COMPLETED. Skipped where SLURM is not
installed (``.ci/install-slurm`` installs it).

Two more sweeps on the same cluster: one whose second job fails (SLURM records
that task FAILED, the first COMPLETED; the sweep still summarises both and
exits 1), and one asking for more CPUs than the node has, whose jobs stay
pending: the sweep warns with squeue's reason, PartitionConfig.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from .engine import REPO, hydra_entry
from .slurm_cluster import SlurmUnavailable, single_node_slurm

pytestmark = pytest.mark.slow

SWEEP = (
    "hydra/launcher=submitit_slurm",
    "hydra.launcher.partition=debug",
    "hydra.launcher.cpus_per_task=1",  # 2 jobs side by side on 2 cores
    "hydra.launcher.timeout_min=10",
    "engine=inprocess",
    "num_rounds=2",
    "num_clients=4",
    "model=logreg",
    "train.local_epochs=1",
    "seed=0,1",
)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A client's environment for a single-node SLURM, stopped after the tests.

    One cluster for the module's tests (its start is seconds a test otherwise);
    each test's jobs have ended or are cancelled when it returns.
    """
    try:
        with single_node_slurm(tmp_path_factory.mktemp("slurm")) as env:
            yield env
    except SlurmUnavailable as err:
        pytest.skip(str(err))


def _sweep_env(slurm: dict[str, str]) -> dict[str, str]:
    # The jobs start `python -m submitit.core._submit` in this working folder
    # with this environment (sbatch exports it): they import this checkout.
    pythonpath = os.pathsep.join(filter(None, [str(REPO), slurm.get("PYTHONPATH")]))
    return {**slurm, "PYTHONPATH": pythonpath}


def _job_record(job_id: str, env: dict[str, str]) -> str:
    """Return ``scontrol show job``'s one-line record of ``job_id``."""
    return subprocess.run(
        ["scontrol", "show", "job", "--oneliner", job_id],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def _final_state(job_id: str, env: dict[str, str], timeout: float = 30) -> str:
    """The job's state once it has ended (SLURM's own record, ``scontrol``).

    The sweep may end as soon as a job has saved its result, while the job's
    process is still exiting (RUNNING, COMPLETING): wait for its last state.
    """
    deadline = time.monotonic() + timeout
    while True:
        record = _job_record(job_id, env)
        state = re.search(r"JobState=(\S+)", record)
        assert state, record
        if state[1] not in ("PENDING", "RUNNING", "COMPLETING"):
            return state[1]
        assert time.monotonic() < deadline, record
        time.sleep(0.5)


def test_each_job_of_a_submitit_sweep_runs_as_a_slurm_job_and_is_summarised(
    slurm: dict[str, str], tmp_path: Path
) -> None:
    sweep = tmp_path / "sweep"
    out = hydra_entry(
        "-m",
        *SWEEP,
        f"hydra.sweep.dir={sweep}",
        env=_sweep_env(slurm),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]

    job_ids = []
    for job in ("0", "1"):
        results = json.loads((sweep / job / "results.json").read_text())
        assert results["summary"]["complete"] is True
        assert [r["round"] for r in results["rounds"]] == [0, 1, 2]
        summary = json.loads((sweep / job / "job.json").read_text())
        assert summary["engine"] == "inprocess"
        assert summary["overrides"].endswith(f"seed={job}")
        hydra = OmegaConf.load(sweep / job / ".hydra" / "hydra.yaml")
        job_ids.append(str(hydra.hydra.job.id))

    # One array of two tasks (<array>_0, <array>_1), both run to the end.
    array = job_ids[0].split("_")[0]
    assert job_ids == [f"{array}_0", f"{array}_1"]
    for job_id in job_ids:
        assert _final_state(job_id, slurm) == "COMPLETED"
        record = _job_record(job_id, slurm)
        assert "Partition=debug" in record
        log = sweep / ".submitit" / job_id / f"{job_id}_0_log.out"
        assert f"JobEnvironment(job_id={job_id}," in log.read_text()
        # The job's own lines: its place in the sweep (read from the sweep's
        # multirun.yaml, not the job's command line) and the CPUs it asked for.
        printed = log.with_suffix(".err").read_text()
        assert f"Sweep: job {int(job_id[-1]) + 1} of 2" in printed, printed[-2000:]
        assert "Job CPUs: 1 (the launcher's cpus_per_task)" in printed

    with open(sweep / "summary.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["job"] for row in rows] == ["0", "1"]
    assert all(float(row["final-accuracy"]) > 0.5 for row in rows)
    assert {row["cpus"] for row in rows} == {"1"}


def test_a_failed_job_is_failed_in_slurm_and_still_a_row_of_the_summary(
    slurm: dict[str, str], tmp_path: Path
) -> None:
    sweep = tmp_path / "sweep"
    # FedProx refuses mu=-1 when it is built: the second job fails at once.
    arguments = [a for a in SWEEP if not a.startswith("seed=")]
    out = hydra_entry(
        "-m",
        *arguments,
        "strategy=fedprox",
        "strategy.mu=0.5,-1",
        f"hydra.sweep.dir={sweep}",
        env=_sweep_env(slurm),
        cwd=tmp_path,
    )
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-4000:]
    assert "1 job(s) of the sweep did not complete" in out.stderr

    with open(sweep / "summary.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["job"], row["status"]) for row in rows] == [
        ("0", "completed"),
        ("1", "failed"),
    ]
    assert "mu must be a finite number >= 0, got -1" in rows[1]["error"]
    states = {}
    for job in ("0", "1"):
        hydra = OmegaConf.load(sweep / job / ".hydra" / "hydra.yaml")
        states[job] = _final_state(str(hydra.hydra.job.id), slurm)
    assert states == {"0": "COMPLETED", "1": "FAILED"}


def test_a_sweep_whose_jobs_cannot_start_says_why(
    slurm: dict[str, str], tmp_path: Path
) -> None:
    cpus = (os.cpu_count() or 1) * 4  # more than the node has: never scheduled
    arguments = [a for a in SWEEP if not a.startswith("hydra.launcher.cpus")]
    sweep = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flwr_prox_strategies.experiment",
            "-m",
            *arguments,
            f"hydra.launcher.cpus_per_task={cpus}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
            # The first look may come before the jobs are submitted: look again.
            "+hydra.callbacks.summary.pending_after=2",
            "+hydra.callbacks.summary.pending_every=2",
        ],
        env=_sweep_env(slurm),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its group is killed below, nothing else
    )
    # Nothing may come (a sweep that waits silently): end it after a while.
    killer = threading.Timer(120, os.killpg, (sweep.pid, signal.SIGKILL))
    killer.start()
    lines = []
    warning = None
    try:
        assert sweep.stdout is not None
        for line in sweep.stdout:
            lines.append(line)
            if "still pending" in line:
                warning = line
                break
    finally:
        killer.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sweep.pid, signal.SIGKILL)
        sweep.wait()
        # Its jobs would wait for ever: cancel them (their ids are submitit's
        # folders).
        submitted = tmp_path / "sweep" / ".submitit"
        arrays = {d.name.split("_")[0] for d in submitted.glob("[0-9]*")}
        if arrays:
            subprocess.run(["scancel", *sorted(arrays)], env=slurm, check=True)
    assert warning is not None, "".join(lines[-50:])
    found = re.search(
        r"Sweep: 2 SLURM job\(s\) still pending after \d+ s: (\S+), (\S+);", warning
    )
    assert found, warning
    array = found[1].split("_")[0]
    assert [found[1], found[2]] == [f"{array}_0", f"{array}_1"]
    assert "squeue's reason: PartitionConfig (the request exceeds" in warning
    assert "hydra.launcher.cpus_per_task" in warning

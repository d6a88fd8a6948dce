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
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
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


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A client's environment for a single-node SLURM, stopped after the test."""
    try:
        with single_node_slurm(tmp_path / "slurm") as env:
            yield env
    except SlurmUnavailable as err:
        pytest.skip(str(err))


def test_each_job_of_a_submitit_sweep_runs_as_a_slurm_job_and_is_summarised(
    slurm: dict[str, str], tmp_path: Path
) -> None:
    sweep = tmp_path / "sweep"
    # The jobs start `python -m submitit.core._submit` in this working folder
    # with this environment (sbatch exports it): they import this checkout.
    pythonpath = os.pathsep.join(filter(None, [str(REPO), slurm.get("PYTHONPATH")]))
    out = hydra_entry(
        "-m",
        *SWEEP,
        f"hydra.sweep.dir={sweep}",
        env={**slurm, "PYTHONPATH": pythonpath},
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
        record = subprocess.run(
            ["scontrol", "show", "job", "--oneliner", job_id],
            env=slurm,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "JobState=COMPLETED" in record and "Partition=debug" in record
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

"""A sweep on SLURM, without SLURM: a fake ``squeue`` and a fake job environment.

The real cluster's side (a job FAILED in SLURM's records, jobs pending with
PartitionConfig) is in the slow test ``tests/system/test_slurm.py``.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flwr_prox_strategies.experiment.sweeps import slurm
from flwr_prox_strategies.experiment.sweeps.sweep import SweepSummary

from .helpers import logged

REPO = Path(__file__).resolve().parents[1]

# Answers like `squeue --noheader --array --states=PENDING --format=%i|%r`,
# and writes down the arguments it was given.
SQUEUE = """#!/bin/sh
echo "$@" >> "{calls}"
printf '41_0|PartitionConfig\\n41_1|PartitionConfig\\n42|Priority\\n7_3|Resources\\n'
"""


@pytest.fixture
def squeue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake ``squeue`` first on PATH; returns the file of its calls."""
    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "squeue"
    fake.parent.mkdir()
    fake.write_text(SQUEUE.format(calls=calls))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_pending_jobs_are_the_users_of_the_name_grouped_by_reason(squeue) -> None:
    found = slurm.pending_jobs(name="sweep", user="1000")
    assert found == {
        "PartitionConfig": ["41_0", "41_1"],
        "Priority": ["42"],
        "Resources": ["7_3"],
    }
    arguments = squeue.read_text().split()
    assert {"--user=1000", "--name=sweep", "--states=PENDING", "--array"} <= set(
        arguments
    )
    # Known ids keep the sweep's own arrays only.
    assert slurm.pending_jobs(name="sweep", user="1000", job_ids={"41_0", "41"}) == {
        "PartitionConfig": ["41_0", "41_1"]
    }


def test_the_common_reasons_say_what_to_do() -> None:
    assert "cpus_per_task" in slurm.explain("PartitionConfig")
    assert "scontrol show partition" in slurm.explain("PartitionConfig")
    assert "other jobs" in slurm.explain("Resources")
    assert "sprio" in slurm.explain("Priority")
    assert "sinfo -R" in slurm.explain("ReqNodeNotAvail")
    assert "array_parallelism" in slurm.explain("QOSMaxCpuPerUserLimit")
    assert "array_parallelism" in slurm.explain("AssocGrpCpuLimit")
    assert slurm.explain("SomethingNew") == ""


def test_the_ids_are_the_job_folders_submitit_made_since_the_start(
    tmp_path: Path,
) -> None:
    folder = tmp_path / ".submitit"
    (folder / "3_0").mkdir(parents=True)
    old = time.time() - 3600
    os.utime(folder / "3_0", (old, old))  # an earlier sweep's
    (folder / "9_0").mkdir()
    (folder / "9_1").mkdir()
    (folder / ".submission_file_0").mkdir()  # submitit's, not a job
    assert slurm.submitted_ids(str(folder / "%j"), time.time() - 60) == {"9_0", "9_1"}
    assert slurm.submitted_ids(str(folder / "fixed"), 0) == set()
    assert slurm.submitted_ids(str(tmp_path / "none" / "%j"), 0) == set()


def test_a_slurm_sweep_warns_while_its_jobs_stay_pending_until_it_ends(
    squeue, tmp_path: Path, caplog
) -> None:
    summary = SweepSummary(pending_after=0.1, pending_every=0.2)
    launcher = {
        "_target_": slurm.SLURM_LAUNCHER,
        "name": "sweep",
        "submitit_folder": str(tmp_path / ".submitit" / "%j"),
    }
    with caplog.at_level("WARNING", logger="flwr"):
        assert summary._pending.start(launcher)
        deadline = time.monotonic() + 10
        while len(squeue.read_text().splitlines() if squeue.exists() else []) < 2:
            assert time.monotonic() < deadline, "squeue was not asked twice"
            time.sleep(0.05)
        summary._pending.stop()
    asked = len(squeue.read_text().splitlines())
    time.sleep(0.5)
    assert len(squeue.read_text().splitlines()) == asked, "asked after the end"
    assert logged(caplog, "Sweep: 2 SLURM job(s) still pending after ")
    assert logged(
        caplog,
        " s: 41_0, 41_1; squeue's reason: PartitionConfig (the request exceeds "
        "what the partition can ever give",
    )
    assert logged(caplog, " s: 42; squeue's reason: Priority (jobs of higher")
    assert all("\n" not in r.getMessage() for r in caplog.records)


def test_other_launchers_are_not_watched_and_the_callback_pickles(squeue) -> None:
    summary = SweepSummary(pending_after=0, pending_every=1)
    basic = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
    assert not summary._pending.start({"_target_": basic})
    time.sleep(0.2)
    assert not squeue.exists()
    # submitit pickles the launcher with Hydra's callbacks for each job.
    summary._pending.start({"_target_": slurm.SLURM_LAUNCHER, "name": "x"})
    copy = pickle.loads(pickle.dumps(summary))
    summary._pending.stop()
    assert (copy._pending.after, copy._pending.every) == (0, 1)
    with pytest.raises(ValueError, match="pending_every"):
        SweepSummary(pending_every=0)


# A job process: the failure branch, then submitit's last word after it.
JOB = textwrap.dedent(
    """
    import logging, sys
    from flwr.common.logger import log
    from flwr_prox_strategies.experiment.sweeps.slurm import exit_failed_after_result
    print("registered:", exit_failed_after_result())
    log(logging.ERROR, "Sweep: job 1 failed: the reason")
    print("result saved", end="")  # unflushed: the exit handler flushes it
    """
)


@pytest.mark.parametrize(
    ("env", "code"),
    [
        ({"SLURM_JOB_ID": "5", "SUBMITIT_FOLDER": "/tmp/x"}, 1),
        ({"SUBMITIT_FOLDER": "/tmp/x"}, 0),  # submitit's local executor
        ({"SLURM_JOB_ID": "5"}, 0),  # a plain multirun inside an allocation
    ],
)
def test_a_failed_submitit_slurm_job_exits_1_after_it_ends(
    env: dict[str, str], code: int
) -> None:
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("SLURM_JOB_ID", "SUBMITIT_FOLDER")
    }
    # The job imports this checkout, whichever one the pack is installed from.
    base["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), base.get("PYTHONPATH")])
    )
    out = subprocess.run(
        [sys.executable, "-c", JOB],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == code, out.stderr
    assert out.stdout == f"registered: {bool(code)}\nresult saved"
    assert "job 1 failed: the reason" in out.stderr

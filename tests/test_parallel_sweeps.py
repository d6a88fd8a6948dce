"""Sweeps beyond one job at a time: each job's share of the CPUs, failed jobs.

A job reads its launcher's config (joblib's ``n_jobs``, submitit's
``cpus_per_task``, the Ray task's ``num_cpus``) to know how many CPUs it may
use; a job that fails in a sweep leaves the others running, keeps its row in
``summary.csv`` with its error, and the sweep exits 1 naming it. The same
through Flower's engine, two SuperLinks at once, is in
``tests/system/test_flwr_run.py``.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from pathlib import Path

import pytest

from flwr_prox_strategies.experiment.sweeps import launchers
from flwr_prox_strategies.experiment.sweeps.launchers import available_cpus, job_cpus
from flwr_prox_strategies.experiment.sweeps.sweep import SweepFailed, summarise_sweep

from .helpers import small_sweep
from .system.engine import hydra_entry

JOBLIB = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
SLURM = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
RAY = "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher"
BASIC = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


@pytest.fixture
def four_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launchers, "available_cpus", lambda: 4)


@pytest.mark.parametrize(
    ("n_jobs", "jobs", "cpus", "at_once"),
    [
        (2, 8, 2, 2),  # 4 CPUs, 2 at a time
        (4, 8, 1, 4),
        (-1, 8, 1, 4),  # joblib: -1 is every CPU
        (-2, 8, 1, 3),  # all but one: 4 // 3
        (4, 2, 2, 2),  # 2 jobs under n_jobs=4 run 2 at a time
        (8, None, 1, 8),  # more jobs at once than CPUs: 1 each, never 0
    ],
)
def test_joblib_jobs_share_the_cpus(four_cpus, n_jobs, jobs, cpus, at_once) -> None:
    share = job_cpus({"_target_": JOBLIB, "n_jobs": n_jobs}, jobs=jobs, explicit=None)
    assert (share.cpus, share.at_once) == (cpus, at_once)
    assert f"{at_once} jobs at a time (joblib) on 4 CPUs" == share.reason


def test_a_cluster_job_uses_what_it_asked_for(
    four_cpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.delenv("SLURM_CPUS_ON_NODE", raising=False)
    slurm = {"_target_": SLURM, "cpus_per_task": 3}
    assert job_cpus(slurm, jobs=8, explicit=None).cpus == 3
    assert job_cpus({"_target_": SLURM}, jobs=8, explicit=None).cpus == 4
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "2")
    assert job_cpus({"_target_": SLURM}, jobs=8, explicit=None).cpus == 2
    ray = {"_target_": RAY, "ray": {"remote": {"num_cpus": 2.5}}}
    assert job_cpus(ray, jobs=8, explicit=None).cpus == 2
    assert job_cpus({"_target_": RAY, "ray": {}}, jobs=8, explicit=None).cpus == 1


def test_one_job_at_a_time_uses_every_cpu_and_the_config_wins(four_cpus) -> None:
    basic = {"_target_": BASIC}
    assert job_cpus(basic, jobs=8, explicit=None).cpus == 4
    joblib = {"_target_": JOBLIB, "n_jobs": 2}
    assert job_cpus(joblib, jobs=8, explicit=3).cpus == 3
    with pytest.raises(ValueError, match="cpus_per_job"):
        job_cpus(basic, jobs=8, explicit=0)


def _job(folder: Path, overrides: list[str], record: dict | None) -> None:
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text(
        "".join(f"- {o}\n" for o in overrides)
    )
    if record is None:
        return
    (folder / "job.json").write_text(json.dumps(record))
    rounds = [{"round": r, "central": {"accuracy": 0.5 + 0.1 * r}} for r in (0, 1)]
    (folder / "results.json").write_text(json.dumps({"rounds": rounds}))


def test_the_summary_keeps_failed_and_unfinished_jobs_in_job_order(
    tmp_path: Path,
) -> None:
    # Written out of order, as parallel jobs finish; job 10 sorts after job 9.
    _job(tmp_path / "10", ["seed=10"], {"overrides": "seed=10", "status": "completed"})
    _job(tmp_path / "2", ["seed=2"], None)  # killed before its end
    _job(
        tmp_path / "9",
        ["seed=9", "engine=flwr"],
        {"overrides": "seed=9", "status": "failed", "error": "RuntimeError: boom"},
    )
    outcome = summarise_sweep(tmp_path)
    assert outcome is not None
    with open(outcome.csv) as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["job"], r["status"]) for r in rows] == [
        ("2", "unfinished"),
        ("9", "failed"),
        ("10", "completed"),
    ]
    assert rows[0]["overrides"] == "seed=2" and "job.json" in rows[0]["error"]
    assert rows[1]["error"] == "RuntimeError: boom"
    assert outcome.plot is not None and outcome.plot.is_file()
    assert [r["job"] for r in outcome.not_completed] == ["2", "9"]


def test_a_sweep_whose_jobs_all_failed_writes_its_summary_without_a_plot(
    tmp_path: Path,
) -> None:
    _job(tmp_path / "0", ["seed=0"], {"overrides": "seed=0", "status": "failed"})
    outcome = summarise_sweep(tmp_path)
    assert outcome is not None and outcome.plot is None and outcome.csv.is_file()
    assert issubclass(SweepFailed, SystemExit)  # Hydra warns on other exceptions


@pytest.mark.long
def test_a_parallel_sweep_with_a_failed_job_finishes_the_others_and_exits_1(
    tmp_path: Path,
) -> None:
    out = small_sweep(
        tmp_path,
        *("hydra/launcher=joblib", "hydra.launcher.n_jobs=2"),
        *("strategy=fedprox", "strategy.mu=0.01,-1,1.0"),
    )
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-2:]
    assert "1 job(s) of the sweep did not complete" in last[0]
    assert last[1].startswith("job 1 (") and "mu must be a finite number" in last[1]
    printed = out.stdout + out.stderr
    assert printed.count("(2 jobs at a time (joblib) on") == 3
    with open(tmp_path / "summary.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["status"] for r in rows] == ["completed", "failed", "completed"]
    assert all(float(rows[i]["final-accuracy"]) > 0.5 for i in (0, 2))
    assert rows[1]["final-accuracy"] == "" and "mu" in rows[1]["error"]
    assert (tmp_path / "comparison.png").stat().st_size > 10_000


def test_a_job_slurm_restarted_resumes_from_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SLURM requeues a pre-empted job into the same folder, with
    SLURM_RESTART_COUNT set: the job continues from its checkpoint. Without
    a restart, a folder holding a run is refused (not overwritten)."""
    from flwr_prox_strategies.experiment.checkpoint import CheckpointError
    from flwr_prox_strategies.experiment.sweeps.sweep import (
        requeued_with_checkpoint,
        run_inprocess,
    )

    job = tmp_path / "0"
    small = ["num_clients=3", "model=logreg", "strategy=fedavg"]
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert not requeued_with_checkpoint(job)  # nothing there yet
    run_inprocess([*small, "num_rounds=2"], job, 3, threads=1)  # then pre-empted
    assert not requeued_with_checkpoint(job)  # not restarted: refused below
    with pytest.raises(CheckpointError, match="already holds a run"):
        run_inprocess([*small, "num_rounds=3"], job, 3, threads=1)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert requeued_with_checkpoint(job)
    results = json.loads(
        run_inprocess(
            [*small, "num_rounds=3"], job, 3, threads=1, resume=True
        ).read_text()
    )
    assert [r["round"] for r in results["rounds"]] == [0, 1, 2, 3]
    assert results["summary"]["complete"]


def test_a_ray_address_where_nothing_listens_fails_at_once() -> None:
    """Flower's Ray backend would wait for the cluster without end."""
    import socket

    from flwr_prox_strategies._processes import free_port
    from flwr_prox_strategies.experiment.sweeps.sweep import check_ray_address

    with pytest.raises(ValueError, match="host:port"):
        check_ray_address("10.0.0.1")
    with pytest.raises(ConnectionError, match="no Ray cluster at ray_address="):
        check_ray_address(f"127.0.0.1:{free_port()}", timeout=2)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        check_ray_address(f"127.0.0.1:{listening.getsockname()[1]}")
    check_ray_address("auto")  # left to Ray


def test_a_sweep_whose_jobs_wrote_nothing_here_fails(tmp_path: Path) -> None:
    """A Ray worker resolves a relative sweep folder in its own working
    folder: the sweep's process finds no job and must not end as a success."""
    from omegaconf import OmegaConf

    from flwr_prox_strategies.experiment.sweeps.sweep import SweepSummary

    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    with pytest.raises(SweepFailed, match=r"absolute hydra\.sweep\.dir"):
        SweepSummary().on_multirun_end(config)


@pytest.mark.parametrize(
    ("engine", "settings", "omp", "bound", "applied"),
    [
        ("inprocess", {}, None, 2, {"threads": 1}),
        # The user's OMP_NUM_THREADS: no bound of the job's, torch as told...
        ("inprocess", {}, "3", None, {"threads": 3}),
        # ... unless cpus_per_job, this sweep's own setting, says otherwise.
        ("inprocess", {"cpus_per_job": 2}, "3", 2, {"threads": 1}),
        ("flwr", {}, None, 2, {"job_cpus": 2}),
        ("flwr", {"ray_address": "10.0.0.1:6379"}, None, None, {"job_cpus": None}),
    ],
)
def test_the_cpus_a_job_records_are_the_bound_its_engine_gets(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    engine: str,
    settings: dict[str, str | int],
    omp: str | None,
    bound: int | None,
    applied: dict[str, int | None],
) -> None:
    from omegaconf import OmegaConf

    from flwr_prox_strategies.experiment.sweeps import sweep
    from flwr_prox_strategies.experiment.sweeps.launchers import JobCpus

    cfg = OmegaConf.create(
        {"num_clients": 3, "num_cpus_per_client": 1, "ray_address": "", **settings}
    )
    decided = sweep._cpu_bound(cfg, engine, JobCpus(2, "2 jobs at a time", 1), omp)
    assert decided == bound
    calls: dict[str, int | None] = {}

    def engine_called(*args: object, **kwargs: int | None) -> Path:
        calls.update({k: kwargs[k] for k in applied})
        return tmp_path / "results.json"

    monkeypatch.setattr(sweep, "run_inprocess", engine_called)
    monkeypatch.setattr(sweep, "flwr_run", engine_called)
    sweep._run_engine(cfg, engine, [], tmp_path, decided, omp)
    assert calls == applied


def _sweep_env(omp: str | None) -> dict[str, str]:
    """This environment, with the user's ``OMP_NUM_THREADS`` = ``omp`` (None: unset)."""
    from flwr_prox_strategies.experiment.sweeps.launchers import USER_THREADS_ENV

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", USER_THREADS_ENV)
    }
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    return env


def _jobs(sweep: Path) -> list[dict]:
    """The jobs' summaries (``job.json``), in job order, with their summary.csv row."""
    with open(sweep / "summary.csv") as handle:
        rows = list(csv.DictReader(handle))
    jobs = []
    for row in rows:
        record = json.loads((sweep / row["job"] / "job.json").read_text())
        jobs.append({**record, "row-cpus": row["cpus"]})
    return jobs


@pytest.mark.long
def test_inprocess_jobs_under_joblib_keep_to_their_share_not_joblibs_threads(
    tmp_path: Path,
) -> None:
    """Joblib sets OMP_NUM_THREADS in its workers (the CPUs // n_jobs): a job
    must not take it for the user's. The share is recorded and applied, and
    cpus_per_job is honoured; the user's own OMP_NUM_THREADS still counts."""
    sweep = tmp_path / "share"
    out = hydra_entry(
        *("-m", "engine=inprocess", "num_clients=3", "num_rounds=1", "model=logreg"),
        *("hydra/launcher=joblib", "hydra.launcher.n_jobs=2"),
        *("num_cpus_per_client=3", "cpus_per_job=null,3"),
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
        env=_sweep_env(None),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    share = max(available_cpus() // 2, 1)
    shared, explicit = _jobs(sweep)
    assert (shared["cpus"], shared["row-cpus"]) == (share, str(share))
    assert shared["torch-threads"] == min(3, share)
    assert (explicit["cpus"], explicit["row-cpus"]) == (3, "3")
    assert explicit["torch-threads"] == 3
    assert f"Job CPUs: {share} (2 jobs at a time (joblib) on" in out.stderr
    assert "Job CPUs: 3 (cpus_per_job=3)" in out.stderr

    sweep = tmp_path / "yours"
    out = hydra_entry(
        *("-m", "engine=inprocess", "num_clients=3", "num_rounds=1", "model=logreg"),
        *("hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "seed=0,1"),
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
        env=_sweep_env("2"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for job in _jobs(sweep):
        # The user's setting: no bound of the job's own, torch as told.
        assert (job["cpus"], job["row-cpus"], job["torch-threads"]) == (None, "", 2)
    assert "torch threads from your OMP_NUM_THREADS=2" in out.stderr


def test_a_job_tells_the_users_omp_num_threads_from_its_launchers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flwr_prox_strategies.experiment.sweeps.launchers import (
        USER_THREADS_ENV,
        record_user_threads,
        user_threads,
    )

    monkeypatch.delenv(USER_THREADS_ENV, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as a joblib or Ray worker has it
    # No record (a worker the sweep's environment did not reach): the
    # launchers that set it themselves set it, the others left the user's.
    assert user_threads({"_target_": JOBLIB}) is None
    assert user_threads({"_target_": RAY}) is None
    assert user_threads({"_target_": BASIC}) == "1"
    # Recorded in the sweep's process: what the user had, whatever is set now.
    monkeypatch.delenv("OMP_NUM_THREADS")
    record_user_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert user_threads({"_target_": JOBLIB}) is None
    monkeypatch.setenv(USER_THREADS_ENV, "3")
    record_user_threads()  # an outer sweep's record is the user's: kept
    assert user_threads({"_target_": RAY}) == "3"


@pytest.mark.slow
def test_inprocess_jobs_under_ray_keep_to_the_ray_tasks_cpus(tmp_path: Path) -> None:
    """Ray sets OMP_NUM_THREADS to a task's CPUs in its workers: the same as
    joblib's, through a real local Ray (about 50 s: Ray's start)."""
    pytest.importorskip("hydra_plugins.hydra_ray_launcher")
    sweep = tmp_path / "ray"
    out = hydra_entry(
        *("-m", "engine=inprocess", "num_clients=3", "num_rounds=1", "model=logreg"),
        *("hydra/launcher=ray", "num_cpus_per_client=2", "cpus_per_job=null,2"),
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
        env={
            **_sweep_env(None),
            "RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
        },
    )
    assert out.returncode == 0, out.stderr[-3000:]
    default, explicit = _jobs(sweep)
    assert (default["cpus"], default["row-cpus"], default["torch-threads"]) == (
        1,
        "1",
        1,
    )
    assert (explicit["cpus"], explicit["row-cpus"], explicit["torch-threads"]) == (
        2,
        "2",
        2,
    )
    printed = out.stdout + out.stderr
    assert "Job CPUs: 1 (a Ray task's default of 1 CPU)" in printed
    assert "Job CPUs: 2 (cpus_per_job=2)" in printed

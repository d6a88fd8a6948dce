"""A sweep on SLURM (Hydra's submitit launcher): what SLURM says of its jobs.

* :func:`exit_failed_after_result`: a job whose run failed keeps returning its
  row to the sweep (NaN, ``job.json`` with ``status: failed``), yet its process
  exits 1 once submitit has saved that result, so that SLURM (``sacct``,
  ``scontrol show job``) records the job as FAILED, not COMPLETED.
* :class:`PendingWatch`: in the submitting process, a thread that, after a
  bounded wait, asks ``squeue`` about the sweep's jobs that still wait to start
  and logs why they wait (squeue's reason) and what to do about it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from logging import DEBUG, WARNING
from pathlib import Path
from typing import Any

from flwr.common.logger import log

SLURM_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
PENDING_AFTER_S = 60.0
PENDING_EVERY_S = 300.0
# What squeue's reason means for a sweep, and what to change. A reason not here
# is printed as squeue gives it (`man squeue`, JOB REASON CODES).
REASONS = {
    "PartitionConfig": (
        "the request exceeds what the partition can ever give (CPUs per node, "
        "memory, time, nodes): it will never start; lower hydra.launcher."
        "cpus_per_task, mem_gb or timeout_min, or choose another hydra.launcher."
        "partition; `scontrol show partition` shows the limits"
    ),
    "PartitionTimeLimit": (
        "timeout_min exceeds the partition's MaxTime: it will never start; lower "
        "hydra.launcher.timeout_min (`scontrol show partition` shows MaxTime)"
    ),
    "PartitionNodeLimit": (
        "the nodes asked for exceed the partition's limits: it will never start; "
        "lower hydra.launcher.nodes (`scontrol show partition`)"
    ),
    "PartitionDown": (
        "the partition is down: it starts when an administrator brings it up "
        "(`sinfo` shows its state), or choose another hydra.launcher.partition"
    ),
    "PartitionInactive": (
        "the partition is inactive: choose another hydra.launcher.partition "
        "(`sinfo` lists them)"
    ),
    "Resources": (
        "the CPUs, memory or GPUs it asks for are in use by other jobs: it starts "
        "when they end (`squeue --start` estimates when); smaller requests may "
        "start sooner"
    ),
    "Priority": (
        "jobs of higher priority are ahead of it: it starts in turn (`sprio` "
        "shows the priorities, `squeue --start` an estimate)"
    ),
    "ReqNodeNotAvail": (
        "the nodes it could run on are down, drained or reserved: `sinfo -R` says "
        "why; it starts when they come back, or choose another partition"
    ),
    "Dependency": "it waits for other jobs it depends on to end",
    "BeginTime": "its start time is still in the future",
    "JobHeldUser": "held by its user: `scontrol release` the job to let it start",
    "JobHeldAdmin": "held by an administrator: ask them to release it",
}
QOS_OR_ASSOCIATION = (
    "a limit of the QOS or account holds it (jobs, CPUs, memory at once): it "
    "starts when your other jobs end; run fewer jobs at once "
    "(hydra.launcher.array_parallelism) or ask for less; `sacctmgr show qos` and "
    "`sacctmgr show assoc user=$USER` list the limits"
)


def explain(reason: str) -> str:
    """Say what squeue's pending reason means for a sweep and how to act on it.

    Parameters
    ----------
    reason : str
        squeue's reason code (``%r``), e.g. ``PartitionConfig``.

    Returns
    -------
    str
        The explanation; ``""`` for a reason this module does not know.
    """
    if reason in REASONS:
        return REASONS[reason]
    if reason.startswith(("QOS", "Assoc", "MaxCpuPerAccount", "MaxJobsPerAccount")):
        return QOS_OR_ASSOCIATION
    return ""


def exit_failed_after_result() -> bool:
    """Make a failed SLURM job's process exit 1 once its result is saved.

    A failed job of a multirun returns NaN so that the sweep gets its row and
    summarises it; submitit then pickles that result and returns, and SLURM
    would record the job as COMPLETED. An exit handler registered now runs
    after that (submitit's ``process_job`` has returned): it flushes logging and
    the standard streams, then ends the process with status 1, so the job's
    state is FAILED while the sweep still reads the saved result (submitit's
    ``Job.results`` reads the result file; it never asks the job's state when
    the file is there).

    Only in a job that submitit runs under SLURM (``SLURM_JOB_ID`` and
    ``SUBMITIT_FOLDER`` set); elsewhere (a local multirun, submitit's local
    executor) nothing changes.

    Returns
    -------
    bool
        Whether the handler was registered.
    """
    if not (os.environ.get("SLURM_JOB_ID") and os.environ.get("SUBMITIT_FOLDER")):
        return False
    atexit.unregister(_exit_failed)  # once, however many failures
    atexit.register(_exit_failed)
    return True


def _exit_failed() -> None:
    """Flush what the job printed, then end the process with status 1."""
    # os._exit skips the exit handlers still to run (logging's own flush among
    # them): flush here what would otherwise be lost.
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        # A closed or broken stream has nothing more to save.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(1)


def pending_jobs(
    *, name: str, user: str, job_ids: set[str] | None = None
) -> dict[str, list[str]]:
    """Ask ``squeue`` for a user's pending jobs of a name, grouped by reason.

    Parameters
    ----------
    name : str
        The jobs' name (submitit's launcher: ``hydra.launcher.name``).
    user : str
        Their user (a name or a numeric id).
    job_ids : set[str] or None, default None
        Job ids (``123`` or array tasks ``123_0``): only the jobs of these
        (arrays) count. None: every job of that name and user.

    Returns
    -------
    dict[str, list[str]]
        squeue's reason, e.g. ``PartitionConfig``, to the ids of the pending
        jobs (array tasks one by one, ``123_0``) it holds.

    Raises
    ------
    OSError
        When ``squeue`` cannot be run.
    subprocess.CalledProcessError
        When it fails (no controller, say).
    """
    out = subprocess.run(
        [
            "squeue",
            "--noheader",
            "--array",
            "--states=PENDING",
            f"--user={user}",
            f"--name={name}",
            "--format=%i|%r",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    arrays = {job.split("_")[0] for job in job_ids} if job_ids is not None else None
    by_reason: dict[str, list[str]] = {}
    for line in out.splitlines():
        job, _, reason = line.strip().partition("|")
        if not job or (arrays is not None and job.split("_")[0] not in arrays):
            continue
        by_reason.setdefault(reason or "None", []).append(job)
    return by_reason


def submitted_ids(submitit_folder: str, since: float) -> set[str]:
    """Job ids submitit has filed under its folder since a time.

    submitit moves each job's pickle into ``submitit_folder`` with ``%j``
    replaced by the job's id (``123_0`` for an array task) once ``sbatch`` has
    answered: the folders made since the sweep started are its jobs.

    Parameters
    ----------
    submitit_folder : str
        The launcher's ``submitit_folder``, with ``%j`` as its last part.
    since : float
        The sweep's start (``time.time()``); older folders, of an earlier
        sweep in the same folder, are not its.

    Returns
    -------
    set[str]
        The ids; empty when none is there yet or the folder has no ``%j``.
    """
    folder = Path(submitit_folder)
    if folder.name != "%j" or not folder.parent.is_dir():
        return set()
    # A second of slack: file times may be coarser than the clock.
    return {
        entry.name
        for entry in folder.parent.iterdir()
        # submitit's own folders (.submission_file_...) are not jobs.
        if entry.name[:1].isdigit()
        and entry.is_dir()
        and entry.stat().st_mtime >= since - 1
    }


class PendingWatch:
    """Warn, from the submitting process, while a sweep's SLURM jobs stay pending.

    After ``after`` seconds, then every ``every`` seconds until :meth:`stop`,
    a daemon thread asks ``squeue`` for the sweep's pending jobs and logs one
    WARNING per reason: how many, their ids, squeue's reason and what it
    means. Nothing is logged while no job is pending.

    Parameters
    ----------
    after : float, default 60
        Seconds to wait after the sweep starts before the first look.
    every : float, default 300
        Seconds between later looks.
    """

    def __init__(
        self, *, after: float = PENDING_AFTER_S, every: float = PENDING_EVERY_S
    ) -> None:
        if after < 0 or every <= 0:
            raise ValueError(
                f"pending_after must be >= 0 and pending_every > 0, got {after}, "
                f"{every}"
            )
        self.after = float(after)
        self.every = float(every)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0

    def __getstate__(self) -> dict[str, float]:
        """Pickle the settings only: submitit pickles the launcher, callbacks too."""
        return {"after": self.after, "every": self.every}

    def __setstate__(self, state: dict[str, float]) -> None:
        """Unpickle a watch that has not started (a job's copy never does)."""
        self.__init__(**state)  # type: ignore[misc]

    def start(self, launcher: Mapping[str, Any]) -> bool:
        """Start watching when ``launcher`` is submitit's SLURM launcher.

        Parameters
        ----------
        launcher : Mapping[str, Any]
            The sweep's ``hydra.launcher`` configuration.

        Returns
        -------
        bool
            Whether a watch started (not for other launchers).
        """
        if launcher.get("_target_") != SLURM_LAUNCHER:
            return False
        name = str(launcher.get("name"))
        folder = str(launcher.get("submitit_folder") or "")
        self._started = time.time()
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._watch,
            args=(name, folder),
            name="slurm-pending-watch",
            daemon=True,  # never keeps a sweep's process alive
        )
        self._thread.start()
        return True

    def stop(self) -> None:
        """Stop watching (the sweep ended); return at once if none started."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _watch(self, name: str, folder: str) -> None:
        wait = self.after
        while not self._stop.wait(wait):
            wait = self.every
            try:
                self.check(name, folder)
            except (OSError, subprocess.SubprocessError) as err:
                # squeue is missing or failing: the sweep goes on, unwatched.
                log(DEBUG, "Sweep: cannot ask squeue about pending jobs: %s", err)

    def check(self, name: str, folder: str) -> int:
        """Log the sweep's pending jobs once; return how many there are.

        Parameters
        ----------
        name : str
            The jobs' name (``hydra.launcher.name``).
        folder : str
            The launcher's ``submitit_folder``, where the jobs' ids show.

        Returns
        -------
        int
            The number of pending jobs.
        """
        ids = submitted_ids(folder, self._started) or None
        by_reason = pending_jobs(name=name, user=str(os.getuid()), job_ids=ids)
        waited = round(time.time() - self._started)
        for reason, jobs in sorted(by_reason.items()):
            meaning = explain(reason)
            log(
                WARNING,
                "Sweep: %d SLURM job(s) still pending after %d s: %s; squeue's "
                "reason: %s%s",
                len(jobs),
                waited,
                ", ".join(jobs),
                reason,
                f" ({meaning})" if meaning else "",
            )
        return sum(len(jobs) for jobs in by_reason.values())

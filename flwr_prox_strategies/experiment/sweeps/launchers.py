"""The CPUs one job of a sweep may use, read from the Hydra launcher that runs it.

Jobs run side by side (Hydra's joblib launcher), on a cluster's allocation
(submitit's SLURM launcher) or as Ray tasks (Hydra's Ray launcher). Each job
then gets a share of the CPUs, and the job keeps to it: under ``engine=flwr``
its Ray gets that many CPUs (``init-args-num-cpus``), under
``engine=inprocess`` torch gets at most that many threads. Without the share,
two jobs on 2 cores each start a Ray of 2 CPUs and a thread per core, and wait
for each other.

Hydra's joblib and Ray launchers set ``OMP_NUM_THREADS`` in their workers
themselves (joblib: the CPUs // ``n_jobs``; Ray: the task's CPUs), so a job
cannot read the user's setting there: the sweep's own process records it in
:data:`USER_THREADS_ENV` before the launcher starts its workers
(:func:`record_user_threads`), and a job reads it back (:func:`user_threads`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ...ops.cpus import available_cpus

#: conf key: the CPUs of one job (null: from the launcher, see :func:`job_cpus`).
CPUS_PER_JOB = "cpus_per_job"
#: Environment variable: the user's ``OMP_NUM_THREADS`` as the sweep's own
#: process saw it ("": unset), which the launcher's workers inherit.
USER_THREADS_ENV = "FLWR_PROX_USER_OMP_NUM_THREADS"
#: Launchers that set ``OMP_NUM_THREADS`` in their workers, by class name.
_SETS_THREADS = frozenset({"JoblibLauncher", "RayLauncher"})


def record_user_threads() -> None:
    """Record the user's ``OMP_NUM_THREADS`` for the jobs a launcher will start.

    Called in the sweep's own process before its launcher starts workers. A
    value recorded already (a sweep started by a job of another) is kept: it
    is the user's.
    """
    os.environ.setdefault(USER_THREADS_ENV, os.environ.get("OMP_NUM_THREADS", ""))


def user_threads(launcher: Mapping[str, Any]) -> str | None:
    """Return the user's ``OMP_NUM_THREADS`` in a job (None: the user set none).

    Parameters
    ----------
    launcher : Mapping[str, Any]
        The job's ``hydra.launcher`` config (its ``_target_`` names the launcher).

    Returns
    -------
    str | None
        What :func:`record_user_threads` recorded; without a record, the
        environment's value, except under a launcher that sets it itself
        (joblib, Ray: a worker on another machine, whose environment the
        record did not reach), where it is the launcher's, not the user's.
    """
    if USER_THREADS_ENV in os.environ:
        return os.environ[USER_THREADS_ENV] or None
    name = str(launcher.get("_target_", "")).rsplit(".", 1)[-1]
    if name in _SETS_THREADS:
        return None
    return os.environ.get("OMP_NUM_THREADS") or None


@dataclass(frozen=True)
class JobCpus:
    """How many CPUs a job uses, and why (for its log line).

    Attributes
    ----------
    cpus : int
        The CPUs the job may use (at least 1).
    reason : str
        Where the number comes from: ``"2 jobs at a time (joblib) on 2 CPUs"``.
    at_once : int
        How many jobs of the sweep run at a time here (1 when the launcher
        does not say: a cluster's scheduler decides).
    """

    cpus: int
    reason: str
    at_once: int = 1


def _joblib(launcher: Mapping[str, Any], jobs: int | None) -> JobCpus:
    cpus = available_cpus()
    n_jobs = int(launcher.get("n_jobs") or 1)
    # joblib's convention: -1 is every CPU, -2 all but one, ...
    at_once = n_jobs if n_jobs > 0 else max(cpus + 1 + n_jobs, 1)
    if jobs:
        at_once = min(at_once, jobs)
    return JobCpus(
        max(cpus // at_once, 1),
        f"{at_once} jobs at a time (joblib) on {cpus} CPUs",
        at_once,
    )


def _submitit(launcher: Mapping[str, Any], jobs: int | None) -> JobCpus:
    asked = launcher.get("cpus_per_task")
    if asked:
        return JobCpus(int(asked), "the launcher's cpus_per_task")
    # SLURM sets it when the job asked for CPUs some other way.
    given = os.environ.get("SLURM_CPUS_PER_TASK") or os.environ.get(
        "SLURM_CPUS_ON_NODE"
    )
    if given:
        return JobCpus(int(given), "SLURM's allocation")
    return JobCpus(available_cpus(), "every CPU of the node (no cpus_per_task)")


def _ray(launcher: Mapping[str, Any], jobs: int | None) -> JobCpus:
    asked = (launcher.get("ray") or {}).get("remote", {}).get("num_cpus")
    if asked:
        return JobCpus(max(math.floor(float(asked)), 1), "the Ray task's num_cpus")
    return JobCpus(1, "a Ray task's default of 1 CPU")


#: Hydra launchers that run jobs side by side or elsewhere, by class name
#: (the end of their ``_target_``): how many CPUs a job of theirs may use.
#: Any other launcher (Hydra's basic one) runs one job at a time here.
_SHARES: dict[str, Callable[[Mapping[str, Any], int | None], JobCpus]] = {
    "JoblibLauncher": _joblib,
    "SlurmLauncher": _submitit,
    "LocalLauncher": _submitit,
    "RayLauncher": _ray,
}


def job_cpus(
    launcher: Mapping[str, Any], *, jobs: int | None, explicit: int | None
) -> JobCpus:
    """Return the CPUs one job of a sweep may use.

    Parameters
    ----------
    launcher : Mapping[str, Any]
        The job's ``hydra.launcher`` config (its ``_target_`` names the launcher).
    jobs : int | None
        The sweep's number of jobs, when known: 2 jobs under ``n_jobs=4`` run
        2 at a time.
    explicit : int | None
        ``cpus_per_job`` from the config, which wins when set.

    Returns
    -------
    JobCpus
        The count and where it comes from.

    Raises
    ------
    ValueError
        When ``explicit`` is below 1.
    """
    if explicit is not None:
        if int(explicit) < 1:
            raise ValueError(f"{CPUS_PER_JOB} must be >= 1 or null, got {explicit}")
        return JobCpus(int(explicit), f"{CPUS_PER_JOB}={explicit}")
    name = str(launcher.get("_target_", "")).rsplit(".", 1)[-1]
    share = _SHARES.get(name)
    if share is None:
        return JobCpus(available_cpus(), "one job at a time")
    return share(launcher, jobs)

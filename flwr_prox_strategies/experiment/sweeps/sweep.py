"""Hydra (multi)run jobs and the sweep summary.

Each job runs the same ServerApp/ClientApp code as ``flwr run .``:

* ``engine=flwr`` (default) starts ``flwr run <app> --stream`` with the job's
  overrides on a SuperLink of the job's own: Flower's own engine (a simulation
  SuperLink, Ray), so that jobs can run side by side;
* ``engine=inprocess`` runs :func:`~.server.run_experiment` on an
  :class:`~flwr_prox_strategies.core.transport.inprocess.InProcessGrid` with the same
  ClientApp, with no engine start-up cost (quick sweeps, tests).

After a multirun, :class:`SweepSummary` writes ``summary.csv`` (one row per job)
and ``comparison.png`` beside the job folders (:mod:`.overview`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from logging import ERROR, INFO
from pathlib import Path
from typing import Any

from flwr.common.logger import log
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from ..._executables import flower_env, flower_executable
from .. import RUN_OUTPUT_DIR, RUN_OVERRIDES, RUN_RESUME
from ..appdir import make_client_app, write_app_dir
from ..checkpoint import CHECKPOINT_FILE, CLIENT_STATE_DIR
from ..record import log_summary
from ..results import OBJECTIVES, RESULTS_FILE
from ..track import sweep_overrides, where_for_sweep
from .launchers import (
    CPUS_PER_JOB,
    JobCpus,
    available_cpus,
    job_cpus,
    record_user_threads,
    user_threads,
)
from .overview import (  # noqa: F401
    JOB_SUMMARY,
    SUMMARY_FIELDS,
    SweepOutcome,
    _runner_only,
    _sweep_arguments,
    _sweep_size_now,
    log_progress,
    plot_comparison,
    summarise_sweep,
    sweep_size,
    swept_keys,
)
from .slurm import (
    PENDING_AFTER_S,
    PENDING_EVERY_S,
    PendingWatch,
    exit_failed_after_result,
)
from .superlink import CONNECTION, PrivateSuperLink, started_run_id

APP_DIR_ENV = "FLWR_PROX_APP_DIR"
#: Environment variable a search sets (``hydra.job.env_set``) on the job of a
#: trial it runs again after an interruption: the job continues its run from
#: the checkpoint in its folder (:func:`rerun_of_cut_short`).
CUT_SHORT_ENV = "FLWR_PROX_CUT_SHORT"
ENGINES = ("flwr", "inprocess")
# Project names of this pack's Flower apps: the repository's, and the one
# appdir.write_app_dir writes for an installed pack.
_APP_NAMES = ("flwr-prox-strategies", "flwr-prox-strategies-app")


def _is_app(folder: Path, *, ours: bool) -> bool:
    """Whether ``folder`` holds a Flower app (this pack's own when ``ours``)."""
    pyproject = folder / "pyproject.toml"
    if not pyproject.is_file():
        return False
    text = pyproject.read_text()
    if "[tool.flwr.app]" not in text:
        return False
    return not ours or any(f'name = "{name}"' in text for name in _APP_NAMES)


@functools.cache
def _written_app_dir() -> Path:
    folder = write_app_dir(Path(tempfile.mkdtemp(prefix="flwr-prox-app-")))
    log(
        INFO,
        "No checkout of flwr-prox-strategies here: running the installed pack's "
        "Flower app, written to %s (set %s to use another app folder)",
        folder,
        APP_DIR_ENV,
    )
    return folder


def app_dir() -> Path:
    """Return the Flower app folder (``pyproject.toml``) given to ``flwr run``.

    In order: ``$FLWR_PROX_APP_DIR``; the checkout this module lives in; the
    current folder when it is a checkout of the pack; else a folder written once
    per process whose ``pyproject.toml`` names the installed package's apps
    (:func:`~.appdir.write_app_dir`), so a pip-installed pack sweeps too.

    Raises
    ------
    FileNotFoundError
        When ``$FLWR_PROX_APP_DIR`` is set but holds no Flower app.
    """
    explicit = os.environ.get(APP_DIR_ENV, "")
    if explicit:
        if not _is_app(Path(explicit), ours=False):
            raise FileNotFoundError(
                f"{APP_DIR_ENV}={explicit} holds no Flower app (a pyproject.toml "
                "with [tool.flwr.app])"
            )
        return Path(explicit).resolve()
    for candidate in (Path(__file__).resolve().parents[3], Path.cwd()):
        if _is_app(candidate, ours=True):
            return candidate.resolve()
    return _written_app_dir()


def flwr_run(
    overrides: Sequence[str],
    output_dir: Path,
    *,
    num_supernodes: int,
    cpus_per_client: float = 1,
    job_cpus: int | None = None,
    resume: bool = False,
    ray_address: str = "",
    omp_num_threads: str | None = None,
    log_file: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> Path:
    """Run one experiment with ``flwr run --stream``; return its ``results.json``.

    The run goes to a SuperLink of its own (:class:`.superlink.PrivateSuperLink`:
    a free port, its own Flower home, ``output_dir`` as its working folder), not
    to Flower's managed one on fixed ports, so that jobs can run side by side.
    ``flwr run --stream`` exits 0 even when the ServerApp fails, so success is
    judged by the results file the ServerApp writes last, and a failure reports
    the run's status as Flower records it.

    ``job_cpus`` (None: every CPU) bounds the run's Ray (``init-args-num-cpus``)
    and a client's CPUs, so that jobs side by side share the cores instead of
    each starting a Ray of all of them; the ServerApp and the clients get
    ``OMP_NUM_THREADS`` = ``omp_num_threads``: None, the environment's when
    set, else a client's CPUs; ``""``, a client's CPUs whatever the
    environment holds (a sweep's job in a launcher's worker, whose
    ``OMP_NUM_THREADS`` is the launcher's, not the user's). ``resume``
    continues the run from the checkpoint in ``output_dir``.

    ``ray_address`` (``host:port`` of a running Ray cluster) runs the
    simulation's ClientApps on that cluster instead (``RAY_ADDRESS`` in the
    SuperLink's environment): its nodes' CPUs, not ``job_cpus``, bound the
    actors, and Ray refuses ``init-args-num-cpus`` when it attaches. Flower
    disconnects when the run ends; the cluster stays up.
    """
    override_str = shlex.join(overrides)
    if "'" in override_str:
        raise ValueError(f"overrides cannot contain single quotes: {override_str}")
    if ray_address:
        check_ray_address(ray_address)
        client_cpus = float(cpus_per_client)
        ray_init = ""
    else:
        ray_cpus = job_cpus or available_cpus()
        client_cpus = min(float(cpus_per_client), ray_cpus)
        ray_init = f" init-args-num-cpus={ray_cpus}"
    threads = str(max(math.floor(client_cpus), 1))
    if omp_num_threads is None:
        omp_num_threads = os.environ.get("OMP_NUM_THREADS", threads)
    run_env = {
        **flower_env(),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "OMP_NUM_THREADS": omp_num_threads or threads,
        **(env or {}),
    }
    log_file = log_file or output_dir / "flwr.log"
    output_dir.mkdir(parents=True, exist_ok=True)
    with PrivateSuperLink(
        cwd=output_dir,
        env=run_env,
        log_file=output_dir / "superlink.log",
        ray_address=ray_address,
    ) as link:
        command = [
            flower_executable("flwr"),
            "run",
            str(app_dir()),
            CONNECTION,
            "--stream",
            "--federation-config",
            f"num-supernodes={num_supernodes} client-resources-num-cpus="
            f"{client_cpus:g}{ray_init}",
            "--run-config",
            f"{RUN_OVERRIDES}='{override_str}' {RUN_OUTPUT_DIR}='{output_dir}'"
            + (f" {RUN_RESUME}='{output_dir}'" if resume else ""),
        ]
        log(INFO, "On its own SuperLink (port %d): %s", link.port, shlex.join(command))
        with open(log_file, "w") as sink:
            proc = subprocess.run(
                command,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=link.env,
                timeout=timeout,
                check=False,
            )
        results = output_dir / RESULTS_FILE
        done = results.is_file() and json.loads(results.read_text()).get(
            "summary", {}
        ).get("complete")
        if proc.returncode == 0 and done:
            return results
        run_id = started_run_id(log_file.read_text())
        record = link.run_status(run_id) if run_id else {}
    tail = "".join(log_file.read_text().splitlines(keepends=True)[-30:])
    status = record.get("status", "unknown")
    details = record.get("status-details") or ""
    raise RuntimeError(
        f"flwr run failed (exit {proc.returncode}, run {run_id}: {status}"
        f"{' - ' + details if details else ''}; results complete: {bool(done)}); "
        f"log {log_file}:\n{tail}"
    )


def check_ray_address(address: str, timeout: float = 10.0) -> None:
    """Fail at once when nothing listens at a Ray cluster's address.

    Flower's Ray backend would wait for the cluster without end: the run
    hangs in its first round, not failing before ``round_timeout``.

    Parameters
    ----------
    address : str
        ``host:port`` of the cluster's head (its GCS). ``auto`` and Ray Client
        addresses (``ray://...``) are left to Ray.
    timeout : float, default 10
        Seconds to wait for the connection.

    Raises
    ------
    ValueError
        When ``address`` is not ``host:port``.
    ConnectionError
        When nothing accepts a connection there.
    """
    if address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"ray_address must be host:port, got {address!r}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout):
            pass
    except OSError as err:
        raise ConnectionError(
            f"no Ray cluster at ray_address={address} ({err}): start one with "
            f"`ray start --head --port {port}`, or leave ray_address empty"
        ) from err


def run_inprocess(
    overrides: Sequence[str],
    output_dir: Path,
    num_clients: int,
    *,
    threads: int | None = None,
    resume: bool = False,
    used: dict[str, Any] | None = None,
) -> Path:
    """Run one experiment on an in-process grid with the app's ClientApp.

    ``resume`` continues the run from the checkpoint in ``output_dir``;
    ``used``, when given, gets ``torch-threads``: torch's intra-op threads
    while the run ran.

    ``threads``: torch's intra-op threads while it runs (None: leave them as
    they are). The sweep gives ``num_cpus_per_client``, what a client gets under
    ``engine=flwr`` (Ray sets ``OMP_NUM_THREADS`` to an actor's CPUs), unless
    ``OMP_NUM_THREADS`` is set. Torch's default, a thread per core, made 3
    rounds of 20 clients (E=5, the digits MLP) take 56 s instead of 8 s on 2
    cores shared with other work: the threads wait for each other.
    """
    from ...core.transport.inprocess import InProcessGrid
    from ..server import run_experiment

    run_config: dict[str, int | float | str | bool] = {
        RUN_OVERRIDES: shlex.join(overrides),
        RUN_OUTPUT_DIR: str(output_dir),
        **({RUN_RESUME: str(output_dir)} if resume else {}),
    }
    grid = InProcessGrid(
        make_client_app(), num_nodes=num_clients, run_config=run_config
    )
    with _torch_threads(threads) as in_use:
        if used is not None:
            used["torch-threads"] = in_use
        run_experiment(grid, run_config)
    return output_dir / RESULTS_FILE


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[int]:
    """Run the block with ``threads`` torch threads (None: as they are); yield them."""
    import torch

    if threads is None:
        yield torch.get_num_threads()
        return
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def run_job(cfg: DictConfig) -> float:
    """Run the current Hydra job; return its final accuracy (for optimisers).

    The job writes ``job.json`` (its summary) in its folder. In a multirun, a
    job that fails records ``status: failed`` and its error there and returns
    NaN instead of raising, so that the summary lists it and the sweep's end
    (:class:`SweepSummary`) fails the sweep naming it; a single run raises.
    """
    hydra_cfg = HydraConfig.get()
    job_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = [o for o in hydra_cfg.overrides.task if not _runner_only(o)]
    engine = str(cfg.engine)
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    ran = overrides
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    sweep_dir = Path(hydra_cfg.sweep.dir)
    arguments = _sweep_arguments(sweep_dir) if multirun else []
    total = _sweep_size_now(arguments) if multirun else None
    explicit = cfg.get(CPUS_PER_JOB)
    share = job_cpus(
        hydra_cfg.launcher,
        jobs=total,
        explicit=None if explicit is None else int(explicit),
    )
    if multirun:
        swept = swept_keys(arguments)
        ran = [*overrides, *sweep_overrides(cfg, sweep_dir, swept)]
        log_progress(
            sweep_dir,
            int(hydra_cfg.job.num),
            overrides,
            total=total,
            at_once=share.at_once,
        )
    omp = user_threads(hydra_cfg.launcher)
    bound = _cpu_bound(cfg, engine, share, omp)
    record: dict[str, Any] = {
        "overrides": " ".join(overrides),
        "engine": engine,
        "cpus": bound,
    }
    start = time.monotonic()
    try:
        results_path = _run_engine(cfg, engine, ran, job_dir, bound, omp, record)
    except Exception as err:
        if not multirun:
            raise
        record.update(
            status="failed",
            # One line: the summary's row and the log's record.
            error=" ".join(f"{type(err).__name__}: {err}".split())[:2000],
            **{"wall-time-s": round(time.monotonic() - start, 2)},
        )
        (job_dir / JOB_SUMMARY).write_text(json.dumps(record, indent=2))
        log(ERROR, "Sweep: job %s failed: %s", job_dir.name, record["error"])
        exit_failed_after_result()  # SLURM records it FAILED; the sweep its row
        return float("nan")
    results = json.loads(results_path.read_text())
    record.update(
        status="completed",
        **{k: results["summary"].get(k) for k in (*OBJECTIVES, "rounds-evaluated")},
        **{"wall-time-s": round(time.monotonic() - start, 2)},
        strategy=results.get("strategy"),
    )
    (job_dir / JOB_SUMMARY).write_text(json.dumps(record, indent=2))
    if engine == "flwr":  # the run's own lines went to its log: say what it gave
        log_summary(results["summary"], float(cfg["target_accuracy"]))
        log(INFO, "Output folder: %s", job_dir)
    final = record["final-accuracy"]
    return float(final) if final is not None else float("nan")


def _cpu_bound(
    cfg: DictConfig, engine: str, share: JobCpus, omp: str | None = None
) -> int | None:
    """Decide and log the CPU bound the job applies (None: it applies none).

    ``engine=flwr`` gives its own Ray the share (``init-args-num-cpus``), but a
    ``ray_address`` cluster's CPUs bound its actors instead; ``engine=inprocess``
    sets torch's threads to ``min(num_cpus_per_client, share)``, unless the
    user's ``OMP_NUM_THREADS`` sets them and ``cpus_per_job`` does not (the
    setting of this sweep wins over the shell's). :func:`_run_engine` applies
    what this returns, and the job's summary records it: one decision for both.

    Parameters
    ----------
    cfg : DictConfig
        The job's config (``ray_address``, ``cpus_per_job``).
    engine : str
        ``flwr`` or ``inprocess``.
    share : JobCpus
        The job's share of the CPUs (:func:`~.launchers.job_cpus`).
    omp : str | None, default None
        The user's ``OMP_NUM_THREADS`` (:func:`~.launchers.user_threads`),
        never a launcher's: None when the user set none.
    """
    if engine == "flwr" and cfg.get("ray_address"):
        log(INFO, "Job CPUs: the Ray cluster's at ray_address=%s", cfg.ray_address)
        return None
    if engine == "inprocess" and omp and cfg.get(CPUS_PER_JOB) is None:
        log(
            INFO,
            "Job CPUs: torch threads from your OMP_NUM_THREADS=%s (%s)",
            omp,
            share.reason,
        )
        return None
    log(INFO, "Job CPUs: %d (%s)", share.cpus, share.reason)
    return share.cpus


def _run_engine(
    cfg: DictConfig,
    engine: str,
    overrides: list[str],
    job_dir: Path,
    cpus: int | None,
    omp: str | None = None,
    record: dict[str, Any] | None = None,
) -> Path:
    """Run the job on its engine within ``cpus`` CPUs; return its results file.

    Parameters
    ----------
    cfg : DictConfig
        The job's config.
    engine : str
        ``flwr`` or ``inprocess``.
    overrides : list[str]
        The overrides the run is composed from.
    job_dir : Path
        The job's folder: the run's output folder.
    cpus : int | None
        The bound :func:`_cpu_bound` decided (None: none of the job's).
    omp : str | None, default None
        The user's ``OMP_NUM_THREADS`` (None: the user set none), which
        ``engine=flwr`` hands to Flower; the environment's may be a
        launcher's.
    record : dict[str, Any] | None, default None
        The job's summary: ``engine=inprocess`` adds ``torch-threads``.
    """
    resume = requeued_with_checkpoint(job_dir) or rerun_of_cut_short(job_dir)
    if engine == "flwr":
        return flwr_run(
            overrides,
            job_dir,
            num_supernodes=int(cfg["num_clients"]),
            cpus_per_client=float(cfg["num_cpus_per_client"]),
            job_cpus=cpus,
            resume=resume,
            ray_address=str(cfg.get("ray_address") or ""),
            omp_num_threads=omp or "",
        )
    threads = None
    if cpus is not None:
        threads = min(math.ceil(float(cfg["num_cpus_per_client"])), cpus)
    elif omp and omp.isdigit() and int(omp) > 0:
        # Applied, not left to the environment: a launcher's worker may hold
        # the user's OMP_NUM_THREADS beside its own MKL_NUM_THREADS (joblib
        # sets 1), which torch's default follows.
        threads = int(omp)
    return run_inprocess(
        overrides,
        job_dir,
        int(cfg["num_clients"]),
        threads=threads,
        resume=resume,
        used=record,
    )


def requeued_with_checkpoint(job_dir: Path) -> bool:
    """Return True when SLURM restarted this job and its folder has a checkpoint.

    A pre-empted (or timed-out, with submitit's ``max_num_timeout``) job is
    requeued by SLURM into the same folder (``SLURM_RESTART_COUNT`` > 0): it
    continues from its last checkpoint (run config ``resume``) instead of
    failing on the folder that already holds its run.
    """
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if restarts < 1 or not (job_dir / CHECKPOINT_FILE).is_file():
        return False
    log(
        INFO,
        "Job: SLURM restarted it (%d time(s)): resuming from %s",
        restarts,
        job_dir / CHECKPOINT_FILE,
    )
    return True


def rerun_of_cut_short(job_dir: Path) -> bool:
    """Return True when this job continues a search trial cut short in its folder.

    A search (``hydra/sweeper=search``) runs a trial an interruption cut short
    again in the same job folder, with :data:`CUT_SHORT_ENV` set. With the
    checkpoint the cut-short run wrote there, the job continues from it (run
    config ``resume``); without one (cut short before its first checkpoint) it
    starts again from round 0, and client state the cut-short run mirrored
    (which no checkpoint pairs with, so no run can use) is moved aside to
    ``client-state.cut-short``, else the new run would refuse the folder.

    Parameters
    ----------
    job_dir : Path
        The job's folder (``hydra.runtime.output_dir``).

    Returns
    -------
    bool
        Whether the job resumes from ``job_dir``'s checkpoint.
    """
    if not os.environ.get(CUT_SHORT_ENV):
        return False
    if (job_dir / CHECKPOINT_FILE).is_file():
        log(
            INFO,
            "Job: its search trial was cut short: resuming from %s",
            job_dir / CHECKPOINT_FILE,
        )
        return True
    states = job_dir / CLIENT_STATE_DIR
    if states.is_dir():
        aside = job_dir / f"{CLIENT_STATE_DIR}.cut-short"
        if aside.exists():  # cut short twice before a checkpoint: keep the last
            shutil.rmtree(aside)
        states.rename(aside)
    log(
        INFO,
        "Job: its search trial was cut short before its first checkpoint: it "
        "starts again from round 0",
    )
    return False


class PrintedByFlower(logging.Filter):
    """Leave out the records of Flower's logger: its own handler prints them.

    The console handler of the Hydra entry point's job logging
    (``conf/hydra/job_logging/flower.yaml``) uses it, so each of Flower's
    lines is printed once, in Flower's format.
    """

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: D102
        return not (record.name == "flwr" or record.name.startswith("flwr."))


class SweepFailed(SystemExit):
    """Some jobs of a sweep failed or never ended (the others ran to their end).

    A :class:`SystemExit` with the message: Hydra turns a callback's
    exceptions into warnings, and the sweep's exit status must say it failed
    (1, with the message on stderr).
    """


class UserThreads(Callback):
    """Hydra callback: record the user's ``OMP_NUM_THREADS`` for the sweep's jobs.

    It runs in the sweep's own process before the launcher starts workers,
    which inherit the record: joblib's and Ray's workers have their launcher's
    ``OMP_NUM_THREADS`` (:func:`~.launchers.record_user_threads`).
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:  # noqa: D102
        record_user_threads()


class SweepSummary(Callback):
    """Hydra callback: summarise a multirun when it ends.

    When a job failed or never ended, it raises :class:`SweepFailed` after the
    summary is written, naming those jobs and their errors: the sweep exits
    with status 1 and that message. So it does when no job folder is there.

    With submitit's SLURM launcher, it also warns while the sweep's jobs stay
    pending, saying squeue's reason (:class:`.slurm.PendingWatch`).

    Parameters
    ----------
    pending_after : float, default 60
        Seconds after the sweep's start before the first look at pending jobs.
    pending_every : float, default 300
        Seconds between later looks while jobs stay pending.
    """

    def __init__(
        self,
        pending_after: float = PENDING_AFTER_S,
        pending_every: float = PENDING_EVERY_S,
    ) -> None:
        self._pending = PendingWatch(after=pending_after, every=pending_every)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:  # noqa: D102
        self._pending.start(config.hydra.launcher)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:  # noqa: D102
        self._pending.stop()
        sweep_dir = Path(config.hydra.sweep.dir)
        outcome = summarise_sweep(sweep_dir)
        where = where_for_sweep(config, sweep_dir)
        if where:
            log(INFO, "Sweep tracked; to look: %s", where)
        if outcome is None:
            # Jobs a launcher ran elsewhere resolve a relative sweep folder in
            # their own working folder (a Ray worker's): nothing came back here.
            raise SweepFailed(
                f"no job folder under {sweep_dir}: with a launcher that runs "
                "jobs on other processes or machines (Ray, SLURM), give an "
                "absolute hydra.sweep.dir that every node sees"
            )
        if outcome.not_completed:
            lines = [
                f"job {row['job']} ({row['overrides'] or 'no overrides'}): "
                f"{row['status']}: {row.get('error')}"
                for row in outcome.not_completed
            ]
            for line in lines:
                log(ERROR, "Sweep: %s", line)
            raise SweepFailed(
                f"{len(lines)} job(s) of the sweep did not complete (the others "
                f"did; see {outcome.csv}):\n" + "\n".join(lines)
            )

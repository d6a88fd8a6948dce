"""Hydra (multi)run jobs and the sweep summary.

Each job runs the same ServerApp/ClientApp code as ``flwr run .``:

* ``engine=flwr`` (default) starts ``flwr run <app> --stream`` with the job's
  overrides on a SuperLink of the job's own: Flower's own engine (a simulation
  SuperLink, Ray), so that jobs can run side by side;
* ``engine=inprocess`` runs :func:`~.server.run_experiment` on an
  :class:`~flwr_prox_strategies.core.transport.inprocess.InProcessGrid` with the same
  ClientApp, with no engine start-up cost (quick sweeps, tests).

After a multirun, :class:`SweepSummary` writes ``summary.csv`` (one row per job)
and ``comparison.png`` beside the job folders.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import json
import logging
import math
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from logging import ERROR, INFO
from pathlib import Path
from typing import Any

import numpy as np
from flwr.common.logger import log
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import OverrideParseException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ..._executables import flower_env, flower_executable
from .. import RUN_OUTPUT_DIR, RUN_OVERRIDES, RUN_RESUME
from ..appdir import make_client_app, write_app_dir
from ..checkpoint import CHECKPOINT_FILE
from ..results import OBJECTIVES, RESULTS_FILE, pyplot
from ..track import sweep_overrides, where_for_sweep
from .launchers import CPUS_PER_JOB, JobCpus, available_cpus, job_cpus
from .superlink import CONNECTION, PrivateSuperLink, started_run_id

JOB_SUMMARY = "job.json"
APP_DIR_ENV = "FLWR_PROX_APP_DIR"
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
    ``OMP_NUM_THREADS`` = a client's CPUs unless it is set. ``resume``
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
    threads = max(math.floor(client_cpus), 1)
    run_env = {
        **flower_env(),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
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
) -> Path:
    """Run one experiment on an in-process grid with the app's ClientApp.

    ``resume`` continues the run from the checkpoint in ``output_dir``.

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
    with _torch_threads(threads):
        run_experiment(grid, run_config)
    return output_dir / RESULTS_FILE


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` torch threads (None: unchanged)."""
    if threads is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        yield
    finally:
        torch.set_num_threads(before)


#: Config keys for the job's runner, not the experiment: left out of the
#: overrides the ServerApp gets and of the summary. (A multirun's job gets
#: ``ray_address=127.0.0.1\:6379``, Hydra's escape of the colon, which the
#: shell line of ``flwr run`` would quote.)
_RUNNER_KEYS = ("engine", "ray_address")


def _runner_only(override: str) -> bool:
    """Whether an override sets a key of :data:`_RUNNER_KEYS`."""
    return override.split("=", 1)[0].lstrip("+~") in _RUNNER_KEYS


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
    bound = _cpu_bound(cfg, engine, share)
    record: dict[str, Any] = {
        "overrides": " ".join(overrides),
        "engine": engine,
        "cpus": bound,
    }
    start = time.monotonic()
    try:
        results_path = _run_engine(cfg, engine, ran, job_dir, bound)
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
        return float("nan")
    results = json.loads(results_path.read_text())
    record.update(
        status="completed",
        **{k: results["summary"].get(k) for k in (*OBJECTIVES, "rounds-evaluated")},
        **{"wall-time-s": round(time.monotonic() - start, 2)},
        strategy=results.get("strategy"),
    )
    (job_dir / JOB_SUMMARY).write_text(json.dumps(record, indent=2))
    final = record["final-accuracy"]
    return float(final) if final is not None else float("nan")


def _cpu_bound(cfg: DictConfig, engine: str, share: JobCpus) -> int | None:
    """Decide and log the CPU bound the job applies (None: it applies none).

    ``engine=flwr`` gives its own Ray the share (``init-args-num-cpus``), but a
    ``ray_address`` cluster's CPUs bound its actors instead; ``engine=inprocess``
    sets torch's threads to ``min(num_cpus_per_client, share)``, unless
    ``OMP_NUM_THREADS`` sets them. :func:`_run_engine` applies what this
    returns, and the job's summary records it: one decision for both.
    """
    if engine == "flwr" and cfg.get("ray_address"):
        log(INFO, "Job CPUs: the Ray cluster's at ray_address=%s", cfg.ray_address)
        return None
    if engine == "inprocess" and os.environ.get("OMP_NUM_THREADS"):
        log(INFO, "Job CPUs: torch threads from OMP_NUM_THREADS (%s)", share.reason)
        return None
    log(INFO, "Job CPUs: %d (%s)", share.cpus, share.reason)
    return share.cpus


def _run_engine(
    cfg: DictConfig,
    engine: str,
    overrides: list[str],
    job_dir: Path,
    cpus: int | None,
) -> Path:
    """Run the job on its engine within ``cpus`` CPUs; return its results file.

    ``cpus``: the bound :func:`_cpu_bound` decided (None: none of the job's).
    """
    resume = requeued_with_checkpoint(job_dir)
    if engine == "flwr":
        return flwr_run(
            overrides,
            job_dir,
            num_supernodes=int(cfg["num_clients"]),
            cpus_per_client=float(cfg["num_cpus_per_client"]),
            job_cpus=cpus,
            resume=resume,
            ray_address=str(cfg.get("ray_address") or ""),
        )
    threads = (
        None
        if cpus is None
        else min(math.ceil(float(cfg["num_cpus_per_client"])), cpus)
    )
    return run_inprocess(
        overrides, job_dir, int(cfg["num_clients"]), threads=threads, resume=resume
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


def _sweep_size_now(arguments: Sequence[str]) -> int | None:
    """Return the current multirun's number of jobs (None: cannot tell).

    ``arguments``: the multirun's overrides (:func:`_sweep_arguments`). A
    search (``hydra/sweeper=search``) runs ``n_trials`` jobs in all.
    """
    sweeper = HydraConfig.get().sweeper
    target = str(sweeper.get("_target_"))
    if target.endswith(".SearchSweeper"):
        return int(sweeper.n_trials)
    return sweep_size(arguments, target)


def _sweep_arguments(sweep_dir: Path) -> list[str]:
    """Return the multirun's command-line overrides (``seed=0,1``, not ``seed=0``).

    Read from the ``multirun.yaml`` the sweeper writes before any job starts:
    a job a launcher runs elsewhere has another command line (submitit's is
    ``python -m submitit.core._submit <folder>``).
    """
    saved = sweep_dir / "multirun.yaml"
    if saved.is_file():
        task = OmegaConf.select(OmegaConf.load(saved), "hydra.overrides.task")
        if task is not None:
            return [str(o) for o in task]
    return sys.argv[1:]


def sweep_size(argv: Sequence[str], sweeper: str) -> int | None:
    """Count the jobs of a sweep from its command line (None: cannot tell).

    The count is Hydra's basic sweeper's: the product of the lengths of the
    comma lists (``strategy=fedavg,fedprox seed=0,1,2``: 6). Another sweeper
    (an optimiser's), or ranges and intervals it samples, give None.

    Parameters
    ----------
    argv : Sequence[str]
        The multirun's command-line arguments.
    sweeper : str
        The sweeper's ``_target_`` (``hydra.sweeper._target_``).

    Returns
    -------
    int | None
        The number of jobs.
    """
    sweeps = _sweeps_of(argv)
    if not sweeper.endswith("BasicSweeper") or sweeps is None:
        return None
    count = 1
    for override in sweeps:
        if not override.is_discrete_sweep():
            return None
        count *= len(list(override.sweep_string_iterator()))
    return count


def swept_keys(argv: Sequence[str]) -> list[str]:
    """Return the keys a sweep's command line varies (``strategy=a,b``: ``strategy``).

    Parameters
    ----------
    argv : Sequence[str]
        The multirun's command-line arguments.

    Returns
    -------
    list[str]
        The keys of its sweep overrides, in order (none if it cannot be parsed).
    """
    return [o.key_or_group for o in _sweeps_of(argv) or []]


def _sweeps_of(argv: Sequence[str]) -> list[Override] | None:
    """Return the sweep overrides of a command line (None: it cannot be parsed)."""
    texts = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(texts)
    except OverrideParseException:
        return None
    return [o for o in parsed if o.is_sweep_override()]


def log_progress(
    sweep_dir: Path,
    job: int,
    overrides: Sequence[str],
    *,
    total: int | None,
    at_once: int = 1,
) -> None:
    """Log which job of how many starts, the time so far and an estimate of the rest.

    Jobs may finish out of order (side by side, on a cluster): the line counts
    the jobs that wrote their ``job.json`` (failed ones apart), the time since
    the sweep started (its ``multirun.yaml``), and estimates the rest as the
    finished jobs' mean wall time times the jobs left, this one included,
    divided by the jobs that run at a time.

    Parameters
    ----------
    sweep_dir : Path
        The sweep's folder.
    job : int
        The job's number (from 0, Hydra's ``job.num``).
    overrides : Sequence[str]
        The job's overrides, for the line.
    total : int | None
        The sweep's number of jobs (None: unknown).
    at_once : int (default: 1)
        How many jobs run at a time.
    """
    records = [json.loads(p.read_text()) for p in sweep_dir.glob(f"*/{JOB_SUMMARY}")]
    times = [float(r.get("wall-time-s") or 0.0) for r in records]
    failed = sum(r.get("status") == "failed" for r in records)
    started = sweep_dir / "multirun.yaml"
    text = f"job {job + 1} of {total}" if total else f"job {job + 1}"
    if records:
        text += f", {len(records)} done"
        if failed:
            text += f" ({failed} failed)"
        if started.is_file():
            text += f" in {_duration(time.time() - started.stat().st_mtime)}"
        if total:
            left = max(total - len(records), 1) * sum(times) / len(times)
            text += f", about {_duration(left / max(at_once, 1))} left"
    log(INFO, "Sweep: %s: %s", text, " ".join(overrides) or "(no overrides)")


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


@dataclass(frozen=True)
class SweepOutcome:
    """What :func:`summarise_sweep` wrote and which jobs did not complete.

    Attributes
    ----------
    csv : Path
        ``summary.csv``: one row per job, failed and unfinished ones included.
    plot : Path | None
        ``comparison.png`` (None when no job completed).
    not_completed : list[dict[str, Any]]
        The rows of the jobs that failed (with their ``error``) or never wrote
        their ``job.json`` (``status: unfinished``: killed, pre-empted).
    """

    csv: Path
    plot: Path | None
    not_completed: list[dict[str, Any]]


def _job_folders(sweep_dir: Path) -> list[Path]:
    """Return the sweep's job folders in order (``.hydra/`` is written at start)."""
    found = {p.parent for p in sweep_dir.glob(f"*/{JOB_SUMMARY}")}
    found |= {p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml")}
    return sorted(found, key=lambda p: (len(p.name), p.name))


def _job_row(job: Path) -> dict[str, Any]:
    """Return a job's ``job.json``, or an ``unfinished`` row from its overrides."""
    summary = job / JOB_SUMMARY
    if summary.is_file():
        row = json.loads(summary.read_text())
        row.setdefault("status", "completed")  # written before statuses existed
        return {"job": job.name, **row}
    overrides_file = job / ".hydra" / "overrides.yaml"
    overrides: list[Any] = (
        list(OmegaConf.load(overrides_file)) if overrides_file.is_file() else []
    )
    return {
        "job": job.name,
        "overrides": " ".join(str(o) for o in overrides if not _runner_only(str(o))),
        "status": "unfinished",
        "error": f"no {JOB_SUMMARY}: the job stopped before it ended (see its log)",
    }


def summarise_sweep(sweep_dir: Path) -> SweepOutcome | None:
    """Write ``summary.csv`` and ``comparison.png`` for the jobs under ``sweep_dir``.

    Jobs may have finished in any order: rows are sorted by job number. A job
    that failed keeps its row, with its ``status`` and ``error``; a job folder
    without ``job.json`` is ``unfinished``. The plot draws the completed jobs.

    Returns
    -------
    SweepOutcome | None
        What was written (None: no job folder under ``sweep_dir``).
    """
    jobs = _job_folders(sweep_dir)
    if not jobs:
        log(INFO, "Sweep summary: no job under %s", sweep_dir)
        return None
    rows = [_job_row(job) for job in jobs]
    csv_path = sweep_dir / "summary.csv"
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(
            handle, fieldnames=SUMMARY_FIELDS, extrasaction="ignore"
        )
        writer.writeheader()
        writer.writerows(rows)
    curves: list[tuple[dict[str, str], dict[int, float]]] = []
    for job, row in zip(jobs, rows, strict=True):
        if row["status"] != "completed":
            continue
        results = json.loads((job / RESULTS_FILE).read_text())
        curve = {
            r["round"]: r["central"]["accuracy"]
            for r in results["rounds"]
            if r.get("central", {}).get("accuracy") is not None
        }
        curves.append((_setting(str(row["overrides"])), curve))
    png_path: Path | None = None
    if curves:
        fig = plot_comparison(
            curves, title=f"sweep {sweep_dir.parent.name}/{sweep_dir.name}"
        )
        png_path = sweep_dir / "comparison.png"
        fig.savefig(png_path, dpi=120)
        pyplot().close(fig)
    not_completed = [row for row in rows if row["status"] != "completed"]
    log(
        INFO,
        "Sweep summary: %d of %d jobs completed: %s%s",
        len(rows) - len(not_completed),
        len(rows),
        csv_path,
        f" and {png_path}" if png_path else "",
    )
    print(
        f"Sweep summary: {csv_path}"
        + (f"\nComparison plot: {png_path}" if png_path else ""),
        file=sys.stderr,
    )
    return SweepOutcome(csv_path, png_path, not_completed)


#: summary.csv's columns.
SUMMARY_FIELDS = [
    "job",
    "overrides",
    "status",
    *OBJECTIVES,
    "wall-time-s",
    "strategy",
    "engine",
    "cpus",
    "error",
]


# Overrides that tell jobs of one configuration apart without changing it.
_NOT_A_SETTING = ("seed", "engine")
_LINE_STYLES = ("-", "--", ":", "-.")


def _setting(overrides: str) -> dict[str, str]:
    """Return a job's overrides as ``{key: value}``, seed and engine left out."""
    setting = {}
    for word in overrides.split():
        key, _, value = word.partition("=")
        if key.lstrip("+~") not in _NOT_A_SETTING:
            setting[key] = value
    return setting


def _describe(setting: dict[str, str], keys: Sequence[str]) -> str:
    """Short label: ``fedprox, mu=1, drop_percent=0.9`` (``strategy.`` dropped)."""
    words = []
    for key in keys:
        value = setting.get(key, "(default)")
        if key.lstrip("+") in ("strategy", "experiment"):
            words.append(value)
        else:
            words.append(f"{key.removeprefix('strategy.')}={value}")
    return ", ".join(words)


def plot_comparison(
    curves: Sequence[tuple[dict[str, str], dict[int, float]]], *, title: str
) -> Any:
    """Draw one line per configuration: the mean over its seeds, the min-max band.

    ``curves`` holds one ``(setting, {round: accuracy})`` per job (the setting
    without ``seed``). The legend names only the overrides that differ between
    configurations, the title the ones they share. One colour per value of
    ``strategy`` (or of the first override that differs, when the strategy does
    not), one line style per value of the other differing overrides. A
    configuration whose mean curve equals an earlier one's (FedAvg ignores
    ``strategy.mu``, say) says so in the legend instead of hiding under it, and
    each colour's lines are thinner than the previous colour's, so that a curve
    drawn over a near-equal one leaves it visible as an outline.
    """
    from ..results import integer_rounds

    groups: dict[tuple[tuple[str, str], ...], list[dict[int, float]]] = {}
    for setting, curve in curves:
        groups.setdefault(tuple(setting.items()), []).append(curve)
    settings = [dict(key) for key in groups]
    keys = list(dict.fromkeys(k for s in settings for k in s))
    varying = [k for k in keys if len({s.get(k) for s in settings}) > 1]
    shared = [k for k in keys if k not in varying]
    colour_key = next(
        (k for k in varying if k.lstrip("+") == "strategy"),
        varying[0] if varying else None,
    )
    style_keys = [k for k in varying if k != colour_key]
    colour_of = {
        key: s.get(colour_key or "") for key, s in zip(groups, settings, strict=True)
    }
    colour_values = list(dict.fromkeys(colour_of.values()))
    style_values = list(
        dict.fromkeys(tuple(s.get(k) for k in style_keys) for s in settings)
    )
    plt = pyplot()
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(9, 5))
    drawn: list[tuple[str, np.ndarray, list[int]]] = []
    many_seeds = False
    for key, setting, runs in zip(groups, settings, groups.values(), strict=True):
        rounds = sorted(set.intersection(*(set(c) for c in runs)))
        if not rounds:
            continue
        values = np.array([[c[r] for r in rounds] for c in runs])
        mean = values.mean(axis=0)
        colour_index = colour_values.index(colour_of[key])
        colour = colours(colour_index % 10)
        style_index = style_values.index(tuple(setting.get(k) for k in style_keys))
        label = _describe(setting, varying) or "(defaults)"
        same = next(
            (
                other
                for other, m, r in drawn
                if r == rounds and m.shape == mean.shape and np.array_equal(m, mean)
            ),
            None,
        )
        if same is not None:
            label += f" (same as {same})"
        if len(runs) > 1:
            many_seeds = True
            label += f" ({len(runs)} seeds)"
        ax.plot(
            rounds,
            mean,
            color=colour,
            linestyle=_LINE_STYLES[style_index % len(_LINE_STYLES)],
            marker="." if style_index >= len(_LINE_STYLES) else None,
            # Wider lines first: a curve drawn over an equal one leaves it
            # visible as an outline (FedAvg and FedProx without stragglers).
            linewidth=max(1.2, 3.0 - 0.7 * colour_index),
            label=label,
        )
        if len(runs) > 1:
            low, high = values.min(axis=0), values.max(axis=0)
            ax.fill_between(rounds, low, high, color=colour, alpha=0.12)
        drawn.append((_describe(setting, varying), mean, rounds))
    common = " ".join(f"{k}={settings[0][k]}" for k in shared)
    ax.set(
        xlabel="round",
        ylabel="central test accuracy"
        + (" (mean over seeds, min-max band)" if many_seeds else ""),
        title=title + ("\n" + textwrap.fill(common, 100) if common else ""),
    )
    integer_rounds(ax)
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig


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


class SweepSummary(Callback):
    """Hydra callback: summarise a multirun when it ends.

    When a job failed or never ended, it raises :class:`SweepFailed` after the
    summary is written, naming those jobs and their errors: the sweep exits
    with status 1 and that message. So it does when no job folder is there.
    """

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:  # noqa: D102
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

"""Sweeps and simulations on a Ray cluster that is already running.

The tests share one throw-away cluster (``ray_cluster.py``: a head node on
127.0.0.1, 2 CPUs, its own temporary folder, stopped at the end of the
module) and prove, from the cluster's own records, that the work ran there:

* a 2-job sweep with ``hydra/launcher=ray`` runs both jobs as Ray tasks of
  that cluster: its GCS lists the sweep's process as a job (a driver), the
  cluster's workers for that job logged both jobs' output, and the sweep
  folder holds each job's results and the summary;
* a run with ``engine=flwr ray_address=<address>`` runs its ClientApps on the
  cluster rather than on a Ray of its own: Flower's simulation process is a
  job of the cluster, its workers are ``ClientAppActor`` actors, and when the
  run ends the simulation has disconnected and the cluster is still up.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from flwr_prox_strategies._executables import flower_env

from .engine import REPO, hydra_entry
from .ray_cluster import (
    RAY_MISSING,
    alive_nodes,
    cluster_jobs,
    ray_cluster,
    worker_logs,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(RAY_MISSING is not None, reason=str(RAY_MISSING)),
]

# The smallest experiment that still trains: seconds, not minutes.
SMALL = (
    "model=logreg",
    "num_rounds=1",
    "num_clients=2",
    "train.local_epochs=1",
)


def _has_ray_launcher() -> bool:
    return importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is not None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A running 2-CPU Ray cluster: its address and folder (logs under it)."""
    folder = tmp_path_factory.mktemp("cluster")
    with ray_cluster(folder, num_cpus=2) as address:
        yield address, folder


def _env() -> dict[str, str]:
    # This checkout first, as on the cluster's workers; no RAY_ADDRESS of the
    # caller's: the address is given where it is meant.
    env = flower_env()
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), env.get("PYTHONPATH")])
    )
    return env


@pytest.mark.skipif(not _has_ray_launcher(), reason="hydra-ray-launcher missing")
def test_a_sweep_through_hydras_ray_launcher_runs_its_jobs_on_the_cluster(
    cluster: tuple[str, Path], tmp_path: Path
) -> None:
    address, folder = cluster
    before = {job.job_id for job in cluster_jobs(address)}
    sweep = tmp_path / "sweep"  # absolute: a job resolves a relative one in
    # the worker's working folder (the cluster's), not the sweep's
    out = hydra_entry(
        "-m",
        "hydra/launcher=ray",
        f"hydra.launcher.ray.init.address={address}",
        # The launcher sets object_store_memory unless the key exists,
        # and Ray refuses it when attaching to a running cluster.
        "++hydra.launcher.ray.init.object_store_memory=null",
        "++hydra.launcher.ray.remote.num_cpus=1",  # both jobs at once
        "engine=inprocess",
        *SMALL,
        "seed=0,1",
        f"hydra.sweep.dir={sweep}",
        env=_env(),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]

    with open(sweep / "summary.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["job"], r["status"]) for r in rows] == [
        ("0", "completed"),
        ("1", "completed"),
    ]
    for job in ("0", "1"):
        assert (sweep / job / "results.json").is_file()
        assert (sweep / job / "job.json").is_file()
    # The cluster's word: the sweep connected as a driver (a job of the GCS),
    # and workers of the cluster ran that job's tasks, both Hydra jobs.
    new = [job for job in cluster_jobs(address) if job.job_id not in before]
    assert len(new) == 1, new
    driver = new[0]
    assert "flwr_prox_strategies.experiment" in driver.entrypoint, driver
    assert driver.finished
    logs = "".join(worker_logs(folder, driver.job_id).values())
    for job in ("0", "1"):
        assert str(sweep / job) in logs, logs[-3000:]


def test_a_run_with_ray_address_runs_its_clientapps_on_the_cluster_and_leaves_it_up(
    cluster: tuple[str, Path], tmp_path: Path
) -> None:
    address, folder = cluster
    before = {job.job_id for job in cluster_jobs(address)}
    run = tmp_path / "run"
    out = hydra_entry(
        "engine=flwr",
        f"ray_address={address}",
        *SMALL,
        f"hydra.run.dir={run}",
        env=_env(),
        cwd=tmp_path,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "--federation-config" in log, log[-2000:]
    # Ray refuses num_cpus when it attaches to a running cluster.
    assert "init-args-num-cpus" not in log, log[-2000:]

    # Flower's simulation process was the cluster's driver (no new job: the
    # run started a Ray of its own), and its workers were the ClientApps'
    # actors (2 CPUs, 1 a client: 2 actors).
    new = [job for job in cluster_jobs(address) if job.job_id not in before]
    assert len(new) == 1, new
    driver = new[0]
    assert "flwr-simulation" in driver.entrypoint, driver
    actors = [
        path
        for path, text in worker_logs(folder, driver.job_id).items()
        if path.suffix == ".out" and ":actor_name:ClientAppActor" in text
    ]
    assert len(actors) == 2, sorted(p.name for p in worker_logs(folder, driver.job_id))
    # Flower's ray.shutdown() at the end disconnects its driver only.
    assert driver.finished
    assert alive_nodes(address) == 1
    assert (run / "results.json").is_file()
    # The cluster's CPUs bounded the run, not a share of the job's own.
    assert json.loads((run / "job.json").read_text())["cpus"] is None
    assert "Job CPUs: the Ray cluster's at ray_address=" in log

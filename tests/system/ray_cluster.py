"""A throw-away Ray cluster on this machine for system tests.

:func:`ray_cluster` starts a Ray head node with ``ray start`` (and, when asked,
worker nodes: more raylets on the same machine joined with
``ray start --address``, the closest one machine gets to a multi-node
cluster), on ports free at the time, with its own temporary folder, and stops
every process of it afterwards, and only those: ``ray stop`` would stop every
Ray of the machine (other tests' clusters, the Rays of concurrent Flower
simulations). Each ``ray start`` runs in a process group of its own, which
its daemons, workers and actors keep; and every process of the cluster
inherits a marker variable (:data:`MARKER`), which also finds what a job
started in groups of its own (a job's SuperLink, Flower's processes).
Teardown kills those groups and the processes with this cluster's marker,
nothing else. (The marker alone would miss Ray's workers and agents:
``setproctitle`` (``ray::IDLE``) overwrites the memory that
``/proc/PID/environ`` shows.)

The cluster's own records prove what ran on it: :func:`cluster_jobs` lists
its GCS's jobs (one per driver that connected: a Hydra sweep's launcher, a
Flower simulation), and :func:`worker_logs` finds its workers' log files
(``session_latest/logs`` under the cluster's temporary folder), which name the
job each worker served and, for an actor, its class.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from flwr_prox_strategies._executables import flower_env
from flwr_prox_strategies._processes import free_port

from .engine import REPO

#: The variable every process of a cluster inherits; its value is the cluster's
#: temporary folder (unique), so teardown finds that cluster's processes only.
MARKER = "FLWR_PROX_TEST_RAY_CLUSTER"
#: Where ``ray_cluster(folder)`` puts the cluster's temporary folder (or a
#: link to it): ``folder / TEMP_LINK / "session_latest" / "logs"``.
TEMP_LINK = "ray"
# Ray puts Unix sockets at <temp>/session_<date>_<time>_<usec>_<pid>/sockets/
# plasma_store: the temp folder plus 64 bytes or so, and a socket path has at
# most 107. Longer than this, the folder goes under /tmp instead.
_MAX_TEMP_DIR = 40
# Attempts at free ports: another process may take one between our finding it
# and Ray binding it.
_START_ATTEMPTS = 3


def ray_missing() -> str | None:
    """Return why Ray cannot run here (a skip reason), or None when it can.

    Only looked up, not imported: importing Ray takes a second, and the fast
    suite collects this module too.

    Returns
    -------
    str | None
        The reason, or None.
    """
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed (pip install 'flwr[simulation]')"
    if shutil.which("ray", path=flower_env()["PATH"]) is None:
        return "Ray's command `ray` is neither beside this Python nor on PATH"
    return None


#: :func:`ray_missing` at import: ``pytest.mark.skipif(RAY_MISSING is not None,
#: reason=str(RAY_MISSING))``.
RAY_MISSING = ray_missing()


@dataclasses.dataclass(frozen=True)
class ClusterJob:
    """One job of a cluster's GCS: a driver that connected to it.

    Attributes
    ----------
    job_id : str
        Its id in hex (``"02000000"``), as in its workers' logs.
    entrypoint : str
        The driver's command line.
    finished : bool
        Whether the driver has disconnected (``ray.shutdown``, or it exited).
    driver_pid : int
        The driver's process id.
    """

    job_id: str
    entrypoint: str
    finished: bool
    driver_pid: int


def cluster_jobs(address: str) -> list[ClusterJob]:
    """Return the jobs the cluster's GCS knows, running and finished, in order.

    Ray's public state API (``ray.util.state.list_jobs``) asks the dashboard,
    which the test clusters leave out (it doubles their start-up time); this
    asks the GCS directly, through the client Ray's own tools use, without
    connecting a driver (which would be a job of its own).

    Parameters
    ----------
    address : str
        The cluster's address (``127.0.0.1:PORT``).

    Returns
    -------
    list[ClusterJob]
        Its jobs, oldest first.
    """
    from ray._raylet import GcsClient  # type: ignore[attr-defined]  # no stub

    table = GcsClient(address=address).get_all_job_info(timeout=30)
    jobs = [
        ClusterJob(
            job_id=job_id.hex(),
            entrypoint=info.entrypoint,
            finished=info.is_dead,
            driver_pid=info.driver_pid,
        )
        for job_id, info in table.items()
    ]
    # A job id is a little-endian counter: in order of connection.
    return sorted(
        jobs, key=lambda job: int.from_bytes(bytes.fromhex(job.job_id), "little")
    )


def alive_nodes(address: str) -> int:
    """Return how many nodes of the cluster at ``address`` are alive (the head counts)."""
    from ray._raylet import GcsClient  # type: ignore[attr-defined]  # no stub

    nodes = GcsClient(address=address).get_all_node_info(timeout=30)
    return sum(1 for info in nodes.values() if info.state == 0)  # 0: ALIVE


def worker_logs(folder: Path, job_id: str) -> dict[Path, str]:
    """Return the log files (and texts) of the cluster's workers for one job.

    Ray writes a worker's stdout and stderr to
    ``worker-<worker id>-<job id>-<pid>.out`` and ``.err``, and each time the
    worker starts serving a job, a line ``:job_id:<job id>`` in both, then
    ``:task_name:<function>`` or ``:actor_name:<class>``. Workers Ray starts
    ahead of demand have no job yet (``ffffffff`` in the name): the line
    tells which job they served.

    Parameters
    ----------
    folder : Path
        The folder given to :func:`ray_cluster`.
    job_id : str
        The job's id in hex (:attr:`ClusterJob.job_id`).

    Returns
    -------
    dict[Path, str]
        Each file and its text.
    """
    logs = folder / TEMP_LINK / "session_latest" / "logs"
    found = {}
    for path in sorted(logs.glob("worker-*")):
        text = path.read_text(errors="replace")
        if f"-{job_id}-" in path.name or f":job_id:{job_id}\n" in text:
            found[path] = text
    return found


@contextlib.contextmanager
def ray_cluster(
    folder: Path, num_cpus: int = 2, *, worker_nodes: int = 0
) -> Iterator[str]:
    """Run a Ray cluster on this machine for the block; yield its address.

    The head node listens on a free port (Ray binds every interface and
    advertises the machine's own address even for ``--node-ip-address
    127.0.0.1``; ``127.0.0.1:PORT`` reaches it). No dashboard (half of the
    start-up time): :func:`cluster_jobs` reads the GCS instead.

    Parameters
    ----------
    folder : Path
        Holds the output of ``ray start`` and the cluster's temporary folder
        (``folder / "ray"``: sessions, sockets, logs), or a link to it under
        /tmp when ``folder`` is too long a path for Ray's sockets. It is also
        the working folder of the cluster's workers: a relative path in a
        job lands here.
    num_cpus : int, default 2
        The CPUs each node offers (Ray does not check them against the
        machine's).
    worker_nodes : int, default 0
        Nodes to join to the head, each with ``num_cpus`` CPUs (their own
        raylets and agents on their own ports, the head's temporary folder).

    Yields
    ------
    str
        The address to give ``ray.init(address=...)``, ``RAY_ADDRESS`` or
        ``ray start --address``: ``127.0.0.1:PORT``.

    Raises
    ------
    RuntimeError
        When a node does not start; the message holds ``ray start``'s output.
    """
    folder.mkdir(parents=True, exist_ok=True)
    temp_dir, link = _temp_dir(folder)
    # The cluster's processes inherit this environment: the marker, and this
    # checkout first on the path, so that workers import the code under test
    # (a Hydra job's function is unpickled there).
    base = flower_env()
    pythonpath = os.pathsep.join(filter(None, [str(REPO), base.get("PYTHONPATH")]))
    env = {
        **base,
        MARKER: str(temp_dir),
        "PYTHONPATH": pythonpath,
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    # A RAY_ADDRESS of the test's environment must not send the cluster's own
    # drivers (a job's Flower simulation) to another cluster.
    env.pop("RAY_ADDRESS", None)
    groups: set[int] = set()
    try:
        address = _start_node(
            folder, env, num_cpus, groups, head_of=None, temp_dir=temp_dir
        )
        for index in range(worker_nodes):
            _start_node(folder, env, num_cpus, groups, head_of=address, index=index + 1)
        _wait_nodes(address, 1 + worker_nodes)
        yield address
    finally:
        _kill(groups, str(temp_dir))
        if link is not None:
            link.unlink(missing_ok=True)
            shutil.rmtree(temp_dir, ignore_errors=True)


def _temp_dir(folder: Path) -> tuple[Path, Path | None]:
    """Return the cluster's temporary folder, and the link to it (if any).

    ``folder / "ray"`` when short enough for Ray's socket paths; otherwise a
    new folder under /tmp, linked from ``folder / "ray"`` (removed at the end).
    """
    inside = folder.resolve() / TEMP_LINK
    if len(str(inside)) <= _MAX_TEMP_DIR:
        inside.mkdir(exist_ok=True)
        return inside, None
    outside = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    inside.symlink_to(outside, target_is_directory=True)
    return outside, inside


def _start_node(
    folder: Path,
    env: dict[str, str],
    num_cpus: int,
    groups: set[int],
    *,
    head_of: str | None,
    temp_dir: Path | None = None,
    index: int = 0,
) -> str:
    """Start the head (``head_of`` None) or a node joining it; return the address.

    The process group of each ``ray start`` goes into ``groups``, even when it
    fails (what it started is killed with the cluster).
    """
    ray = shutil.which("ray", path=env["PATH"]) or "ray"
    log = folder / f"ray-start-{index}.log"
    failures = []
    for _ in range(_START_ATTEMPTS):
        # Every listening port of a node is its own, free now: the defaults
        # (6379, 10001, 52365, ...) collide with any other Ray of the machine,
        # and two nodes on one machine collide with each other.
        ports = [
            *("--dashboard-agent-listen-port", str(free_port())),
            *("--dashboard-agent-grpc-port", str(free_port())),
            *("--metrics-export-port", str(free_port())),
            *("--runtime-env-agent-port", str(free_port())),
        ]
        if head_of is None:
            port = free_port()
            address = f"127.0.0.1:{port}"
            role = [
                *("--head", "--node-ip-address", "127.0.0.1", "--port", str(port)),
                *("--ray-client-server-port", str(free_port())),
                *("--include-dashboard", "false"),
                *("--temp-dir", str(temp_dir)),
            ]
        else:
            address = head_of
            role = ["--address", head_of]
        with open(log, "a") as sink:
            start = subprocess.Popen(
                [
                    ray,
                    "start",
                    *role,
                    *("--num-cpus", str(num_cpus)),
                    "--disable-usage-stats",
                    *ports,
                ],
                env=env,
                cwd=folder,
                stdout=sink,
                stderr=subprocess.STDOUT,
                # Its daemons outlive it in its group (the group of a new
                # session, whose id is its pid); a Ctrl-C of the test reaches
                # them only through our teardown.
                start_new_session=True,
            )
        groups.add(start.pid)
        try:
            code = start.wait(timeout=180)
        except subprocess.TimeoutExpired:
            code = None
        if code == 0:
            return address
        failures.append(f"exit {code}" if code is not None else "no answer in 180 s")
        _kill({start.pid}, env[MARKER])  # what a failed start left
    tail = log.read_text(errors="replace")[-3000:]
    raise RuntimeError(
        f"`ray start` of node {index} failed ({', '.join(failures)}); {log}:\n{tail}"
    )


def _wait_nodes(address: str, count: int, timeout: float = 60) -> None:
    """Wait until ``count`` nodes are alive (a joining node registers late)."""
    deadline = time.monotonic() + timeout
    while (alive := alive_nodes(address)) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{alive} of {count} Ray nodes alive after {timeout} s")
        time.sleep(0.2)


def _kill(groups: set[int], marker: str) -> None:
    """SIGTERM, then SIGKILL, the cluster: its groups and its marked processes.

    The GCS, the raylet and the autoscaler's monitor ignore SIGTERM (``ray
    stop`` waits 16 s for them, then kills): a throw-away cluster gets 1 s to
    flush its workers' logs, then SIGKILL, as ``ray stop --force``.
    """
    wanted = f"{MARKER}={marker}".encode()
    groups = groups - {os.getpgid(0)}  # never the test's own group
    for sig, grace in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 5.0)):
        pids = _members(groups, wanted)
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, sig)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = _members(groups, wanted)
        if not pids:
            return


def _members(groups: set[int], marker: bytes) -> list[int]:
    """Live processes (this one excepted) in ``groups`` or with ``marker``.

    A zombie is dead already (its parent has yet to reap it): left out.
    """
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] == "Z":
                continue
            if int(fields[2]) in groups or marker in (
                (proc / "environ").read_bytes().split(b"\0")
            ):
                pids.append(int(proc.name))
    return pids

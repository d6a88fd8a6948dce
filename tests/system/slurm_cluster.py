"""A throw-away single-node SLURM cluster for system tests.

:func:`single_node_slurm` starts MUNGE, ``slurmctld`` and ``slurmd`` as root,
everything (configuration, key, sockets, state, spool, logs) inside one folder
and on ports free at the time, so that it collides neither with a SLURM of the
machine nor with another test's; and stops all of it afterwards. Debian's
``slurmctld`` and ``slurmd`` packages (``.ci/install-slurm``) are all it needs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from flwr_prox_strategies._processes import free_port

# Debian installs the daemons in /usr/sbin, which a non-root PATH may lack.
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
BINARIES = (
    *("mungekey", "munged", "slurmctld", "slurmd"),
    *("sinfo", "squeue", "scancel", "scontrol"),
)
# submitit learns of a job that died without a result (cancelled, timed out)
# from `sacct`, which needs an accounting database (slurmdbd, MySQL) this
# cluster has not: without an answer it waits for ever. This stand-in answers
# its query (`sacct -o JobID,State,NodeList --parsable2 -j ID ...`) from
# slurmctld's memory of recent jobs (scontrol; MinJobAge, 300 s).
SACCT = r"""#!/bin/sh
echo 'JobID|State|NodeList'
while [ $# -gt 0 ]; do
    [ "$1" = -j ] && scontrol show job --oneliner "$2" 2>/dev/null
    shift
done | awk '{
    for (i = 1; i <= NF; i++) { n = index($i, "="); f[substr($i, 1, n - 1)] = substr($i, n + 1) }
    task = f["ArrayTaskId"]
    if (task ~ /[-,]/) task = "[" task "]"
    print (task == "" ? f["JobId"] : f["ArrayJobId"] "_" task) "|" f["JobState"] "|" f["NodeList"]
    delete f
}'
"""


class SlurmUnavailable(RuntimeError):
    """SLURM or MUNGE cannot run here (not installed, not root): tests skip."""


def _binaries() -> dict[str, str]:
    found = {name: shutil.which(name, path=SEARCH_PATH) for name in BINARIES}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise SlurmUnavailable(
            f"not installed: {', '.join(missing)} (run .ci/install-slurm)"
        )
    if os.geteuid() != 0:
        # slurmd starts jobs as their submitting user: that needs root.
        raise SlurmUnavailable("slurmd must run as root")
    return {name: str(path) for name, path in found.items()}


def _memory_mb() -> int:
    # slurmd reads the same figure; a RealMemory above it drains the node.
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20


def write_conf(folder: Path, munge_socket: Path) -> Path:
    """Write ``folder/slurm.conf``: one node, one partition, no accounting.

    Parameters
    ----------
    folder : Path
        Where the state, spool, pid and log files go.
    munge_socket : Path
        The socket of the cluster's own munged.

    Returns
    -------
    Path
        The configuration file.
    """
    host = socket.gethostname().split(".")[0]
    for sub in ("state", "spool"):
        (folder / sub).mkdir(exist_ok=True)
    conf = folder / "slurm.conf"
    conf.write_text(
        f"""\
ClusterName=tests
# Addresses given: the host name need not resolve.
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
# No cgroups (a container has none to give) and no accounting database.
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# CPUs, not memory, are what jobs take: a job without --mem would otherwise
# hold all of the node's memory and the next job would wait for it.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# The node is idle as soon as its slurmd registers; no mail program here.
ReturnToService=2
MailProg=/bin/true
# Batch jobs are scheduled at once, not up to 3 s later (for high-rate submission).
SchedulerParameters=batch_sched_delay=0
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={_memory_mb()}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
    )
    return conf


@contextlib.contextmanager
def single_node_slurm(folder: Path, timeout: float = 60) -> Iterator[dict[str, str]]:
    """Run a single-node SLURM cluster (partition ``debug``) for the block.

    Parameters
    ----------
    folder : Path
        Holds everything of the cluster: ``slurm.conf``, the MUNGE key, state,
        spool and the daemons' logs.
    timeout : float
        Seconds to wait for the node to be idle.

    Yields
    ------
    dict[str, str]
        The environment of a client (``sbatch``, submitit): this process's,
        with ``SLURM_CONF`` naming the cluster's configuration.

    Raises
    ------
    SlurmUnavailable
        When SLURM or MUNGE is not installed, or this is not root.
    RuntimeError
        When a daemon ends before the node is idle; the message holds the
        daemons' logs.
    TimeoutError
        When the node is not idle in time; the message holds the logs too.
    """
    binaries = _binaries()
    folder.mkdir(parents=True, exist_ok=True)
    # A Unix socket path has at most 107 bytes: pytest's tmp_path can be longer.
    socket_dir = Path(tempfile.mkdtemp(prefix="munge-", dir="/tmp"))
    socket_dir.chmod(0o755)  # munged wants every user able to reach its socket
    munge_socket = socket_dir / "socket"
    conf = write_conf(folder, munge_socket)
    sacct = folder / "bin" / "sacct"
    sacct.parent.mkdir(exist_ok=True)
    sacct.write_text(SACCT)
    sacct.chmod(0o755)
    # Run inside a SLURM job (a CI runner on a cluster), the test's own job
    # variables would tell sbatch and submitit about the wrong job.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_CONF=str(conf), PATH=f"{sacct.parent}{os.pathsep}{SEARCH_PATH}")
    daemons: dict[str, subprocess.Popen[bytes]] = {}

    def start(name: str, *args: str) -> None:
        # Own sessions: a Ctrl-C of the test reaches them only through us.
        with open(folder / f"{name}.out", "wb") as sink:
            daemons[name] = subprocess.Popen(
                [binaries[name], *args],
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait(what: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            ended = [n for n, daemon in daemons.items() if daemon.poll() is not None]
            if ended:
                raise RuntimeError(
                    f"{' and '.join(ended)} ended; logs:\n{_logs(folder)}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no {what} in {timeout:g} s; logs:\n{_logs(folder)}"
                )
            time.sleep(0.2)

    try:
        key = folder / "munge.key"
        subprocess.run(
            [binaries["mungekey"], "--create", f"--keyfile={key}"], check=True
        )
        # --force: munged refuses to start when a folder above its key or socket
        # is writable by others (umask 002, a /tmp without sticky bit), a care
        # a throw-away key does not need.
        start(
            "munged",
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={munge_socket}",
            f"--pid-file={folder / 'munged.pid'}",
            f"--seed-file={folder / 'munged.seed'}",
        )
        wait("munged socket", munge_socket.exists)
        start("slurmctld", "-D", "-f", str(conf))
        start("slurmd", "-D", "-f", str(conf))
        sinfo = (binaries["sinfo"], "--noheader", "--format=%t")
        wait("idle node", lambda: _output(*sinfo, env=env) == "idle")
        yield env
    finally:
        _stop(binaries, env, daemons, conf)
        shutil.rmtree(socket_dir, ignore_errors=True)


def _output(*command: str, env: dict[str, str]) -> str:
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    return out.stdout.strip()


def _logs(folder: Path) -> str:
    """The end of each daemon's stderr (all it logs, failures to start too)."""
    return "\n".join(
        f"--- {path.name}:\n{path.read_text(errors='replace')[-3000:]}"
        for path in sorted(folder.glob("*.out"))
    )


def _stop(
    binaries: dict[str, str],
    env: dict[str, str],
    daemons: dict[str, subprocess.Popen[bytes]],
    conf: Path,
) -> None:
    """Cancel the jobs, stop the daemons, kill whatever of the cluster is left.

    Job steps (``slurmstepd`` and their tasks) outlive a stopped slurmd by
    design, so the jobs go first while slurmd can still end them; what
    remains is found by the ``SLURM_CONF`` every process of the cluster
    inherits (the daemons from us, the jobs from their submitter).
    """
    if "slurmd" in daemons and daemons["slurmctld"].poll() is None:
        user = f"--user={os.geteuid()}"
        subprocess.run([binaries["scancel"], user], env=env, check=False)
        deadline = time.monotonic() + 10
        while _output(binaries["squeue"], "--noheader", env=env):
            if time.monotonic() > deadline:
                break  # what is left is killed below
            time.sleep(0.2)
    for daemon in reversed(daemons.values()):  # slurmd first, munged last
        daemon.terminate()
    for daemon in reversed(daemons.values()):
        try:
            daemon.wait(10)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    marker = f"SLURM_CONF={conf}".encode()
    for pid in _pids_with_env(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _pids_with_env(marker: bytes) -> list[int]:
    """Processes (this one excepted) whose environment holds ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
    return pids

"""Start and stop Flower's engine processes for system tests, by PID.

Everything a test starts lives under its own FLWR_HOME, in its own process
groups; teardown kills exactly those groups (SIGTERM, then SIGKILL: Ray's
agents ignore SIGTERM).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cmdlines() -> dict[int, str]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                raw = (entry / "cmdline").read_bytes()
                if raw:
                    out[int(entry.name)] = raw.replace(b"\0", b" ").decode(
                        errors="replace"
                    )
    return out


def groups_started_under(flwr_home: Path, extra_pids: list[int] = ()) -> set[int]:
    """Process groups of the SuperLink/SuperExec processes tied to ``flwr_home``."""
    lines = _cmdlines()
    marker = f"{flwr_home}/"
    roots = {pid for pid, cmd in lines.items() if marker in cmd and "flower-" in cmd}
    roots |= set(extra_pids)
    children = {
        pid
        for pid, cmd in lines.items()
        if "flower-superexec" in cmd and any(f"--parent-pid {r}" in cmd for r in roots)
    }
    groups = set()
    for pid in roots | children:
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(pid))
    groups.discard(os.getpgid(0))  # never our own group
    return groups


def kill_groups(groups: set[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, sig)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(g) for g in groups):
            time.sleep(0.2)


def _alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def flwr_env(flwr_home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        FLWR_HOME=str(flwr_home),
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(free_port()),
        # Two managed SuperLinks (another test, another checkout) must not share
        # the fixed control port either.
        FLWR_LOCAL_CONTROL_API_PORT=str(free_port()),
        # Ray's socket paths must stay under 107 bytes: keep its folder short.
        RAY_TMPDIR=tempfile.mkdtemp(prefix="ray", dir="/tmp"),
    )
    flwr_home.mkdir(parents=True, exist_ok=True)
    return env


def run_status(run_id: str, env: dict[str, str], connection: str | None = None) -> dict:
    command = [
        "flwr",
        "ls",
        *([connection] if connection else []),
        "--run-id",
        run_id,
        "--format",
        "json",
    ]
    out = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=REPO, check=True
    )
    return json.loads(out.stdout)["runs"][0]


def run_log(run_id: str, env: dict[str, str], connection: str | None = None) -> str:
    command = ["flwr", "log", run_id, *([connection] if connection else []), "--show"]
    out = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=REPO, timeout=60
    )
    return out.stdout + out.stderr


@contextlib.contextmanager
def managed_engine(flwr_home: Path) -> Iterator[dict[str, str]]:
    """Environment for `flwr run` with a private managed SuperLink, killed after."""
    env = flwr_env(flwr_home)
    try:
        yield env
    finally:
        kill_groups(groups_started_under(flwr_home))
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)


@contextlib.contextmanager
def loopback_deployment(
    flwr_home: Path, num_nodes: int
) -> Iterator[tuple[dict[str, str], str]]:
    """Run a SuperLink and ``num_nodes`` SuperNodes on 127.0.0.1; yield env, name."""
    env = flwr_env(flwr_home)
    link_port = free_port()
    link_dir = flwr_home / "superlink"
    link_dir.mkdir(parents=True)
    (flwr_home / "config.toml").write_text(
        '[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\n'
        f'address = "127.0.0.1:{link_port}"\ninsecure = true\n'
    )
    procs: list[subprocess.Popen] = []
    try:
        procs.append(
            subprocess.Popen(
                [
                    "flower-superlink",
                    "--insecure",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(link_port),
                    "--database",
                    str(link_dir / "state.db"),
                    "--disable-runtime-dependency-installation",
                ],
                cwd=link_dir,
                env={**env, "FLWR_HOME": str(link_dir)},
                start_new_session=True,
                stdout=open(link_dir / "superlink.out", "w"),
                stderr=subprocess.STDOUT,
            )
        )
        for i in range(num_nodes):
            node_dir = flwr_home / f"supernode{i}"
            node_dir.mkdir()
            procs.append(
                subprocess.Popen(
                    [
                        "flower-supernode",
                        "--insecure",
                        "--superlink",
                        f"127.0.0.1:{link_port}",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(free_port()),
                        "--node-config",
                        f"partition-id={i} num-partitions={num_nodes}",
                    ],
                    cwd=node_dir,
                    env={**env, "FLWR_HOME": str(node_dir)},
                    start_new_session=True,
                    stdout=open(node_dir / "supernode.out", "w"),
                    stderr=subprocess.STDOUT,
                )
            )
        _wait_online(env, num_nodes)
        yield env, "loopback"
    finally:
        groups = groups_started_under(flwr_home, [p.pid for p in procs])
        kill_groups(groups)
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)


def _wait_online(env: dict[str, str], num_nodes: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["flwr", "supernode", "list", "loopback", "--format", "json"],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            check=False,
        )
        if out.returncode == 0 and out.stdout.count('"online"') >= num_nodes:
            return
        time.sleep(1)
    raise TimeoutError(
        f"{num_nodes} SuperNodes did not come online: {out.stdout} {out.stderr}"
    )

"""The processes of P-FedAvg's deployments on this machine: links, nodes, runs.

:class:`Deployments` starts, for each parameter server, a SuperLink of its own
and its SuperNodes (each with its own ``FLWR_HOME``), submits runs to it with
``flwr run`` and reads their status with ``flwr ls``; every process it started
is stopped by process group (:func:`kill_groups`), Flower's SuperExecs and what
they started included (:func:`descendants_groups`). What the servers compute
is the launcher's business (:mod:`.launcher`), not this module's.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._executables import flower_env, flower_executable
from .._processes import descendants_groups, free_port, kill_groups


@dataclass
class Server:
    """One parameter server's deployment: SuperLink, SuperNodes, its run."""

    index: int
    home: Path
    link_port: int
    exchange: str
    partitions: list[int]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    run_id: str | None = None
    status: str = "not started"
    restarts: int = 0

    @property
    def active(self) -> bool:
        """Its run was submitted and has not ended (pending, starting, running)."""
        return self.run_id is not None and not self.status.startswith(
            ("finished", "killed")
        )

    @property
    def connection(self) -> str:
        """Name of the ``flwr`` CLI connection to this server's SuperLink."""
        return f"server-{self.index}"


class Deployments:
    """M deployments of one Flower app on loopback: start, run, read, stop.

    Parameters
    ----------
    app : Path
        The Flower app that ``flwr run`` submits (the pack's, by default).
    engine : Path
        The folder of the SuperLinks' and SuperNodes' homes and logs.
    servers, clients_per_server : int
        M, and the SuperNodes of each server (server ``i`` holds partitions
        ``i, i + M, i + 2M, ...``).
    """

    def __init__(
        self, app: Path, engine: Path, servers: int, clients_per_server: int
    ) -> None:
        self.app = app
        self.engine = engine
        self.env = flower_env()
        self.env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
        self.env.pop("FLWR_HOME", None)
        self.num_partitions = servers * clients_per_server
        self.ports: set[int] = set()
        self.servers = [
            Server(
                index=i,
                home=self.engine / f"server-{i}",
                link_port=self.port(),
                exchange=f"127.0.0.1:{self.port()}",
                partitions=[i + servers * k for k in range(clients_per_server)],
            )
            for i in range(servers)
        ]

    def port(self) -> int:
        """Return a port free now and not yet handed out by this launcher."""
        while (port := free_port()) in self.ports:
            pass
        self.ports.add(port)
        return port

    # ------------------------------------------------------------ processes
    def _env(self, home: Path) -> dict[str, str]:
        return {**self.env, "FLWR_HOME": str(home)}

    def _spawn(
        self, server: Server, command: list[str], folder: Path, log: str
    ) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            command,
            cwd=folder,
            env=self._env(folder),
            start_new_session=True,
            stdout=open(folder / log, "ab"),
            stderr=subprocess.STDOUT,
        )
        server.procs.append(proc)

    def start(self, server: Server) -> None:
        """Start server's SuperLink and SuperNodes; wait until all are online."""
        server.home.mkdir(parents=True, exist_ok=True)
        (server.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{server.connection}"\n\n'
            f"[superlink.{server.connection}]\n"
            f'address = "127.0.0.1:{server.link_port}"\ninsecure = true\n'
        )
        link = server.home / f"superlink-{server.restarts}"
        self._spawn(
            server,
            [
                flower_executable("flower-superlink"),
                "--insecure",
                *("--host", "127.0.0.1", "--port", str(server.link_port)),
                # State in memory: with a database file, 8 SuperNodes pushing
                # replies at once made the SuperLink fail pushes with "database
                # is locked" and the round waited for its timeout. A restarted
                # server gets a new SuperLink anyway.
                "--disable-runtime-dependency-installation",
            ],
            link,
            "superlink.log",
        )
        for partition in server.partitions:
            self._spawn(
                server,
                [
                    flower_executable("flower-supernode"),
                    "--insecure",
                    *("--superlink", f"127.0.0.1:{server.link_port}"),
                    *("--host", "127.0.0.1", "--port", str(self.port())),
                    "--node-config",
                    f"partition-id={partition} num-partitions={self.num_partitions}",
                ],
                server.home / f"supernode-{partition}-{server.restarts}",
                "supernode.log",
            )
        self._wait_online(server)

    def flwr(self, server: Server, *args: str, timeout: float = 120) -> Any:
        """Run ``flwr <args>`` against server's SuperLink; return its JSON reply."""
        try:
            out = subprocess.run(
                [flower_executable("flwr"), *args],
                capture_output=True,
                text=True,
                env=self._env(server.home),
                cwd=self.app,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:  # a loaded machine: the caller retries
            return {
                "success": False,
                "error": f"flwr {args[0]}: no answer in {timeout} s",
            }
        try:
            return json.loads(out.stdout)
        except ValueError:
            return {"success": False, "error": out.stdout + out.stderr}

    def _wait_online(self, server: Server) -> None:
        # Each SuperNode takes seconds of CPU to start: 40 on 2 cores, minutes.
        timeout = 120 + 10 * len(server.partitions)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            listing = self.flwr(
                server, "supernode", "list", server.connection, "--format", "json"
            )
            if str(listing).count("'online'") >= len(server.partitions):
                return
            time.sleep(1)
        raise TimeoutError(
            f"server {server.index}: {len(server.partitions)} SuperNodes did not come "
            f"online in {timeout:.0f} s (logs in {server.home})"
        )

    def refresh_status(self, server: Server) -> str:
        """Read server's run status (``flwr ls``), e.g. ``finished:completed``."""
        if server.run_id is None:
            return server.status
        reply = self.flwr(
            server,
            "ls",
            server.connection,
            "--run-id",
            server.run_id,
            "--format",
            "json",
        )
        with contextlib.suppress(KeyError, IndexError, TypeError):
            server.status = str(reply["runs"][0]["status"])
        return server.status

    def stop(self, server: Server) -> None:
        """Kill server's SuperLink, SuperNodes and what they started."""
        kill_groups(descendants_groups({p.pid for p in server.procs}))
        for proc in server.procs:
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
        server.procs = []
        server.status = "killed"

    def stop_all(self) -> None:
        """Stop every deployment still running."""
        for server in self.servers:
            if server.procs:
                self.stop(server)

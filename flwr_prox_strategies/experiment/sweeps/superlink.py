"""A SuperLink of the job's own, so that ``engine=flwr`` jobs can run side by side.

``flwr run .`` hands a run to Flower's *managed* local SuperLink, which listens
on fixed ports and stays up: two jobs at once collide ("Failed to start local
SuperLink"), and every job of every checkout on the machine shares one, with the
environment and working folder of whichever started it. :class:`PrivateSuperLink`
starts a simulation SuperLink of the job's own instead: a free port, its own
Flower home (``FLWR_HOME``: the connection, the installed app, the logs), the
working folder and environment the job gives (a SuperLink's ServerApp inherits
both), and it stops it, with the SuperExec and Ray it started, when the job ends.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from ..._executables import flower_executable
from ..._processes import descendants_groups, free_port, kill_groups

#: The connection name ``flwr`` uses for the job's SuperLink.
CONNECTION = "job"
#: Attempts at a free port: another process may take the one just found.
_PORT_ATTEMPTS = 5


class PrivateSuperLink:
    """A simulation SuperLink for one job: started on enter, stopped on exit.

    Parameters
    ----------
    cwd : Path
        Its working folder, which its ServerApp inherits.
    env : dict of str to str
        Its environment, which its ServerApp and ClientApps inherit (not that
        of ``flwr run``). ``FLWR_HOME`` is set to :attr:`home`.
    log_file : Path
        Where the SuperLink logs (kept when the job ends).
    startup_timeout : float, default 120
        Seconds to wait for its health endpoint.
    ray_address : str, default ""
        A running Ray cluster (``host:port``) for its simulations' ClientApps:
        ``RAY_ADDRESS`` in its environment, which Flower's Ray backend
        (``ray.init()``) reads. Empty: each simulation starts a Ray of its own
        (``RAY_ADDRESS=local``), even on a node of a running cluster and
        whatever ``RAY_ADDRESS`` ``env`` holds.

    Attributes
    ----------
    home : Path
        Its Flower home, a temporary folder removed on exit: ``config.toml``
        names the connection :data:`CONNECTION`, and the app is installed there.
    port : int
        The port its Control, Fleet and runtime APIs share.
    """

    def __init__(
        self,
        *,
        cwd: Path,
        env: dict[str, str],
        log_file: Path,
        startup_timeout: float = 120.0,
        ray_address: str = "",
    ) -> None:
        self.cwd = cwd
        self.log_file = log_file
        self.startup_timeout = startup_timeout
        self.home = Path(tempfile.mkdtemp(prefix="flwr-prox-superlink-"))
        self.env = {**env, "FLWR_HOME": str(self.home)}
        # Flower's Ray backend calls ray.init() without an address: Ray then
        # attaches to the cluster RAY_ADDRESS names, else to the one the last
        # `ray start` on this machine recorded (<temp dir>/ray_current_cluster,
        # written on every node of a cluster). Only the one asked for: "local"
        # starts a Ray of the run's own, whatever this machine runs.
        self.env["RAY_ADDRESS"] = ray_address or "local"
        self.env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    # ----------------------------------------------------------- lifecycle
    def __enter__(self) -> PrivateSuperLink:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start it on a free port; return once its health endpoint answers."""
        self.cwd.mkdir(parents=True, exist_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        failures = []
        for _ in range(_PORT_ATTEMPTS):
            self.port = free_port()
            self._write_connection()
            self._proc = subprocess.Popen(
                [
                    flower_executable("flower-superlink"),
                    "--insecure",
                    "--simulation",
                    *("--isolation", "subprocess"),
                    *("--host", "127.0.0.1", "--port", str(self.port)),
                    "--disable-runtime-dependency-installation",
                    *("--log-file", str(self.log_file)),
                ],
                cwd=self.cwd,
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            if self._wait_healthy():
                return
            failures.append(f"port {self.port}: exit {self._proc.poll()}")
            self._stop_processes()
        raise RuntimeError(
            f"the job's SuperLink did not start ({'; '.join(failures)}); "
            f"see {self.log_file}"
        )

    def stop(self) -> None:
        """Stop the SuperLink and everything it started; remove its home."""
        self._stop_processes()
        shutil.rmtree(self.home, ignore_errors=True)

    def _stop_processes(self) -> None:
        if self._proc is None:
            return
        # Its SuperExec and the runs' Ray processes live in groups of their
        # own; Ray's agents ignore SIGTERM after an aborted run.
        groups = descendants_groups({self._proc.pid})
        with contextlib.suppress(ProcessLookupError):
            self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            # A SuperLink with a client still streaming waits for it: SIGINT
            # stops it, SIGKILL in the end.
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGINT)
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        kill_groups(groups)
        self._proc = None

    # ------------------------------------------------------------- helpers
    def _write_connection(self) -> None:
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f"[superlink.{CONNECTION}]\n"
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )

    def _wait_healthy(self) -> bool:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        url = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:  # the port was taken, or worse
                return False
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(url, timeout=2) as response,
            ):
                if response.status == 200:
                    return True
            time.sleep(0.2)
        return False

    def run_status(self, run_id: str) -> dict[str, Any]:
        """Return Flower's record of a run (``status``, ``status-details``, ...).

        ``flwr run --stream`` exits 0 whatever the ServerApp did; this says
        ``finished:completed``, ``finished:failed`` (with the details) or
        ``finished:stopped``. Empty when the SuperLink does not know the run.
        """
        out = subprocess.run(
            [
                flower_executable("flwr"),
                "ls",
                CONNECTION,
                *("--run-id", run_id),
                *("--format", "json"),
            ],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=self.cwd,
            timeout=60,
            check=False,
        )
        with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
            reply = json.loads(out.stdout)
            if reply.get("success", True):
                return dict(reply["runs"][0])
        return {}


def started_run_id(log_text: str) -> str | None:
    """Return the run id ``flwr run`` printed ("Successfully started run 123")."""
    for line in log_text.splitlines():
        marker = "Successfully started run "
        if marker in line:
            return line.split(marker, 1)[1].split()[0].strip()
    return None

"""Start and stop Flower's engine processes for system tests, by PID.

Everything a test starts lives under its own FLWR_HOME, in its own process
groups; teardown kills exactly those groups (SIGTERM, then SIGKILL: Ray's
agents ignore SIGTERM).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import ipaddress
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from flwr_prox_strategies._executables import flower_env, flower_executable

# The pack's process helpers: one implementation of listing and killing groups.
from flwr_prox_strategies._processes import free_port, kill_groups, process_cmdlines

REPO = Path(__file__).resolve().parents[2]


def groups_started_under(flwr_home: Path, extra_pids: list[int] = ()) -> set[int]:
    """Process groups of the SuperLink/SuperExec processes tied to ``flwr_home``."""
    lines = process_cmdlines()
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


def flwr_env(flwr_home: Path) -> dict[str, str]:
    env = flower_env()
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
        flower_executable("flwr"),
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
    command = [
        flower_executable("flwr"),
        "log",
        run_id,
        *([connection] if connection else []),
        "--show",
    ]
    out = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=REPO, timeout=60
    )
    return out.stdout + out.stderr


def rounds_done(output: Path) -> int:
    """Return the last round in ``<output>/results.json`` (0: none yet)."""
    try:
        data = json.loads((output / "results.json").read_text())
    except (OSError, ValueError):
        return 0
    return max((r["round"] for r in data.get("rounds", [])), default=0)


def results_ended(output: Path) -> bool:
    """``<output>/results.json`` says the run ended: complete, or a failure."""
    try:
        data = json.loads((output / "results.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(data.get("summary", {}).get("complete")) or "failure" in data


def wait_finished(
    run_id: str,
    env: dict[str, str],
    connection: str | None = None,
    deadline: float | None = None,
    ended: Callable[[], bool] | None = None,
) -> str:
    """Return the run's final status (``finished:...``).

    Each status read is a ``flwr ls`` (a Python start, about 2 s of CPU, taken
    from the run waited for): with ``ended`` (a cheap sign that the run ended,
    such as a file it writes last) it is asked every 2 s once ``ended()`` is
    true, else every 15 s (a run that dies without writing); without, every 2 s.
    ``deadline`` is a ``time.monotonic()`` value; past it, ``TimeoutError``.
    """
    asked = -float("inf")
    while True:
        every = 15.0 if ended is not None and not ended() else 2.0
        if time.monotonic() - asked >= every:
            asked = time.monotonic()
            status = str(run_status(run_id, env, connection)["status"])
            if status.startswith("finished"):
                return status
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} still {status}")
        time.sleep(0.5)


@contextlib.contextmanager
def managed_engine(flwr_home: Path) -> Iterator[dict[str, str]]:
    """Environment for `flwr run` with a private managed SuperLink, killed after."""
    env = flwr_env(flwr_home)
    try:
        yield env
    finally:
        kill_groups(groups_started_under(flwr_home))
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)


@dataclasses.dataclass
class AppRun:
    """One run of an app: its name, run config and output; once submitted, its id,
    final status and (when it failed) its log."""

    name: str
    run_config: str
    output: Path
    run_id: str = ""
    status: str = ""
    log: str = ""


def submit_app(
    app: Path, env: dict[str, str], run_config: str, *, num_supernodes: int
) -> str:
    """``flwr run`` an app folder, not streamed (runs go side by side); its run id.

    Ray with one CPU: one ClientApp actor per run (its nodes take turns), so
    each run starts torch once.
    """
    return flwr_submit(
        app,
        env,
        run_config,
        f"num-supernodes={num_supernodes} client-resources-num-cpus=1 "
        "init-args-num-cpus=1",
    )


def run_apps(
    app: Path,
    env: dict[str, str],
    queue: list[AppRun],
    *,
    num_supernodes: int,
    parallel: int,
    timeout: float,
) -> None:
    """Run each of ``queue`` (at most ``parallel`` at once); keep status and log."""
    pending, active = list(queue), []
    deadline = time.monotonic() + timeout
    while pending or active:
        while pending and len(active) < parallel:
            run = pending.pop(0)
            run.run_id = submit_app(
                app, env, run.run_config, num_supernodes=num_supernodes
            )
            active.append(run)
        for run in list(active):
            status = str(run_status(run.run_id, env)["status"])
            if status.startswith("finished"):
                run.status = status
                run.log = run_log(run.run_id, env)
                active.remove(run)
        if time.monotonic() > deadline:
            raise TimeoutError(f"still running: {[r.name for r in active]}")
        time.sleep(3)


def flwr_submit(
    app: Path, env: dict[str, str], run_config: str, federation: str
) -> str:
    """``flwr run`` an app folder with a federation config, not streamed; its run id."""
    out = run_captured(
        [
            *(flower_executable("flwr"), "run", str(app), "--format", "json"),
            *("--federation-config", federation, "--run-config", run_config),
        ],
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    reply = json.loads(out.stdout)
    assert "run-id" in reply, (run_config, reply)
    return str(reply["run-id"])


def run_captured(
    command: list[str], *, cwd: Path, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``command`` to its end, output captured as text; a failure does not raise."""
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
        check=False,
    )


def flwr_run(env: dict[str, str], *args: str, timeout: float = 300) -> dict:
    """``flwr run . <args> --stream --format json`` from the checkout; its JSON reply.

    ``--stream`` exits 0 even when the ServerApp fails: read the run's status.
    """
    out = subprocess.run(
        [flower_executable("flwr"), "run", ".", *args, "--stream", "--format", "json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=timeout,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def simulate(env: dict[str, str], overrides: str, output: Path) -> Path:
    """`flwr run` the app on 4 simulated SuperNodes; assert it completed."""
    reply = flwr_run(
        env,
        "--federation-config",
        "num-supernodes=4 client-resources-num-cpus=1",
        "--run-config",
        f"overrides='{overrides}' output-dir='{output}'",
    )
    status = run_status(reply["run-id"], env)
    log = (
        run_log(reply["run-id"], env)
        if status["status"] != "finished:completed"
        else ""
    )
    assert status["status"] == "finished:completed", log[-3000:]
    return output


def hydra_entry(
    *arguments: str, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m flwr_prox_strategies.experiment ARGUMENTS`` (output captured)."""
    return run_captured(
        [sys.executable, "-m", "flwr_prox_strategies.experiment", *arguments],
        env=env,
        cwd=cwd,
        timeout=timeout,
    )


def check_results(output: Path, rounds: int, strategy: str) -> dict:
    """Assert a completed run's results.json and plot (logreg on digits); return it."""
    results = json.loads((output / "results.json").read_text())
    assert results["summary"]["complete"] is True
    assert results["strategy"] == strategy
    assert [r["round"] for r in results["rounds"]] == list(range(rounds + 1))
    assert results["rounds"][-1]["train"]["replies-valid"] == results["num-clients"]
    assert results["summary"]["final-accuracy"] > 0.5  # logreg on digits, 2-3 rounds
    assert (output / "metrics.png").stat().st_size > 10_000
    return results


@dataclasses.dataclass(frozen=True)
class TlsCredentials:
    """What a TLS deployment with SuperNode authentication needs (PEM/OpenSSH files).

    ``node_keys[i]`` is SuperNode i's private key (OpenSSH format, NIST P-384, as
    ``flower-supernode --auth-supernode-private-key`` reads it); its public key,
    what ``flwr supernode register`` takes, is beside it with ``.pub``.
    """

    ca_cert: Path
    server_cert: Path
    server_key: Path
    node_keys: tuple[Path, ...]


def make_tls_credentials(folder: Path, num_node_keys: int) -> TlsCredentials:
    """Generate a CA, a server certificate for 127.0.0.1/localhost, and node keys.

    The same as the README's openssl/ssh-keygen commands, with ``cryptography``
    (a dependency of flwr). Valid for one day.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    validity = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def pem_key(key: ec.EllipticCurvePrivateKey, fmt) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, fmt, serialization.NoEncryption()
        )

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(name("flwr-prox-strategies test CA"))
        .issuer_name(name("flwr-prox-strategies test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(validity[0])
        .not_valid_after(validity[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(name("localhost"))
        .issuer_name(ca_cert.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(validity[0])
        .not_valid_after(validity[1])
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        # (Python 3.13's strict verification wants the key identifiers.)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    creds = TlsCredentials(
        ca_cert=folder / "ca.crt",
        server_cert=folder / "server.pem",
        server_key=folder / "server.key",
        node_keys=tuple(folder / f"supernode{i}" for i in range(num_node_keys)),
    )
    creds.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    creds.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    creds.server_key.write_bytes(pem_key(server_key, serialization.PrivateFormat.PKCS8))
    for path in creds.node_keys:
        key = ec.generate_private_key(ec.SECP384R1())
        path.write_bytes(pem_key(key, serialization.PrivateFormat.OpenSSH))
        path.with_suffix(".pub").write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
            )
        )
    for path in (creds.server_key, *creds.node_keys):
        path.chmod(0o600)
    return creds


@dataclasses.dataclass
class Deployment:
    """A SuperLink and its SuperNodes on 127.0.0.1, all under ``flwr_home``."""

    flwr_home: Path
    env: dict[str, str]
    connection: str
    link_port: int
    tls: TlsCredentials | None = None
    procs: list[subprocess.Popen] = dataclasses.field(default_factory=list)

    def start_supernode(
        self,
        index: int,
        num_partitions: int,
        *,
        key: Path | None = None,
        root_certificates: Path | None = None,
        extra: tuple[str, ...] = (),
        folder: str | None = None,
        node_config: str = "",
    ) -> subprocess.Popen:
        """Start SuperNode ``index`` (TLS: ``key`` and ``root_certificates``,
        by default its own key and the deployment's CA); teardown stops it.
        ``folder`` names its working folder (a restarted node needs a new one);
        ``node_config`` is added to its partition in ``--node-config``."""
        node_dir = self.flwr_home / (folder or f"supernode{index}")
        node_dir.mkdir()
        if self.tls is None:
            security = ["--insecure"]
        else:
            key = key if key is not None else self.tls.node_keys[index]
            ca = root_certificates or self.tls.ca_cert
            security = ["--root-certificates", str(ca)]
            security += ["--auth-supernode-private-key", str(key)]
        proc = subprocess.Popen(
            [
                flower_executable("flower-supernode"),
                *security,
                "--superlink",
                f"127.0.0.1:{self.link_port}",
                "--host",
                "127.0.0.1",
                "--port",
                str(free_port()),
                "--node-config",
                f"partition-id={index} num-partitions={num_partitions} {node_config}",
                *extra,
            ],
            cwd=node_dir,
            env={**self.env, "FLWR_HOME": str(node_dir)},
            start_new_session=True,
            stdout=open(node_dir / "supernode.out", "w"),
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    def submit(self, run_config: str, timeout: float = 180) -> str:
        """``flwr run`` the pack's app (the checkout) here; return the run id."""
        out = subprocess.run(
            [
                *(
                    flower_executable("flwr"),
                    "run",
                    ".",
                    self.connection,
                    "--format",
                    "json",
                ),
                *("--run-config", run_config),
            ],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=REPO,
            timeout=timeout,
            check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(f"flwr run failed: {out.stdout}{out.stderr}")
        return str(json.loads(out.stdout)["run-id"])

    def wait_finished(
        self, run_id: str, deadline: float | None = None, output: Path | None = None
    ) -> str:
        """:func:`wait_finished` on this deployment; ``output`` is the run's folder
        (its ``results.json`` says when the run ended)."""
        ended = None if output is None else (lambda: results_ended(output))
        return wait_finished(run_id, self.env, self.connection, deadline, ended)

    def register(self, public_key: Path) -> str:
        """``flwr supernode register``: allow the SuperNode holding this key in."""
        out = subprocess.run(
            [
                *(flower_executable("flwr"), "supernode", "register", str(public_key)),
                *(self.connection, "--format", "json"),
            ],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=REPO,
            timeout=60,
            check=False,
        )
        reply = json.loads(out.stdout) if out.returncode == 0 else {}
        assert reply.get("success"), out.stdout + out.stderr
        return str(reply["node-id"])


def make_signing_keys(folder: Path, num_nodes: int) -> tuple[list[Path], Path]:
    """One P-384 key pair per node, OpenSSH as SuperNode keys are, and the
    directory of their public keys: what secure aggregation's active-adversary
    mode reads from ``secagg-signing-key`` and ``secagg-key-directory``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    trusted = folder / "trusted"
    trusted.mkdir(parents=True)
    private = []
    for i in range(num_nodes):
        key = ec.generate_private_key(ec.SECP384R1())
        path = folder / f"node{i}"
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.OpenSSH,
                serialization.NoEncryption(),
            )
        )
        (trusted / f"node{i}.pub").write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
            )
        )
        private.append(path)
    return private, trusted


@contextlib.contextmanager
def deployment(
    flwr_home: Path,
    num_nodes: int,
    num_partitions: int | None = None,
    node_config: Callable[[int], str] | None = None,
) -> Iterator[Deployment]:
    """An insecure loopback deployment whose nodes can be killed and restarted.

    Node i serves partition i of ``num_partitions`` (default ``num_nodes``; more
    leaves partitions for nodes that join later); ``node_config(i)`` adds to
    its node config.
    """
    with _deployment(
        flwr_home, num_nodes, None, num_partitions, node_config
    ) as running:
        yield running


@contextlib.contextmanager
def _deployment(
    flwr_home: Path,
    num_nodes: int,
    tls: TlsCredentials | None,
    num_partitions: int | None = None,
    node_config: Callable[[int], str] | None = None,
) -> Iterator[Deployment]:
    env = flwr_env(flwr_home)
    link_port = free_port()
    link_dir = flwr_home / "superlink"
    link_dir.mkdir(parents=True)
    name = "loopback" if tls is None else "loopback-tls"
    security = (
        "insecure = true\n"
        if tls is None
        else f'root-certificates = "{tls.ca_cert.resolve()}"\n'
    )
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\n'
        f'address = "127.0.0.1:{link_port}"\n{security}'
    )
    if tls is None:
        link_security = ["--insecure"]
    else:
        link_security = [
            "--ssl-ca-certfile",
            str(tls.ca_cert),
            "--ssl-certfile",
            str(tls.server_cert),
            "--ssl-keyfile",
            str(tls.server_key),
            "--enable-supernode-auth",
        ]
    deployment = Deployment(flwr_home, env, name, link_port, tls)
    try:
        deployment.procs.append(
            subprocess.Popen(
                [
                    flower_executable("flower-superlink"),
                    *link_security,
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
        if tls is not None:
            # --enable-supernode-auth: only registered public keys may connect.
            _wait_listening(env, name)
            for i in range(num_nodes):
                deployment.register(tls.node_keys[i].with_suffix(".pub"))
        for i in range(num_nodes):
            deployment.start_supernode(
                i,
                num_partitions or num_nodes,
                node_config=node_config(i) if node_config else "",
            )
        _wait_online(env, num_nodes, name)
        yield deployment
    finally:
        groups = groups_started_under(flwr_home, [p.pid for p in deployment.procs])
        kill_groups(groups)
        for proc in deployment.procs:
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)


@contextlib.contextmanager
def tls_loopback_deployment(
    flwr_home: Path,
    num_nodes: int,
    tls: TlsCredentials,
    node_config: Callable[[int], str] | None = None,
) -> Iterator[Deployment]:
    """:func:`deployment` over TLS with SuperNode authentication.

    The SuperLink serves its one port (Fleet, Control and Runtime APIs) with
    ``tls``'s server certificate and ``--enable-supernode-auth``; the public keys
    of SuperNodes 0..num_nodes-1 are registered with ``flwr supernode register``
    before those SuperNodes start; the ``flwr`` CLI connection (``$FLWR_HOME/
    config.toml``) verifies the SuperLink with ``root-certificates``. ``tls`` must
    hold at least ``num_nodes`` node keys.
    """
    if len(tls.node_keys) < num_nodes:
        raise ValueError(f"{num_nodes} SuperNodes need as many keys in {tls}")
    with _deployment(flwr_home, num_nodes, tls, node_config=node_config) as deployment:
        yield deployment


def _supernode_list(
    env: dict[str, str], connection: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            flower_executable("flwr"),
            "supernode",
            "list",
            connection,
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        check=False,
    )


def _wait_listening(env: dict[str, str], connection: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        out = _supernode_list(env, connection)
        # (--format json exits 0 on failure too: read "success".)
        if out.returncode == 0 and '"success": true' in out.stdout:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the SuperLink did not answer: {out.stdout} {out.stderr}"
            )
        time.sleep(0.5)


def _wait_online(
    env: dict[str, str],
    num_nodes: int,
    connection: str = "loopback",
    timeout: float = 90,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = _supernode_list(env, connection)
        if out.returncode == 0 and out.stdout.count('"online"') >= num_nodes:
            return
        time.sleep(1)
    raise TimeoutError(
        f"{num_nodes} SuperNodes did not come online: {out.stdout} {out.stderr}"
    )

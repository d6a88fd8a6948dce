"""System test: the pack's app on a TLS deployment with SuperNode authentication.

A SuperLink on 127.0.0.1 serves TLS (a CA and a server certificate generated
here) with ``--enable-supernode-auth``; two SuperNodes whose public keys were
registered with ``flwr supernode register`` run the app through ``flwr run``
(the CLI verifies the SuperLink with ``root-certificates``). A SuperNode whose
key was never registered, and one that does not trust the SuperLink's
certificate, are refused; a run whose overrides name a callable off the
``_target_`` allow-list fails. What the README's Deployment section shows.
Every process is stopped by process group at the end.

Two SuperNodes and two rounds: Flower starts one ClientApp process per message,
so each node-round costs a Python start with torch (about 60 s in all on 2 idle
cores).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from flwr_prox_strategies._executables import flower_executable

from .engine import (
    check_results,
    flwr_run,
    make_tls_credentials,
    run_log,
    run_status,
    tls_loopback_deployment,
)

pytestmark = pytest.mark.slow


def exited(proc: subprocess.Popen, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    return proc.poll()


def test_tls_with_supernode_authentication(tmp_path: Path) -> None:
    creds = make_tls_credentials(tmp_path / "certs", num_node_keys=3)
    stranger = make_tls_credentials(tmp_path / "other-ca", num_node_keys=0)
    output = tmp_path / "out"
    home = tmp_path / "home"
    with tls_loopback_deployment(home, 2, creds) as deployment:
        # Key 2 was never registered; node 3 trusts another CA (the TLS
        # handshake fails before authentication).
        unregistered = deployment.start_supernode(2, 2, key=creds.node_keys[2])
        untrusting = deployment.start_supernode(
            3, 2, key=creds.node_keys[0], root_certificates=stranger.ca_cert
        )
        reply = flwr_run(
            deployment.env,
            deployment.connection,
            "--run-config",
            "overrides='strategy=fedavg num_clients=2 num_rounds=2 model=logreg "
            f"train.local_epochs=1' output-dir='{output}'",
            timeout=300,
        )
        status = run_status(reply["run-id"], deployment.env, deployment.connection)
        if status["status"] != "finished:completed":
            log = run_log(reply["run-id"], deployment.env, deployment.connection)
            pytest.fail(f"{status}\n{log[-3000:]}")
        # A run whose overrides ask for a callable off the allow-list fails in
        # the ServerApp before anything is built, saying how to allow it.
        refused = flwr_run(
            deployment.env,
            deployment.connection,
            "--run-config",
            "overrides='num_clients=2 strategy._target_=builtins.open'",
            timeout=120,
        )
        status = run_status(refused["run-id"], deployment.env, deployment.connection)
        assert status["status"] == "finished:failed", status
        log = run_log(refused["run-id"], deployment.env, deployment.connection)
        assert "strategy._target_='builtins.open' is not allowed" in log, log[-3000:]
        assert "FLWR_PROX_ALLOWED_TARGETS" in log
        # Refused: they exit (Flower's exit code 305) and never join.
        assert exited(unregistered, 30) not in (None, 0)
        assert exited(untrusting, 30) not in (None, 0)
        nodes = subprocess.run(
            [
                flower_executable("flwr"),
                "supernode",
                "list",
                deployment.connection,
                "--format",
                "json",
            ],
            capture_output=True,
            text=True,
            env=deployment.env,
            check=True,
        ).stdout
        assert nodes.count('"online"') == 2, nodes
    node_log = (home / "supernode2" / "supernode.out").read_text()
    assert "Failed to activate SuperNode" in node_log, node_log[-2000:]
    tls_log = (home / "supernode3" / "supernode.out").read_text()
    assert "CERTIFICATE_VERIFY_FAILED" in tls_log, tls_log[-2000:]
    # The run saw exactly the two registered nodes (the app checks num_clients).
    check_results(output, 2, "FedAvg")

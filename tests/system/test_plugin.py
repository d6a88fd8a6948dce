"""An algorithm installed as a plugin runs through `flwr run` like the pack's own.

The FedNova example (examples/plugin-fednova) is installed into a folder of
its own, beside the pack and without touching the environment, and reaches
every process through PYTHONPATH: the managed SuperLink, the ServerApp and the
ClientApps it starts find its entry point, its Hydra tree and its classes.
Its own engine: the session's ``engine`` may already run without that path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .engine import (
    REPO,
    check_results,
    groups_started_under,
    managed_engine,
    simulate,
)

pytestmark = pytest.mark.slow

PLUGIN = REPO / "examples" / "plugin-fednova"


def install_beside(target: Path) -> None:
    """``pip install`` the plugin into ``target`` only (no deps, no isolation)."""
    out = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "install", "--quiet"),
            *("--no-deps", "--no-build-isolation", "--target", str(target)),
            str(PLUGIN),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:  # ended since /proc was listed
        return None


def environ_of(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # ended since /proc was listed
        return None
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def test_fednova_plugin_through_flwr_run(tmp_path: Path) -> None:
    """strategy=fednova: found, configured, allowed and run to completion."""
    site = tmp_path / "site"
    install_beside(site)
    with managed_engine(tmp_path / "flwr-home") as env:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(site), env.get("PYTHONPATH", "")) if p
        )
        # The pack reads the entry point from the path alone, nothing installed.
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                "from flwr_prox_strategies.algorithms.plugins import "
                "registered_algorithms as r; print(sorted(r()))",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=True,
        )
        assert "'fednova'" in probe.stdout, probe.stdout + probe.stderr
        output = simulate(
            env,
            "strategy=fednova num_clients=4 num_rounds=2 model=logreg "
            "train.local_epochs=1",
            tmp_path / "out",
        )
        # The SuperLink this run started carries the path to what it starts.
        groups = groups_started_under(tmp_path / "flwr-home")
        started = [pid for pid in all_pids() if group_of(pid) in groups]
        assert started, "no engine process found under the run's FLWR_HOME"
        for pid in started:
            environ = environ_of(pid)
            if environ is not None:
                assert str(site) in environ.get("PYTHONPATH", ""), pid
    results = check_results(output, 2, "FedNova")
    last = results["rounds"][-1]["train"]
    # every client ran FedNovaRule, its term in every one of its steps
    assert last["fednova-applied"] == last["local-steps"] > 0
    assert last["replies-term-incomplete"] == 0
    assert last["fednova-tau-eff"] >= 1.0
    assert results["config"]["strategy"]["_target_"] == "flwr_fednova.FedNova"
    assert (
        results["config"]["client"]["_target_"] == "flwr_fednova.client.FedNovaClient"
    )

"""System test: the managed engine dies mid-run; `resume` finishes the run.

`flwr run` (no --stream) starts SCAFFOLD on 4 simulated SuperNodes; once the
app's checkpoint holds round 2, every process of the managed engine (SuperLink,
SuperExec, flwr-simulation, Ray) is SIGKILLed by process group, as a crash of the
machine's Flower side. A second `flwr run` with the same run config plus
``resume='<output folder>'`` starts a new SuperLink and a new run, whose
ClientApps (new Ray workers, empty ``context.state``) read their state back from
``<output folder>/client-state``. The run must complete, cover all rounds in
results.json, and end with the model of an uninterrupted run of the same app
(in-process, one torch thread as in the simulation's workers) to float rounding.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
from flwr_prox_strategies.experiment.checkpoint import CheckpointError, read_checkpoint
from flwr_prox_strategies.experiment.server import run_experiment

from .engine import (
    REPO,
    groups_started_under,
    kill_groups,
    managed_engine,
    run_log,
    run_status,
)

pytestmark = pytest.mark.slow

ROUNDS = 5
OVERRIDES = (
    f"strategy=scaffold num_clients=4 num_rounds={ROUNDS} model=logreg "
    "train.local_epochs=1"
)
FEDERATION = "num-supernodes=4 client-resources-num-cpus=1"


def submit(env: dict[str, str], run_config: str, *, stream: bool) -> dict:
    out = subprocess.run(
        [
            *("flwr", "run", ".", "--format", "json"),
            *(["--stream"] if stream else []),
            *("--federation-config", FEDERATION, "--run-config", run_config),
        ],
        capture_output=True,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
        cwd=REPO,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def wait_for_checkpoint(folder: Path, round_: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done = int(read_checkpoint(folder)["round"])
        except CheckpointError:
            done = 0
        if done >= round_:
            return done
        time.sleep(0.1)
    raise TimeoutError(f"no checkpoint of round {round_} in {folder}")


def uninterrupted(folder: Path) -> list[np.ndarray]:
    from apps.client_app import app as client_app

    run_config = {"overrides": OVERRIDES, "output-dir": str(folder)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        grid = InProcessGrid(client_app, num_nodes=4, run_config=run_config)
        result, _ = run_experiment(grid, run_config)
    finally:
        torch.set_num_threads(threads)
    return result.arrays.to_numpy_ndarrays()


def test_engine_killed_mid_run_then_resumed(tmp_path: Path) -> None:
    output = tmp_path / "out"
    home = tmp_path / "home"
    run_config = f"overrides='{OVERRIDES}' output-dir='{output}'"
    start = time.monotonic()
    with managed_engine(home) as env:
        first = submit(env, run_config, stream=False)
        wait_for_checkpoint(output, 2)
        up = time.monotonic()
        groups = groups_started_under(home)  # SuperLink, SuperExec, simulation, Ray
        for group in groups:  # a crash: SIGKILL at once, no clean shutdown
            os.killpg(group, signal.SIGKILL)
        kill_groups(groups)  # (waits until they are gone)
        killed = time.monotonic()
        killed_at = int(read_checkpoint(output)["round"])
        assert killed_at < ROUNDS, "the run ended before the engine was killed"
        partial = json.loads((output / "results.json").read_text())
        assert partial["summary"]["complete"] is False
        assert (output / "client-state").is_dir()

        second = submit(env, f"{run_config} resume='{output}'", stream=True)
        resumed_in = time.monotonic() - killed
        assert second["run-id"] != first["run-id"]
        status = run_status(second["run-id"], env)
        log = run_log(second["run-id"], env)
    assert status["status"] == "finished:completed", log[-3000:]
    assert f"Resuming {output} from round {killed_at}" in log
    results = json.loads((output / "results.json").read_text())
    assert results["summary"]["complete"] is True
    assert results["resumed"][0]["from-round"] == killed_at
    rounds = results["rounds"]
    assert [r["round"] for r in rounds] == list(range(ROUNDS + 1))
    assert all(r["train"]["replies-valid"] == 4 for r in rounds[1:])
    assert read_checkpoint(output)["round"] == ROUNDS

    resumed = read_checkpoint(output)["model"]["arrays"]
    reference = uninterrupted(tmp_path / "reference")
    gap = max(
        float(np.max(np.abs(a - b))) for a, b in zip(resumed, reference, strict=True)
    )
    print(
        f"killed at round {killed_at} after {up - start:.1f} s (kill: "
        f"{killed - up:.1f} s); resumed run: {resumed_in:.1f} s; "
        f"max |resumed - uninterrupted| = {gap:.3g}"
    )
    for a, b in zip(resumed, reference, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

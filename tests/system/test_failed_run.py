"""System test: a run that aggregates nothing is *failed* for Flower.

`flwr run --stream` exits 0 whatever happens to the ServerApp; the run's status
(`flwr ls --run-id <id> --format json`) is what says it failed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .engine import flwr_run, run_log, run_status

pytestmark = pytest.mark.slow


def test_a_run_without_an_aggregated_round_is_failed_in_flwr_ls(
    engine: dict[str, str], tmp_path: Path
) -> None:
    output = tmp_path / "out"
    overrides = (
        "num_clients=4 num_rounds=2 model=logreg train.local_epochs=1 "
        "train.learning_rate=-1"  # every client refuses it: nothing to aggregate
    )
    reply = flwr_run(
        engine,
        "--federation-config",
        "num-supernodes=4 client-resources-num-cpus=1",
        "--run-config",
        f"overrides='{overrides}' output-dir='{output}'",
    )
    status = run_status(reply["run-id"], engine)
    log = run_log(reply["run-id"], engine)
    assert status["status"] == "finished:failed", (status, log[-3000:])
    assert "NoRoundAggregatedError" in log and "0 aggregated" in log
    results = json.loads((output / "results.json").read_text())
    assert results["summary"]["complete"] is False
    assert "8 replies failed" in results["failure"]
    assert (output / "metrics.png").stat().st_size > 1000

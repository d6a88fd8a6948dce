"""The main job through the real engine: the fast suite's end-to-end `flwr run`.

The README's first command, made small: FedProx on digits through `flwr run .`
with Flower's managed local SuperLink and 4 simulated SuperNodes (Ray workers),
3 rounds. It checks what a user sees: the run ends ``finished:completed`` in
``flwr ls``, ``results.json`` holds every round with every client's reply
valid and the configured mu, and the plot is written. Every process the run
started is killed by process group at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .system.engine import check_results, managed_engine, simulate

SMALL = "num_clients=4 num_rounds=3 model=logreg train.local_epochs=1"


@pytest.mark.long
def test_the_main_job_through_flwr_run(tmp_path: Path) -> None:
    with managed_engine(tmp_path / "home") as env:
        output = simulate(
            env, f"strategy=fedprox strategy.mu=0.1 {SMALL}", tmp_path / "out"
        )
    results = check_results(output, 3, "FedProx")
    assert results["config"]["strategy"]["mu"] == 0.1

"""Flower's FedAvg over every node, 10 sampled per round; times each round's end."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

app = ServerApp()
SHAPES = [(784, 200), (200,), (200, 200), (200,), (200, 10), (10,)]


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run FedAvg; write the time at which each round ended to ``times-file``."""
    config = context.run_config
    nodes, per_round = int(config["num-nodes"]), int(config["per-round"])
    times_file = Path(str(config["times-file"]))
    start, ended = time.monotonic(), {}

    def stamp(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        ended[server_round] = time.monotonic() - start
        times_file.write_text(json.dumps(ended))
        return MetricRecord()

    strategy = FedAvg(
        fraction_train=per_round / nodes,
        fraction_evaluate=0.0,
        min_available_nodes=nodes,
        min_train_nodes=per_round,
    )
    rng = np.random.default_rng(0)
    arrays = ArrayRecord([rng.standard_normal(s).astype(np.float32) for s in SHAPES])
    strategy.start(
        grid=grid,
        initial_arrays=arrays,
        num_rounds=int(config["num-rounds"]),
        evaluate_fn=stamp,
    )

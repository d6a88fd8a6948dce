"""Flower's FedAvg over every node, 10 sampled per round; times each round's end.

With ``extra-records=1`` the strategy carries what SCAFFOLD and FedDC carry on
top of the model: a model-sized ``control`` record sent to every sampled node
with the model, and one back in every reply, averaged into the server's copy.
The pack's stateful algorithms are priced against this case: what the payload
itself costs on Flower's engine, with Flower's own aggregation.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

app = ServerApp()
# The MLP 784-200-200-10 as torch names and shapes its state dict (the client's
# ``train=1`` loads it into ``nn.Sequential``).
SHAPES = {
    "0.weight": (200, 784),
    "0.bias": (200,),
    "2.weight": (200, 200),
    "2.bias": (200,),
    "4.weight": (10, 200),
    "4.bias": (10,),
}
CONTROL = "control"


class FedAvgWithControl(FedAvg):
    """FedAvg that also sends, receives and averages a model-sized record."""

    def __init__(self, control: ArrayRecord, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.control = control

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))
        for message in messages:
            message.content[CONTROL] = self.control
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        contents = [r.content for r in replies if not r.has_error()]
        if contents:  # Flower's mean of the extra record, as SCAFFOLD's c
            self.control = aggregate_arrayrecords(
                [_only(c, CONTROL) for c in contents], self.weighted_by_key
            )
        for reply in replies:  # Flower's FedAvg takes one ArrayRecord a reply
            if not reply.has_error():
                del reply.content.array_records[CONTROL]
        return super().aggregate_train(server_round, replies)


def _only(content: RecordDict, name: str) -> RecordDict:
    """The reply with ``name`` as its only ArrayRecord (Flower's aggregation reads one)."""
    return RecordDict(
        {"arrays": content.array_records[name], "metrics": content["metrics"]}
    )


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

    settings = {
        "fraction_train": per_round / nodes,
        "fraction_evaluate": 0.0,
        "min_available_nodes": nodes,
        "min_train_nodes": per_round,
    }
    rng = np.random.default_rng(0)
    arrays = ArrayRecord(
        {
            name: Array(
                (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
                if len(s) == 2
                else np.zeros(s, np.float32)
            )
            for name, s in SHAPES.items()
        }
    )
    if int(config.get("extra-records", 0)):
        zeros = ArrayRecord(
            {n: Array(np.zeros(s, np.float32)) for n, s in SHAPES.items()}
        )
        strategy: FedAvg = FedAvgWithControl(zeros, **settings)
    else:
        strategy = FedAvg(**settings)  # type: ignore[arg-type]
    strategy.start(
        grid=grid,
        initial_arrays=arrays,
        num_rounds=int(config["num-rounds"]),
        evaluate_fn=stamp,
    )

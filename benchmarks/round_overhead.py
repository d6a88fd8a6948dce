"""Seconds per round: the pack's FedProx against Flower's own FedProx/FedAvg.

Same grid, same ClientApp, same model and data, same sampled nodes (all of
them): the difference is the strategy's own work (sampling, message building,
validation, aggregation). Flower's ``FedProx`` is Flower's ``FedAvg`` plus the
``proximal-mu`` key, so it can drive the same ``FedProxClient``.

Engines: ``inprocess`` (the pack's InProcessGrid: no engine noise, isolates the
strategy) and ``flwr`` is left to ``benchmarks/README.md`` (Ray start-up noise
dominates sub-second rounds).

Run: ``python benchmarks/round_overhead.py [--rounds 5] [--nodes 10 100]``.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
from flwr.app import ArrayRecord
from flwr.common.logger import FLOWER_LOGGER
from flwr.serverapp.strategy import FedProx as FlowerFedProx

from flwr_prox_strategies import FedProx, FedProxClient, to_client_app
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
from flwr_prox_strategies.experiment.data import to_loader
from flwr_prox_strategies.task.datasets import load_digits
from flwr_prox_strategies.task.models import MLP
from flwr_prox_strategies.task.partition import partition_indices


def client_app(num_nodes: int):
    data = load_digits()
    parts = partition_indices(
        data.train.y, num_partitions=num_nodes, scheme="iid", seed=0
    )

    def client_fn(context):
        pid = int(context.node_config["partition-id"])
        loader = to_loader(data.train.subset(parts[pid]), batch_size=16, shuffle=True)
        return FedProxClient(
            MLP(in_features=64, num_classes=10),
            loader,
            local_epochs=1,
            learning_rate=0.1,
            seed=pid,
        )

    return to_client_app(client_fn)


def seconds_per_round(strategy, num_nodes: int, rounds: int) -> float:
    torch.manual_seed(0)
    grid = InProcessGrid(client_app(num_nodes), num_nodes=num_nodes)
    arrays = ArrayRecord(MLP(in_features=64, num_classes=10).state_dict())
    strategy.start(grid=grid, initial_arrays=arrays, num_rounds=1)  # warm-up
    start = time.perf_counter()
    strategy.start(grid=grid, initial_arrays=arrays, num_rounds=rounds)
    return (time.perf_counter() - start) / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nodes", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    FLOWER_LOGGER.setLevel(logging.WARNING)
    print(
        f"{'nodes':>6}{'pack FedProx s/round':>22}{'Flower FedProx s/round':>24}{'ratio':>8}"
    )
    for nodes in args.nodes:
        ours, theirs = [], []
        for _ in range(args.repeats):  # interleave to share machine noise
            ours.append(
                seconds_per_round(
                    FedProx(mu=0.01, min_available_nodes=nodes, fraction_evaluate=0.0),
                    nodes,
                    args.rounds,
                )
            )
            theirs.append(
                seconds_per_round(
                    FlowerFedProx(
                        proximal_mu=0.01,
                        min_available_nodes=nodes,
                        min_train_nodes=nodes,
                        fraction_evaluate=0.0,
                    ),
                    nodes,
                    args.rounds,
                )
            )
        a, b = min(ours), min(theirs)
        print(f"{nodes:>6}{a:>22.4f}{b:>24.4f}{a / b:>8.3f}")


if __name__ == "__main__":
    main()

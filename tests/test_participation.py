"""Participation rules: exactly m per round, or each client with probability p."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_prox_strategies import FedAvg, FedAvgClient, to_client_app
from flwr_prox_strategies.core.privacy.central import central_dp
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid

from .lsq import LeastSquares


def sample_sizes(strategy: FedAvg, grid: InProcessGrid, rounds: int) -> list[int]:
    return [
        len(
            strategy.sample_nodes(
                grid,
                t,
                fraction=strategy.fraction_train,
                minimum=strategy.min_train_nodes,
                stream=0,
                bernoulli=strategy.participation == "bernoulli",
            )[0]
        )
        for t in range(1, rounds + 1)
    ]


def test_bernoulli_counts_vary_like_the_official_act_prob() -> None:
    grid = InProcessGrid(lambda m, c: m, num_nodes=100)
    strategy = FedAvg(fraction_train=0.1, participation="bernoulli", min_train_nodes=1)
    sizes = sample_sizes(strategy, grid, 200)
    # Binomial(100, 0.1): mean 10, sd 3; 200 draws span about 3 .. 19.
    assert min(sizes) >= 1 and min(sizes) <= 5 and max(sizes) >= 15
    assert abs(np.mean(sizes) - 10) < 1.0
    assert sizes == sample_sizes(strategy, grid, 200)  # seeded per round
    other = FedAvg(fraction_train=0.1, participation="bernoulli", seed=1)
    assert sample_sizes(other, grid, 200) != sizes
    fixed = FedAvg(fraction_train=0.1, min_train_nodes=1)
    assert set(sample_sizes(fixed, grid, 50)) == {10}


def test_bernoulli_redraws_below_the_minimum_and_skips_retired_nodes() -> None:
    grid = InProcessGrid(lambda m, c: m, num_nodes=10)
    strategy = FedAvg(fraction_train=0.05, participation="bernoulli", min_train_nodes=2)
    retired = set(sorted(grid.get_node_ids())[:5])
    for t in range(1, 101):
        nodes, connected = strategy.sample_nodes(
            grid, t, fraction=0.05, minimum=2, stream=0, exclude=retired, bernoulli=True
        )
        assert connected == 10 and len(nodes) >= 2 and not set(nodes) & retired
    hopeless = FedAvg(fraction_train=1e-4, participation="bernoulli")
    with pytest.raises(ValueError, match="raise fraction_train"):
        hopeless.sample_nodes(
            grid, 1, fraction=1e-4, minimum=8, stream=0, bernoulli=True
        )


def test_bernoulli_rounds_train_a_varying_number_of_clients() -> None:
    problem = LeastSquares(num_clients=8)
    trained: list[int] = []
    app = to_client_app(problem.client_fn(FedAvgClient, local_epochs=1))

    def counting(message, context):
        if message.metadata.message_type == "train":
            trained.append(int(message.content["config"]["server-round"]))
        return app(message, context)

    grid = InProcessGrid(counting, num_nodes=8)
    strategy = FedAvg(
        fraction_train=0.5,
        participation="bernoulli",
        min_train_nodes=1,
        min_available_nodes=8,
    )
    strategy.start(grid=grid, initial_arrays=problem.initial(), num_rounds=8)
    per_round = [trained.count(t) for t in range(1, 9)]
    expected = sample_sizes(strategy, grid, 8)
    assert per_round == expected and len(set(per_round)) > 1


def test_participation_is_checked() -> None:
    with pytest.raises(ValueError, match="participation"):
        FedAvg(participation="poisson")
    with pytest.raises(ValueError, match="participation='fixed'"):
        central_dp(
            FedAvg(participation="bernoulli"),
            clipping="server",
            noise_multiplier=1.0,
            clipping_norm=1.0,
            num_sampled_clients=2,
        )

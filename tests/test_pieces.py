"""Round pieces: the base's keywords build the pack's own, a user's compose with them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from flwr_prox_strategies import FedAvg, FedProx
from flwr_prox_strategies.extend import (
    DissimilarityMonitor,
    LearningRateDecay,
    RoundPiece,
    ValidReply,
)

from .helpers import configure, model_arrays, record, reply, sampling_grid


class Momentum(RoundPiece):
    """A user's piece: sends a value, expects a record, reports a metric."""

    def train_config(self, server_round: int) -> dict[str, Any]:
        return {"my-momentum": 0.5 * server_round}

    def expected_arrays(self, model):
        return {"velocity": model}

    def metrics(self, replies: list[ValidReply], weight) -> dict[str, float]:
        norms = [
            float(np.sum(r.arrays["velocity"]["w"].astype(np.float64) ** 2))
            for r in replies
        ]
        return {"velocity-sq-norm-max": max(norms)}


def test_the_keywords_build_the_packs_pieces_in_order() -> None:
    assert FedAvg().pieces == ()
    strategy = FedProx(mu=0.1, lr_decay=0.9, monitor_dissimilarity=True)
    assert strategy.pieces == (LearningRateDecay(0.9), DissimilarityMonitor())
    assert strategy.lr_decay == 0.9 and strategy.monitor_dissimilarity


def test_a_users_piece_goes_out_is_checked_and_reported() -> None:
    strategy = FedAvg(min_available_nodes=3, lr_decay=0.5, pieces=[Momentum()])
    messages = configure(strategy, model_arrays(), sampling_grid(3), server_round=3)
    config = messages[0].content["config"]
    assert config["my-momentum"] == 1.5  # the user's value
    assert config["lr-scale"] == 0.25  # the decay's, still there: 0.5 ** (3 - 1)
    assert set(strategy.expected_train_arrays(3)) == {"arrays", "velocity"}
    velocities = [np.full((4, 3), i, np.float32) for i in range(3)]
    replies = [
        reply(
            m,
            model_arrays(),
            extra_records={"velocity": record({"w": v, "b": np.zeros(3, np.float32)})},
        )
        for m, v in zip(messages, velocities, strict=True)
    ]
    # A reply without the piece's record is screened out, the others averaged.
    replies[0] = reply(messages[0], model_arrays())
    _, metrics = strategy.aggregate_train(3, replies)
    assert metrics["replies-rejected"] == 1
    assert metrics["velocity-sq-norm-max"] == pytest.approx(12 * 2.0**2)


@pytest.mark.parametrize("bad", [Momentum(), [Momentum(), "lr"], "lr-decay"])
def test_anything_but_a_sequence_of_pieces_is_refused_naming_pieces(bad) -> None:
    with pytest.raises(TypeError, match="pieces must be a sequence of RoundPiece"):
        FedAvg(pieces=bad)

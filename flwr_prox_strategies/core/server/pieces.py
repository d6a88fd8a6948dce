"""Single-paper features a strategy composes: a learning-rate schedule, a monitor.

A :class:`RoundPiece` may add values to every train config, records every train
reply must carry, and metrics of the round's valid replies; the base strategy
asks each of its pieces in turn (:func:`round_pieces` builds them from its
``lr_decay`` and ``monitor_dissimilarity`` keywords, and adds the strategy's
``pieces=``, a user's own; the stragglers of the FedProx paper are the
sampler's piece, :class:`.sampling.Stragglers`). None is on by default, and a
strategy without them sends, expects and logs nothing more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..contract.validation import ValidReply
from ..transport.keys import GRADIENT_RECORD, LR_SCALE_KEY, REPORT_GRADIENT_KEY
from ..transport.records import RecordSpec
from .metrics import dissimilarity_metrics


class RoundPiece:
    """A feature of the round; each hook's default adds nothing."""

    def train_config(self, server_round: int) -> dict[str, Any]:
        """Return values added to every train config of ``server_round``."""
        return {}

    def expected_arrays(self, model: RecordSpec) -> dict[str, RecordSpec]:
        """Return records a train reply must carry besides the model (``model``)."""
        return {}

    def metrics(
        self, replies: list[ValidReply], weight: Callable[[ValidReply], float]
    ) -> dict[str, float]:
        """Return metrics of the round's valid replies (weighted by ``weight``)."""
        return {}


@dataclass(frozen=True)
class LearningRateDecay(RoundPiece):
    """Round ``t`` sends ``lr-scale = decay ** (t - 1)``; clients scale their step.

    The official FedDyn and FedDC codes decay every algorithm's rate by 0.998.

    Parameters
    ----------
    decay : float
        The factor per round, in ``(0, 1]`` (the base's ``lr_decay`` checks it).
    """

    decay: float

    def train_config(self, server_round: int) -> dict[str, Any]:
        """Return ``{"lr-scale": decay ** (server_round - 1)}``."""
        return {LR_SCALE_KEY: self.decay ** (server_round - 1)}


@dataclass(frozen=True)
class DissimilarityMonitor(RoundPiece):
    """The FedProx paper's dissimilarity ``B = E_k||grad f_k||^2 / ||grad f||^2``.

    Clients are asked for their full local gradient at the global model (one
    extra pass, one model-sized upload); each round logs ``dissimilarity-b``.
    """

    def train_config(self, server_round: int) -> dict[str, Any]:
        """Ask every client for its gradient (``report-gradient``)."""
        return {REPORT_GRADIENT_KEY: True}

    def expected_arrays(self, model: RecordSpec) -> dict[str, RecordSpec]:
        """Expect the gradient, laid out as the model."""
        return {GRADIENT_RECORD: model}

    def metrics(
        self, replies: list[ValidReply], weight: Callable[[ValidReply], float]
    ) -> dict[str, float]:
        """Return ``dissimilarity-b`` and ``grad-sq-norm-global``."""
        return dissimilarity_metrics(replies, weight)


def round_pieces(
    *,
    lr_decay: float,
    monitor_dissimilarity: bool,
    own: Sequence[RoundPiece] = (),
) -> tuple[RoundPiece, ...]:
    """Return the pieces the base's keywords ask for, then ``own``, in that order.

    Raises
    ------
    TypeError
        If ``own`` is not a sequence of :class:`RoundPiece`, naming ``pieces``.
    """
    if isinstance(own, RoundPiece | str) or not all(
        isinstance(piece, RoundPiece) for piece in own
    ):
        raise TypeError(
            f"pieces must be a sequence of RoundPiece (flwr_prox_strategies.extend), "
            f"got {own!r}"
        )
    pieces: list[RoundPiece] = []
    if lr_decay != 1.0:
        pieces.append(LearningRateDecay(lr_decay))
    if monitor_dissimilarity:
        pieces.append(DissimilarityMonitor())
    return (*pieces, *own)

"""Track any Flower strategy from your own ServerApp, in one line.

.. code-block:: python

    strategy = Tracked(FedProx(proximal_mu=0.1), WandbTracker(run=wandb.run))

:class:`Tracked` logs what the pack's own runs log, round by round: the
aggregated train and evaluate metrics, the central evaluation, the number of
replies, the round's time. It wraps the pack's strategies, their wrappers and
Flower's own strategies alike; the wrapped strategy's run checks and failures
apply (a :class:`~flwr_prox_strategies.core.wrapper.StrategyWrapper`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from ..core.wrapper import EvaluateFn, StrategyWrapper
from .base import InBackground, Tracker, flat_params, round_metrics


class Tracked(StrategyWrapper):
    """Wrap ``strategy`` so that every round is logged to ``tracker``.

    Each round becomes one step of the tracker (the round number): the
    wrapped strategy's aggregated train metrics as ``train/<name>``, its
    aggregated evaluate metrics as ``evaluate/<name>``, the central evaluation
    (``evaluate_fn``) as ``central/<name>``, the replies received as
    ``train/replies-received`` and ``evaluate/replies-received``, those that
    carry an error (a client that failed) as ``train/replies-with-error`` and
    ``evaluate/replies-with-error`` (the pack's strategies add how many were
    valid), and the round's wall time as
    ``timing/round-s``. The round is logged when its last part ends: after the
    central evaluation when ``start`` has an ``evaluate_fn``, else after the
    federated evaluation.

    The tracker runs in the background (:class:`~.base.InBackground`) unless
    ``background=False``; ``start`` closes it at the end, a failed run marked
    failed, unless ``close=False`` (to log more to the same run afterwards).
    Every other attribute is the wrapped strategy's.

    Parameters
    ----------
    strategy : Strategy
        Any Flower strategy: the pack's, Flower's own, your subclass.
    tracker : Tracker
        Where to log (:class:`~.backends.WandbTracker` with your ``wandb.run``,
        :class:`~.backends.MLflowTracker`, :class:`~.backends.TensorBoardTracker`).
    params : Mapping[str, Any] | None (default: None)
        Parameters of the run to record (a nested mapping is flattened to
        dotted names).
    background : bool (default: True)
        Run the tracker on a thread of its own, so no round waits for it.
    close : bool (default: True)
        Close the tracker when ``start`` returns or fails.
    """

    def __init__(
        self,
        strategy: Strategy,
        tracker: Tracker,
        *,
        params: Mapping[str, Any] | None = None,
        background: bool = True,
        close: bool = True,
    ) -> None:
        super().__init__(strategy)
        if not isinstance(tracker, Tracker):
            raise TypeError(
                f"tracker must be a flwr_prox_strategies.tracking.Tracker, got "
                f"{type(tracker).__name__}"
            )
        self.tracker: Tracker = InBackground(tracker) if background else tracker
        self.close_at_end = close
        if params:
            self.tracker.log_params(flat_params(params))
        self._round: dict[str, Any] = {}
        self._round_started = time.monotonic()

    def __repr__(self) -> str:
        """Return the wrapper, the strategy and the backend."""
        return f"Tracked({self.strategy!r}, {self.tracker.name})"

    # --- the round, as the wrapped strategy runs it --------------------------

    def _begin(self, server_round: int) -> None:
        if self._round.get("round") != server_round:
            self._round = {"round": server_round}
            self._round_started = time.monotonic()

    def _add(
        self,
        server_round: int,
        section: str,
        metrics: MetricRecord | None,
        replies: list[Message] | None = None,
    ) -> None:
        self._begin(server_round)
        values = dict(metrics) if metrics is not None else {}
        if replies is not None:  # a round of error replies must not look fine
            values["replies-received"] = len(replies)
            values["replies-with-error"] = sum(m.has_error() for m in replies)
        self._round.setdefault(section, {}).update(values)

    def _end(self, server_round: int) -> None:
        self._begin(server_round)
        self._round["timing"] = {"round-s": time.monotonic() - self._round_started}
        self.tracker.log_metrics(round_metrics(self._round), step=server_round)
        self._round = {}

    # --- Flower's hooks: the wrapped strategy's, logged ----------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Start the round's clock; the wrapped strategy's ``configure_train``."""
        self._begin(server_round)
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Run the wrapped strategy's ``aggregate_train``; keep its metrics."""
        replies = list(replies)
        arrays, metrics = super().aggregate_train(server_round, replies)
        self._add(server_round, "train", metrics, replies)
        return arrays, metrics

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Run the wrapped strategy's ``aggregate_evaluate``; log a finished round."""
        replies = list(replies)
        metrics = super().aggregate_evaluate(server_round, replies)
        self._add(server_round, "evaluate", metrics, replies)
        if not self._central:
            self._end(server_round)
        return metrics

    # --- the run -------------------------------------------------------------
    _central = False  # whether start was given an evaluate_fn

    def central_evaluation(self, evaluate_fn: EvaluateFn | None) -> EvaluateFn | None:
        """Log the central evaluation as ``central/<name>``; it ends the round."""
        evaluate_fn = super().central_evaluation(evaluate_fn)
        self._central = evaluate_fn is not None
        if evaluate_fn is None:
            return None
        inner = evaluate_fn

        def central(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            metrics = inner(server_round, arrays)
            if server_round > 0:  # round 0: the initial model, before any round
                self._add(server_round, "central", metrics)
                self._end(server_round)
            elif metrics is not None:
                self.tracker.log_metrics(
                    round_metrics({"central": dict(metrics)}), step=0
                )
            return metrics

        return central

    def close_run(self, failed: bool) -> None:
        """End the wrapped strategy's run; close the tracker (a failed run: failed)."""
        try:
            super().close_run(failed)
        finally:
            if self.close_at_end:
                self.tracker.close(failed=failed)


__all__ = ["Tracked"]

"""Track any Flower strategy from your own ServerApp, in one line.

.. code-block:: python

    strategy = Tracked(FedProx(proximal_mu=0.1), WandbTracker(run=wandb.run))

:class:`Tracked` logs what the pack's own runs log, round by round: the
aggregated train and evaluate metrics, the central evaluation, the number of
replies, the round's time. It wraps the pack's strategies and Flower's own
alike, and keeps the wrapped strategy's ``start`` (its checks and failures).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from .base import InBackground, Tracker, flat_params, round_metrics


class Tracked(Strategy):
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
        if not isinstance(strategy, Strategy):
            raise TypeError(
                f"strategy must be a Flower Strategy, got {type(strategy).__name__}"
            )
        if not isinstance(tracker, Tracker):
            raise TypeError(
                f"tracker must be a flwr_prox_strategies.tracking.Tracker, got "
                f"{type(tracker).__name__}"
            )
        self.strategy = strategy
        self.tracker: Tracker = InBackground(tracker) if background else tracker
        self.close_at_end = close
        if params:
            self.tracker.log_params(flat_params(params))
        self._round: dict[str, Any] = {}
        self._round_started = time.monotonic()

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this wrapper lacks: the strategy's own.
        if name == "strategy":
            raise AttributeError(name)
        return getattr(self.strategy, name)

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

    def _configure_train(
        self, original: Callable[..., Iterable[Message]], server_round: int, *args: Any
    ) -> Iterable[Message]:
        self._begin(server_round)
        return original(server_round, *args)

    def _aggregate_train(
        self,
        original: Callable[..., tuple[ArrayRecord | None, MetricRecord | None]],
        server_round: int,
        replies: Iterable[Message],
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        arrays, metrics = original(server_round, replies)
        self._add(server_round, "train", metrics, replies)
        return arrays, metrics

    def _aggregate_evaluate(
        self,
        original: Callable[..., MetricRecord | None],
        server_round: int,
        replies: Iterable[Message],
    ) -> MetricRecord | None:
        replies = list(replies)
        metrics = original(server_round, replies)
        self._add(server_round, "evaluate", metrics, replies)
        if not self._central:
            self._end(server_round)
        return metrics

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Start the round's clock; the wrapped strategy's ``configure_train``."""
        return self._configure_train(
            self.strategy.configure_train, server_round, arrays, config, grid
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Run the wrapped strategy's ``aggregate_train``; keep its metrics."""
        return self._aggregate_train(
            self.strategy.aggregate_train, server_round, replies
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Run the wrapped strategy's ``configure_evaluate``."""
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Run the wrapped strategy's ``aggregate_evaluate``; log a finished round."""
        return self._aggregate_evaluate(
            self.strategy.aggregate_evaluate, server_round, replies
        )

    def summary(self) -> None:
        """Log the wrapped strategy's ``summary``."""
        self.strategy.summary()

    _central = False  # whether start was given an evaluate_fn

    @contextlib.contextmanager
    def _routed_through_self(self) -> Iterator[None]:
        """Route the wrapped strategy's own calls of its hooks through this wrapper.

        ``strategy.start`` calls ``self.aggregate_train`` and the rest on the
        strategy: for the duration, those names on the instance point to this
        wrapper's hooks around the strategy's methods (whatever stood on the
        instance before is put back).
        """
        hooks: dict[str, Callable[..., Any]] = {
            "configure_train": self._configure_train,
            "aggregate_train": self._aggregate_train,
            "aggregate_evaluate": self._aggregate_evaluate,
        }
        inner = self.strategy
        saved = {name: vars(inner)[name] for name in hooks if name in vars(inner)}
        for name, hook in hooks.items():
            setattr(inner, name, functools.partial(hook, getattr(inner, name)))
        try:
            yield
        finally:
            for name in hooks:
                if name in saved:
                    setattr(inner, name, saved[name])
                else:
                    delattr(inner, name)

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run the wrapped strategy's ``start``, logging every round.

        Parameters
        ----------
        grid : Grid
            The grid the ServerApp received.
        initial_arrays : ArrayRecord
            The initial global model.
        num_rounds : int (default: 3)
            Rounds to run.
        timeout : float (default: 3600)
            Seconds to wait for a round's replies.
        train_config, evaluate_config : ConfigRecord | None (default: None)
            Sent with every train / evaluate message.
        evaluate_fn : callable | None (default: None)
            Central evaluation, ``evaluate_fn(server_round, arrays)``; its
            metrics are logged as ``central/<name>``.

        Returns
        -------
        Result
            The wrapped strategy's ``Result``.
        """
        self._central = evaluate_fn is not None
        central = None
        if evaluate_fn is not None:

            def central(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
                metrics = evaluate_fn(server_round, arrays)
                if server_round > 0:  # round 0: the initial model, before any round
                    self._add(server_round, "central", metrics)
                    self._end(server_round)
                elif metrics is not None:
                    self.tracker.log_metrics(
                        round_metrics({"central": dict(metrics)}), step=0
                    )
                return metrics

        failed = True
        try:
            with self._routed_through_self():
                result = self.strategy.start(
                    grid=grid,
                    initial_arrays=initial_arrays,
                    num_rounds=num_rounds,
                    timeout=timeout,
                    train_config=train_config,
                    evaluate_config=evaluate_config,
                    evaluate_fn=central,
                )
            failed = False
            return result
        finally:
            if self.close_at_end:
                self.tracker.close(failed=failed)


__all__ = ["Tracked"]

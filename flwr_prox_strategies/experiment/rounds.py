"""Round-by-round recording: what each round's end writes, as the round ends.

The run step (:mod:`.run`) passes :class:`RoundEnd` to ``Strategy.start`` as its
``evaluate_fn``, and lets it observe the strategy's aggregation: each round's
central evaluation, its client metrics and its timing reach ``results.json``
and the tracker as the round ends, and a checkpoint (:mod:`.checkpoint`) is
written every ``checkpoint_every`` rounds.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, MetricRecord

from ..tracking import Tracker, round_metrics
from .checkpoint import record_to_saved, rng_state, write_checkpoint
from .results import RunRecorder


class RoundEnd:
    """The end of every round: central evaluation, ``results.json``, checkpoint.

    Passed to ``Strategy.start`` as ``evaluate_fn`` (Flower calls it after
    every round, and once before the first), with :meth:`observing` around
    ``start`` so each round's client metrics reach ``results.json`` as the
    round ends. Round numbers here are the run's: a resumed ``start`` counts
    from 1 again, ``offset`` (the checkpoint's round) is added. With a
    ``tracker``, each round of ``results.json`` is logged to it as it ends.
    """

    def __init__(
        self,
        *,
        recorder: RunRecorder,
        central: Callable[[int, ArrayRecord], MetricRecord] | None,
        strategy: Any,
        every: int,
        num_rounds: int,
        offset: int,
        document: Mapping[str, Any],
        tracker: Tracker | None = None,
    ) -> None:
        self.recorder = recorder
        self.tracker = tracker
        self.central = central
        self.strategy = strategy
        self.every = every
        self.num_rounds = num_rounds
        self.offset = offset
        self.document = dict(document)
        self.checkpoint_seconds = 0.0
        self.checkpoints = 0
        # Where the time between two round ends went (see timing()).
        self._last_end = recorder.elapsed()
        self._strategy_s = 0.0
        self._write_s = 0.0

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """End round ``server_round`` of ``start`` (Flower's ``evaluate_fn``)."""
        rnd = server_round + self.offset
        if server_round == 0 and self.offset:
            self._last_end = self.recorder.elapsed()
            return None  # the checkpoint's round: evaluated before the crash
        started = time.monotonic()
        metrics = self.central(rnd, arrays) if self.central is not None else None
        central_s = time.monotonic() - started
        if rnd > 0 and rnd in self.recorder.rounds:
            self.recorder.record(rnd, "timing", self.timing(central_s))
        self._strategy_s = 0.0
        self._last_end = self.recorder.elapsed()
        writing = time.monotonic()
        self.recorder.end_round(rnd)
        entry = self.recorder.rounds.get(rnd)
        if self.tracker is not None and entry is not None:
            self.tracker.log_metrics(round_metrics(entry), step=rnd)
        if self.every and rnd > 0 and (rnd % self.every == 0 or rnd == self.num_rounds):
            self.save(rnd, arrays)
        self._write_s = time.monotonic() - writing
        return metrics

    def timing(self, central_s: float) -> dict[str, float]:
        """Split the time since the last round ended into its parts (seconds).

        ``round-s`` is that whole time: ``strategy-s`` the strategy's own work
        (configure and aggregate, train and evaluate), ``central-s`` the central
        evaluation, ``write-s`` writing ``results.json`` and the checkpoint at
        the previous round's end, and ``grid-s`` the rest: waiting for the
        replies, i.e. the engine and the clients' work.
        """
        round_s = self.recorder.elapsed() - self._last_end
        parts = {
            "strategy-s": self._strategy_s,
            "central-s": central_s,
            "write-s": self._write_s,
        }
        return {
            "round-s": round_s,
            "grid-s": max(round_s - sum(parts.values()), 0.0),
            **parts,
        }

    def save(self, rnd: int, arrays: ArrayRecord) -> Path:
        """Write the checkpoint of round ``rnd`` (model, state, RNG, results)."""
        start = dt.datetime.now()
        path = write_checkpoint(
            self.recorder.output_dir,
            {
                **self.document,
                "round": rnd,
                "num-rounds": self.num_rounds,
                "model": record_to_saved(arrays),
                "strategy": self.strategy.state_dict(),
                "rejections": dict(getattr(self.strategy, "rejections", {})),
                "rng": rng_state(),
                "results": self.recorder.state(),
                "saved-at": start.isoformat(timespec="seconds"),
            },
        )
        self.checkpoint_seconds += (dt.datetime.now() - start).total_seconds()
        self.checkpoints += 1
        return path

    def on_train(self, server_round: int, metrics: MetricRecord | None) -> None:
        """Record a round's aggregated train metrics as it is aggregated."""
        if metrics is not None:
            self.recorder.record(server_round + self.offset, "train", dict(metrics))

    def on_evaluate(self, server_round: int, metrics: MetricRecord | None) -> None:
        """Record a round's aggregated federated-evaluation metrics."""
        if metrics is not None:
            self.recorder.record(server_round + self.offset, "evaluate", dict(metrics))

    @contextlib.contextmanager
    def observing(self, strategy: Any) -> Iterator[None]:
        """Route ``strategy``'s aggregate_train/aggregate_evaluate results here.

        The strategy's methods are shadowed on the instance for the duration
        (``Strategy.start`` calls them through ``self``), then restored.
        """
        train = strategy.aggregate_train
        evaluate = strategy.aggregate_evaluate

        def aggregate_train(server_round: int, replies: Any) -> Any:
            arrays, metrics = train(server_round, replies)
            self.on_train(server_round, metrics)
            return arrays, metrics

        def aggregate_evaluate(server_round: int, replies: Any) -> Any:
            metrics = evaluate(server_round, replies)
            self.on_evaluate(server_round, metrics)
            return metrics

        shadows = {
            "aggregate_train": aggregate_train,
            "aggregate_evaluate": aggregate_evaluate,
            "configure_train": strategy.configure_train,
            "configure_evaluate": strategy.configure_evaluate,
        }
        for name, method in shadows.items():
            setattr(strategy, name, self._timed(method))
        try:
            yield
        finally:
            for name in shadows:
                delattr(strategy, name)

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """Return ``method``, its time added to this round's ``strategy-s``."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            try:
                return method(*args, **kwargs)
            finally:
                self._strategy_s += time.monotonic() - started

        return timed

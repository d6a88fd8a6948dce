"""One ``start()`` for the pack, and one way to wrap a strategy.

:class:`RunLifecycle` and :class:`StrategyWrapper`, and how wrappers compose:
``docs/explanation/architecture.md``. Secure aggregation and central DP need the
strategy itself inside (they read its checks and its sums).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


class RunLifecycle(Strategy):
    """Flower's ``Strategy.start`` between the run's first and last steps.

    Subclasses override the steps they need; each default does nothing.
    """

    def begin_run(self, initial_arrays: ArrayRecord, num_rounds: int) -> None:
        """Prepare a run of ``num_rounds`` from ``initial_arrays`` (default: none)."""

    def end_run(
        self, result: Result, num_rounds: int, name: str | None = None
    ) -> Result:
        """Check the finished run's ``result`` and return it (default: as it is).

        ``name`` is how a failure names the strategy (a wrapper passes its own).
        """
        return result

    def close_run(self, failed: bool) -> None:
        """Release what the run holds, whatever happened (default: nothing).

        Called once ``begin_run`` was called, even when it raised.
        """

    def central_evaluation(self, evaluate_fn: EvaluateFn | None) -> EvaluateFn | None:
        """Return the ``evaluate_fn`` Flower's loop calls (default: the given one)."""
        return evaluate_fn

    @property
    def run_name(self) -> str:
        """The name the run's messages give this strategy (wrappers add theirs)."""
        return type(self).__name__

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
    ) -> Result:
        """Run Flower's ``Strategy.start``; fail loudly if no round was aggregated.

        Parameters
        ----------
        grid : Grid
            The grid the ServerApp received.
        initial_arrays : ArrayRecord
            The initial global model.
        num_rounds : int (default: 3)
            Rounds of training (and evaluation) to run.
        timeout : float (default: 3600)
            Seconds to wait for a round's replies.
        train_config, evaluate_config : ConfigRecord | None (default: None)
            Sent with every train / evaluate message, besides the algorithm's
            own values.
        evaluate_fn : callable | None (default: None)
            ``evaluate_fn(server_round, arrays) -> MetricRecord | None``:
            central evaluation of the global model, each round.

        Returns
        -------
        Result
            Flower's ``Result``: ``Result.arrays`` is the last aggregated model,
            or ``initial_arrays`` when no round was aggregated (Flower leaves it
            empty).

        Raises
        ------
        ~flwr_prox_strategies.NoRoundAggregatedError
            If no round was aggregated (with ``num_rounds > 0`` and
            ``fraction_train > 0``), with the counted reasons and the
            ``Result`` (``err.result``).
        ~flwr_prox_strategies.AggregationStalledError
            From a round, when ``max_rounds_without_aggregation`` rounds in a
            row were not aggregated.
        """
        failed = True
        try:
            self.begin_run(initial_arrays, num_rounds)
            result = super().start(
                grid=grid,
                initial_arrays=initial_arrays,
                num_rounds=num_rounds,
                timeout=timeout,
                train_config=train_config,
                evaluate_config=evaluate_config,
                evaluate_fn=self.central_evaluation(evaluate_fn),
            )
            result = self.end_run(result, num_rounds)
            failed = False
        finally:
            self.close_run(failed)
        return result


class WrappedRun(RunLifecycle):
    """The run of a strategy that holds another in ``self.strategy``.

    The lifecycle is the wrapped strategy's; a failure names the wrapper
    around it (``SecAggPlus(FedAvg): ...``); any attribute the wrapper lacks
    is the wrapped strategy's. A mixin for wrappers whose hooks come from
    elsewhere (Flower's central-DP wrappers); :class:`StrategyWrapper` adds
    the hooks.
    """

    strategy: Strategy

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the wrapper lacks: the wrapped strategy's.
        if name == "strategy" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.strategy, name)

    @property
    def run_name(self) -> str:  # noqa: D102
        inner = self.strategy
        inner_name = (
            inner.run_name if isinstance(inner, RunLifecycle) else type(inner).__name__
        )
        return f"{type(self).__name__}({inner_name})"

    def begin_run(self, initial_arrays: ArrayRecord, num_rounds: int) -> None:  # noqa: D102
        if isinstance(self.strategy, RunLifecycle):
            self.strategy.begin_run(initial_arrays, num_rounds)

    def end_run(  # noqa: D102
        self, result: Result, num_rounds: int, name: str | None = None
    ) -> Result:
        if not isinstance(self.strategy, RunLifecycle):
            return result
        return self.strategy.end_run(result, num_rounds, name or self.run_name)

    def close_run(self, failed: bool) -> None:  # noqa: D102
        if isinstance(self.strategy, RunLifecycle):
            self.strategy.close_run(failed)

    def central_evaluation(self, evaluate_fn: EvaluateFn | None) -> EvaluateFn | None:  # noqa: D102
        if isinstance(self.strategy, RunLifecycle):
            return self.strategy.central_evaluation(evaluate_fn)
        return evaluate_fn


class StrategyWrapper(WrappedRun):
    """A strategy around ``strategy``: every hook and attribute forwarded.

    Subclasses override what they change and call ``self.strategy`` (or
    ``super()``) for the rest.

    Parameters
    ----------
    strategy : Strategy
        Any Flower strategy: the pack's (its run's checks apply), Flower's
        own, another wrapper.
    """

    def __init__(self, strategy: Strategy) -> None:
        if not isinstance(strategy, Strategy):
            raise TypeError(
                f"strategy must be a Flower Strategy, got {type(strategy).__name__}"
            )
        self.strategy = strategy

    # --- Flower's hooks: the wrapped strategy's ------------------------------
    def configure_train(  # noqa: D102
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(  # noqa: D102
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(  # noqa: D102
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(  # noqa: D102
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:  # noqa: D102
        self.strategy.summary()


__all__ = ["EvaluateFn", "RunLifecycle", "StrategyWrapper", "WrappedRun"]

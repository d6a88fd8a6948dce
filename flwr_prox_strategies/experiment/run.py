"""Run an experiment's rounds: the strategy's ``start``, each round recorded as it ends.

The third step of an experiment (:mod:`.server`). A run that stops early is an
outcome, not a crash: a stalled aggregation is kept to be recorded and raised
by :mod:`.record`, a run whose clients have all spent their privacy budget ends
there; any other error is written to ``results.json`` and raised at once.
"""

from __future__ import annotations

import dataclasses
from logging import INFO, WARNING

from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from omegaconf import OmegaConf

from ..core.server.outcome import AggregationStalledError, EveryClientRetiredError
from .build import Experiment
from .checkpoint import restore_rng
from .rounds import RoundEnd
from .track import close_tracker


@dataclasses.dataclass
class Outcome:
    """What the rounds of a run gave.

    Attributes
    ----------
    result : Result
        Flower's ``Result``, its rounds numbered as in the whole run.
    failure : AggregationStalledError | None
        Set when the run stopped because rounds in a row were not aggregated.
    """

    result: Result
    failure: AggregationStalledError | None = None


def run_rounds(grid: Grid, experiment: Experiment) -> Outcome:
    """Run the rounds the run has left on ``grid``, each recorded as it ends.

    A resumed run's rounds continue its numbering: Flower numbers a ``start``'s
    rounds from 1, :class:`.rounds.RoundEnd` and the histories of the returned
    ``Result`` add the rounds already done.

    Raises
    ------
    BaseException
        Whatever the rounds raised (but a stall or a spent budget), after
        ``results.json`` says so and the tracker is closed as failed.
    """
    recorder, done = experiment.recorder, experiment.done
    round_end = RoundEnd(
        recorder=recorder,
        central=experiment.central,
        strategy=experiment.strategy,
        every=experiment.every,
        num_rounds=experiment.num_rounds,
        offset=done,
        document={
            "config": OmegaConf.to_container(experiment.cfg, resolve=True),
            "client-state": experiment.client_states,
        },
        tracker=experiment.tracker,
    )
    if experiment.rng is not None:  # last: building models drew from torch's RNG
        restore_rng(experiment.rng)
    outcome = Outcome(result=Result(arrays=experiment.initial))
    try:
        if done < experiment.num_rounds:
            with round_end.observing(experiment.released):
                outcome.result = experiment.released.start(
                    grid=grid,
                    initial_arrays=experiment.initial,
                    num_rounds=experiment.num_rounds - done,
                    # Seconds a round waits for replies (Flower's default: 3600).
                    timeout=float(experiment.cfg["round_timeout"]),
                    evaluate_fn=round_end,
                )
        else:
            log(
                INFO,
                "The run in %s had done all %d rounds",
                experiment.output_dir,
                experiment.num_rounds,
            )
    except AggregationStalledError as err:  # recorded, then raised again
        outcome = Outcome(result=err.result, failure=err)
    except EveryClientRetiredError as err:  # a budget spent is an end, not a crash
        log(WARNING, "%s", err)
        recorder.meta["stopped-early"] = {"round": err.stopped_at, "reason": str(err)}
        outcome.result = err.result
    except BaseException as err:  # a crash: say so in results.json, then raise
        recorder.meta["failure"] = f"{type(err).__name__}: {err}"
        close_tracker(
            experiment.tracker, recorder.as_dict(), [recorder.flush()], failed=True
        )
        raise
    if done:  # Flower numbers a resumed start's rounds from 1: use the run's
        result = outcome.result
        for history in (
            result.train_metrics_clientapp,
            result.evaluate_metrics_clientapp,
            result.evaluate_metrics_serverapp,
        ):
            shifted = {rnd + done: value for rnd, value in history.items() if rnd}
            history.clear()
            history.update(shifted)
    if round_end.checkpoints:
        log(
            INFO,
            "%d checkpoint(s) written, %.3f s in all",
            round_end.checkpoints,
            round_end.checkpoint_seconds,
        )
    return outcome

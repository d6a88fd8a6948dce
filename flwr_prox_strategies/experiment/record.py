"""Record a run at its end: ``results.json`` complete, plots, the ledger, the tracker.

The last step of an experiment (:mod:`.server`). A run in which no round
aggregated a valid reply, or whose aggregation stalled, fails, but only after
its ``results.json`` and plots say what happened, so a run in which nothing
worked never ends looking like success.
"""

from __future__ import annotations

from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.common.logger import log
from flwr.serverapp.strategy import Result

from ..core.server.outcome import NoRoundAggregatedError, ReplyTally
from .build import Experiment
from .checkpoint import CHECKPOINT_FILE
from .results import RESULTS_FILE, RunRecorder, plot_run, write_json
from .run import Outcome
from .track import close_tracker

PRIVACY_LEDGER_FILE = "privacy-ledger.json"


def record_run(experiment: Experiment, outcome: Outcome) -> tuple[Result, Path]:
    """Write the run's record; raise its failure once it is written.

    Returns
    -------
    tuple[Result, Path]
        Flower's ``Result`` and the output folder.

    Raises
    ------
    AggregationStalledError, NoRoundAggregatedError
        When the rounds stalled, or none aggregated a valid reply, naming
        ``results.json``.
    """
    recorder, strategy = experiment.recorder, experiment.strategy
    output_dir = experiment.output_dir
    ran = rounds_run(recorder, experiment.num_rounds)
    idle = rounds_without_valid_reply(recorder, ran)
    recorder.meta["rounds-without-valid-reply"] = idle
    rejections = dict(getattr(strategy, "rejections", {}))
    recorder.meta["rejections"] = rejections
    failure = outcome.failure
    if failure is None and ran and len(idle) == ran:
        failure = NoRoundAggregatedError(
            f"no round aggregated a single valid reply (reasons: {rejections})",
            outcome.result,
            ReplyTally(),
        )
    if failure is not None:
        # The ServerApp must fail (`flwr ls` then shows the run as failed), but
        # only after results.json and the plots say what happened.
        recorder.meta["failure"] = str(failure)
        files = [recorder.flush()]
        try:
            files += plot_run(recorder.as_dict(), output_dir)
        except Exception as err:  # the failure is the news, not the plot
            log(WARNING, "Plots of the failed run not written: %s", err)
        close_tracker(experiment.tracker, recorder.as_dict(), files, failed=True)
        raise type(failure)(
            f"{failure} Results so far: {output_dir / RESULTS_FILE}",
            failure.result,
            failure.reasons,
        ) from failure
    if idle:
        log(WARNING, "Rounds without a valid reply (model kept): %s", idle)
    recorder.complete = True
    recorder.flush()
    ledger = getattr(strategy, "epsilon_totals", None)
    if ledger:  # every client's epsilon; round rows list them only up to 100
        write_json(
            output_dir / PRIVACY_LEDGER_FILE,
            {"epsilon-total": {str(k): ledger[k] for k in sorted(ledger)}},
        )
    results = recorder.as_dict()
    plots = plot_run(results, output_dir)
    log_summary(results["summary"], float(experiment.cfg["target_accuracy"]))
    log(INFO, "Results: %s", output_dir / RESULTS_FILE)
    log(INFO, "Plots: %s", ", ".join(str(p) for p in plots))
    files = [output_dir / name for name in (RESULTS_FILE, PRIVACY_LEDGER_FILE)]
    close_tracker(
        experiment.tracker,
        results,
        [*files, *plots, output_dir / CHECKPOINT_FILE],
        failed=False,
    )
    log(INFO, "Output folder: %s", output_dir)
    return outcome.result, output_dir


def rounds_run(recorder: RunRecorder, num_rounds: int) -> int:
    """Return the rounds the run ran: all, or those before it stopped early."""
    stopped = recorder.meta.get("stopped-early")
    return num_rounds if stopped is None else int(stopped["round"]) - 1


def rounds_without_valid_reply(recorder: RunRecorder, ran: int) -> list[int]:
    """Return the rounds of the ``ran`` run whose training had no valid reply."""
    return [
        rnd
        for rnd in range(1, ran + 1)
        if int(recorder.rounds.get(rnd, {}).get("train", {}).get("replies-valid", 0))
        == 0
    ]


def log_summary(summary: dict[str, Any], target: float) -> None:
    """Log the run's summary: accuracy, personalisation and privacy, when recorded."""
    log(
        INFO,
        "Finished: final accuracy %s, best %s, rounds to %.2f: %s, %.1f s",
        summary["final-accuracy"],
        summary["best-accuracy"],
        target,
        summary["rounds-to-target"],
        summary["wall-time-s"],
    )
    if "final-personal-accuracy-mean" in summary:
        log(
            INFO,
            "Personalised accuracy on clients' held-out splits: mean %.4f, worst "
            "%.4f (global model: mean %s, worst %s)",
            summary["final-personal-accuracy-mean"],
            summary["final-personal-accuracy-worst"],
            summary.get("final-global-accuracy-on-clients-mean"),
            summary.get("final-global-accuracy-on-clients-worst"),
        )
    if "final-epsilon-max" in summary:
        log(
            INFO,
            "Privacy spent per client: epsilon max %.4g, mean %.4g (delta %s)",
            summary["final-epsilon-max"],
            summary["final-epsilon-mean"],
            summary["delta"],
        )

r"""Hyper-parameter search with Optuna, as a Hydra sweeper (``hydra/sweeper=search``).

Each trial is one job of the multirun, run by the sweep's launcher; its objective
is read from the job's ``job.json`` by key, the direction following the key
(:data:`~.results.OBJECTIVES`). The study lives in SQLite in the sweep folder,
so the same command resumes an interrupted search: a trial that was cut short
continues from its job's checkpoint, in its job folder, and the sampler is
seeded from the study's size, so that a resumed or extended study proposes
new points. Search spaces use Hydra's
override grammar; trials are not pruned. Usage, settings and why not Hydra's own
Optuna sweeper (it pins Optuna 2.10): the documentation's guide "Sweeps beyond
one process", section "Hyper-parameter search: Optuna".
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.common.logger import log
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import (
    ChoiceSweep,
    IntervalSweep,
    Override,
    RangeSweep,
)
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from ..results import OBJECTIVES, pyplot
from .sweep import CUT_SHORT_ENV

#: What ``search.json`` and ``search.png`` are called in the sweep folder.
SEARCH_FILE = "search.json"
SEARCH_PLOT = "search.png"
_INTERRUPTED = "interrupted"


def distribution_of(override: Override) -> Any:
    """Return the Optuna distribution of a sweep override.

    Parameters
    ----------
    override : Override
        ``strategy.mu=tag(log,interval(0.001,1))``, ``seed=range(0,4)``,
        ``strategy=fedavg,fedprox``, ...

    Returns
    -------
    optuna.distributions.BaseDistribution
        Float or int (log-scaled when tagged ``log``), or categorical.

    Raises
    ------
    ValueError
        For a sweep Optuna cannot sample (``glob(...)``, an empty choice).
    """
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    value = override.value()
    name = override.key_or_group
    if isinstance(value, IntervalSweep):
        assert value.start is not None and value.end is not None
        log_scale = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log_scale)
        return FloatDistribution(float(value.start), float(value.end), log=log_scale)
    if isinstance(value, RangeSweep):
        assert value.start is not None and value.stop is not None
        if all(isinstance(v, int) for v in (value.start, value.stop, value.step)):
            # Hydra's range excludes its stop; Optuna's high is included.
            high = value.stop - value.step
            return IntDistribution(int(value.start), int(high), step=int(value.step))
        return CategoricalDistribution([float(v) for v in value.range()])
    if isinstance(value, ChoiceSweep) and value.list:
        return CategoricalDistribution([_plain(v) for v in value.list])
    raise ValueError(
        f"cannot search {name}={override.get_value_element_as_str()}: use "
        "interval(a,b), int(interval(a,b)), tag(log,interval(a,b)), range(a,b) "
        "or choice(x,y)"
    )


def _plain(value: Any) -> Any:
    """Return a choice as Optuna stores it (None, bool, int, float or str)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def search_space(
    arguments: Sequence[str], params: dict[str, str] | None
) -> tuple[dict[str, Any], list[str]]:
    """Split a search's overrides into the space and what every trial gets.

    Parameters
    ----------
    arguments : Sequence[str]
        The multirun's command-line overrides.
    params : dict[str, str] | None
        ``hydra.sweeper.params``: ``{key: sweep}``; the command line wins.

    Returns
    -------
    tuple[dict[str, Any], list[str]]
        ``{key: distribution}`` and the fixed overrides.

    Raises
    ------
    ValueError
        When nothing is searched.
    """
    parser = OverridesParser.create()
    texts = [f"{key}={sweep}" for key, sweep in (params or {}).items()]
    space: dict[str, Any] = {}
    fixed: list[str] = []
    for override in parser.parse_overrides([*texts, *arguments]):
        key = override.get_key_element()
        if override.is_sweep_override():
            space[key] = distribution_of(override)
        else:
            space.pop(key, None)  # the command line fixes a configured sweep
            fixed.append(override.input_line or "")
    if not space:
        raise ValueError(
            "hydra/sweeper=search has nothing to search: give a sweep override "
            "(strategy.mu=tag(log,interval(0.001,1))) or hydra.sweeper.params"
        )
    return space, fixed


def _override_text(key: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{key}={value!r}"
    return f"{key}={value}"


@dataclass
class Search:
    """The sweep of :class:`hydra_plugins.flwr_prox_search.SearchSweeper`.

    Parameters
    ----------
    objective : str
        A key of a job's summary: ``final-accuracy``, ``best-accuracy``
        (maximised), ``rounds-to-target`` or ``final-loss`` (minimised). A
        trial that never reaches ``target_accuracy`` counts
        ``num_rounds + 1`` rounds.
    n_trials : int
        Trials the study should hold when the sweep ends (resumed studies
        count their finished trials).
    n_jobs : int
        Trials launched together (their launcher may run them side by side).
    sampler : str
        ``tpe`` (Optuna's default) or ``random``.
    seed : int | None
        The sampler's seed for a new study; a resumed or extended study's
        sampler is seeded from it and the study's size, so that it proposes
        new points (None: unseeded).
    storage : str | None
        Optuna's storage URL; None: ``sqlite:///<sweep dir>/study.db``.
    study_name : str
        The study's name in the storage.
    params : dict[str, str]
        The search space (Hydra sweep grammar); the command line adds to it.
    """

    objective: str = "final-accuracy"
    n_trials: int = 10
    n_jobs: int = 1
    sampler: str = "tpe"
    seed: int | None = 0
    storage: str | None = None
    study_name: str = "search"
    params: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(
                f"hydra.sweeper.objective must be one of {sorted(OBJECTIVES)}, "
                f"got {self.objective!r}"
            )
        if int(self.n_trials) < 1:
            raise ValueError(
                f"hydra.sweeper.n_trials must be >= 1, got {self.n_trials}"
            )
        if int(self.n_jobs) < 1:
            raise ValueError(f"hydra.sweeper.n_jobs must be >= 1, got {self.n_jobs}")
        if self.sampler not in ("tpe", "random"):
            raise ValueError(
                f"hydra.sweeper.sampler must be tpe or random, got {self.sampler!r}"
            )
        self.direction = OBJECTIVES[self.objective]

    def setup(
        self,
        *,
        hydra_context: HydraContext,
        task_function: TaskFunction,
        config: DictConfig,
    ) -> None:
        """Keep the run's config and build its launcher (Hydra's sweeper protocol)."""
        from hydra.core.plugins import Plugins

        self.config = config
        self.launcher: Launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )
        self.sweep_dir = Path(str(config.hydra.sweep.dir))

    def sweep(self, arguments: list[str]) -> dict[str, Any]:
        """Run trials until the study holds ``n_trials``; return the best."""
        import optuna

        space, fixed = search_space(arguments, dict(self.params or {}))
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, self.sweep_dir / "multirun.yaml")
        storage = self.storage or f"sqlite:///{self.sweep_dir.resolve()}/study.db"
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(
            study_name=self.study_name,
            storage=storage,
            direction=self.direction,  # type: ignore[arg-type]
            load_if_exists=True,
        )
        earlier = study.user_attrs.get("objective")
        if earlier not in (None, self.objective):
            raise ValueError(
                f"the study {self.study_name!r} in {storage} optimises {earlier}, "
                f"not {self.objective}: give another hydra.sweep.dir or study_name"
            )
        study.set_user_attr("objective", self.objective)
        rerun = self._take_back_interrupted(study)
        # The sampler keeps no state in the storage: seeded alike on every
        # invocation, it would propose the points it proposed the first time
        # again (an extended study measuring mu values it already has).
        study.sampler = self._sampler(len(study.trials))
        log(
            INFO,
            "Search: %s %s over %s, %d of %d trials done, study %r in %s",
            self.direction,
            self.objective,
            ", ".join(space),
            len(self._finished(study)),
            self.n_trials,
            self.study_name,
            storage,
        )
        for job in rerun:  # a trial cut short earlier, in its own job folder
            self._run_trials(study, space, fixed, job, 1, cut_short=True)
        while len(self._finished(study)) < self.n_trials:
            left = self.n_trials - len(self._finished(study))
            count = min(int(self.n_jobs), left)
            self._run_trials(study, space, fixed, self._next_job(study), count)
        best = self._report(study)
        return best

    def _run_trials(
        self,
        study: Any,
        space: dict[str, Any],
        fixed: list[str],
        first_job: int,
        count: int,
        *,
        cut_short: bool = False,
    ) -> None:
        """Ask ``count`` trials, launch them as jobs ``first_job``..., tell results.

        Parameters
        ----------
        study : optuna.Study
            The search's study.
        space : dict[str, Any]
            ``{key: distribution}`` (:func:`search_space`).
        fixed : list[str]
            The overrides every trial gets.
        first_job : int
            The first trial's job number (the next ones follow).
        count : int
            How many trials to launch together.
        cut_short : bool, default False
            The trials re-run trials an interruption cut short: their jobs
            continue from the checkpoints in their folders
            (:func:`~.sweep.rerun_of_cut_short`).
        """
        trials = [study.ask(space) for _ in range(count)]
        # A Hydra override, not a config key: the job's config stays the one
        # its checkpoint was written with, which a resume checks.
        extra = [f"++hydra.job.env_set.{CUT_SHORT_ENV}=1"] if cut_short else []
        batch = []
        for offset, trial in enumerate(trials):
            trial.set_user_attr("job", first_job + offset)
            batch.append(
                [
                    *fixed,
                    *(_override_text(k, v) for k, v in trial.params.items()),
                    *extra,
                ]
            )
        returns = self.launcher.launch(batch, initial_job_idx=first_job)
        for trial, ret in zip(trials, returns, strict=True):
            self._tell(study, trial, ret)

    def _sampler(self, known: int) -> Any:
        """Return the sampler for a study that holds ``known`` trials.

        Parameters
        ----------
        known : int
            The study's trials so far (any state).

        Returns
        -------
        optuna.samplers.BaseSampler
            Seeded with ``seed`` for a new study (so a fresh search is
            reproducible), else with a seed drawn from ``seed`` and ``known``:
            each invocation that resumes or extends the study draws new
            points, and the same command on the same study draws the same.
        """
        import numpy as np
        import optuna

        samplers = {
            "tpe": optuna.samplers.TPESampler,
            "random": optuna.samplers.RandomSampler,
        }
        seed = self.seed
        if seed is not None and known:
            seed = int(np.random.SeedSequence([int(seed), known]).generate_state(1)[0])
        return samplers[self.sampler](seed=seed)

    def _finished(self, study: Any) -> list[Any]:
        """Trials that ran to their end (completed or failed, not cut short)."""
        from optuna.trial import TrialState

        interrupted = set(study.user_attrs.get(_INTERRUPTED, []))
        return [
            t
            for t in study.trials
            if t.state in (TrialState.COMPLETE, TrialState.FAIL)
            and t.number not in interrupted
        ]

    def _next_job(self, study: Any) -> int:
        jobs = [int(t.user_attrs.get("job", -1)) for t in study.trials]
        return max(jobs, default=-1) + 1

    def _take_back_interrupted(self, study: Any) -> list[int]:
        """Close the trials an earlier sweep left running; return their jobs.

        They are failed and recorded as interrupted (not counted), and their
        parameters are queued, so they run again first, in their job folders,
        where they continue from their checkpoints.
        """
        from optuna.trial import TrialState

        interrupted = list(study.user_attrs.get(_INTERRUPTED, []))
        jobs = []
        for trial in study.get_trials(states=(TrialState.RUNNING,)):
            interrupted.append(trial.number)
            study.tell(trial.number, state=TrialState.FAIL)
            study.enqueue_trial(trial.params)
            jobs.append(int(trial.user_attrs["job"]))
            log(
                WARNING,
                "Search: trial %d (job %s) was cut short: it runs again in its job "
                "folder, from its checkpoint there if it wrote one",
                trial.number,
                trial.user_attrs["job"],
            )
        study.set_user_attr(_INTERRUPTED, interrupted)
        return jobs

    def _tell(self, study: Any, trial: Any, ret: JobReturn) -> None:
        """Give the study a trial's objective, read from its job's ``job.json``."""
        from optuna.trial import TrialState

        assert ret.hydra_cfg is not None
        job_dir = Path(str(ret.hydra_cfg.hydra.runtime.output_dir))
        summary = job_dir / "job.json"
        record = json.loads(summary.read_text()) if summary.is_file() else {}
        value = record.get(self.objective)
        never_reached = (
            record.get("status") == "completed"
            and value is None
            and self.objective == "rounds-to-target"
            and ret.cfg is not None
        )
        if never_reached:
            value = int(ret.cfg["num_rounds"]) + 1  # type: ignore[index]
        if value is None or not math.isfinite(float(value)):
            study.tell(trial, state=TrialState.FAIL)
            log(
                WARNING,
                "Search: trial %d (job %s) failed: %s",
                trial.number,
                job_dir.name,
                record.get("error", f"no {self.objective} in {summary}"),
            )
            return
        study.tell(trial, float(value))
        best = study.best_trial
        log(
            INFO,
            "Search: trial %d (job %s): %s -> %s %.4g (best %.4g, trial %d)",
            trial.number,
            job_dir.name,
            " ".join(_override_text(k, v) for k, v in trial.params.items()),
            self.objective,
            float(value),
            best.value,
            best.number,
        )

    def _report(self, study: Any) -> dict[str, Any]:
        """Write ``search.json`` and ``search.png``; log the best trial."""
        from optuna.trial import TrialState

        interrupted = set(study.user_attrs.get(_INTERRUPTED, []))
        trials = [
            {
                "trial": t.number,
                "job": t.user_attrs.get("job"),
                "state": t.state.name.lower(),
                "value": t.value,
                "params": t.params,
                **({_INTERRUPTED: True} if t.number in interrupted else {}),
            }
            for t in study.trials
        ]
        complete = study.get_trials(states=(TrialState.COMPLETE,))
        best: dict[str, Any] = {}
        if complete:
            top = study.best_trial
            best = {
                "trial": top.number,
                "job": top.user_attrs.get("job"),
                "value": top.value,
                "params": top.params,
                "overrides": " ".join(
                    _override_text(k, v) for k, v in top.params.items()
                ),
            }
        document = {
            "objective": self.objective,
            "direction": self.direction,
            "n-trials": self.n_trials,
            "best": best,
            "trials": trials,
        }
        path = self.sweep_dir / SEARCH_FILE
        path.write_text(json.dumps(document, indent=2))
        self._plot(trials)
        if best:
            log(
                INFO,
                "Search: best %s %.4g at %s (trial %d, job %s); %s",
                self.objective,
                best["value"],
                best["overrides"],
                best["trial"],
                best["job"],
                path,
            )
        else:
            log(WARNING, "Search: no trial completed; %s", path)
        return best

    def _plot(self, trials: list[dict[str, Any]]) -> None:
        """Each trial's objective and the best so far; against the first parameter."""
        plt = pyplot()
        fig, (by_trial, by_value) = plt.subplots(1, 2, figsize=(11, 4))
        done = [t for t in trials if t["state"] == "complete"]
        failed = [t["trial"] for t in trials if t["state"] == "fail"]
        label = f"{self.objective} ({self.direction})"
        if done:
            numbers = [t["trial"] for t in done]
            values = [t["value"] for t in done]
            pick = max if self.direction == "maximize" else min
            best = [pick(values[: i + 1]) for i in range(len(values))]
            by_trial.plot(numbers, values, "o", label="trial")
            by_trial.step(numbers, best, where="post", label="best so far")
            by_trial.legend(fontsize=8)
        for number in failed:
            by_trial.axvline(number, color="red", alpha=0.3, linewidth=1)
        by_trial.set(
            xlabel="trial",
            ylabel=label,
            title=f"{len(done)} trials"
            + (f", {len(failed)} failed (red lines)" if failed else ""),
        )
        by_trial.grid(alpha=0.3)
        name = next(iter(done[0]["params"]), None) if done else None
        if name is not None:
            xs = [t["params"].get(name) for t in done]
            numeric = all(isinstance(x, int | float) for x in xs)
            by_value.plot(xs if numeric else [str(x) for x in xs], values, "o")
            if numeric and min(xs) > 0 and max(xs) > 10 * min(xs):
                by_value.set_xscale("log")
            by_value.set(xlabel=name, ylabel=label, title=f"{label} against {name}")
            by_value.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.sweep_dir / SEARCH_PLOT, dpi=120)
        plt.close(fig)

"""Hyper-parameter search with Optuna (``hydra/sweeper=search``).

The search space comes from Hydra's sweep grammar, the objective from a job's
summary by key (its direction follows the key), and the study lives in SQLite
in the sweep folder: a second command with more trials runs only the missing
ones, at new points, and a trial an interrupted search left running runs again
in its own job folder, from its checkpoint there.
"""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from optuna.distributions import (
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from flwr_prox_strategies.experiment.sweeps.search import Search, search_space

from .helpers import small_sweep
from .system.engine import hydra_entry


def _space(*overrides: str) -> dict:
    space, _ = search_space(list(overrides), None)
    return space


def test_the_sweep_grammar_becomes_optunas_distributions() -> None:
    space = _space(
        "strategy.mu=tag(log,interval(0.001,1))",
        "train.learning_rate=interval(0.01,0.1)",
        "train.local_epochs=int(interval(1,5))",
        "seed=range(0,10,2)",
        "strategy=fedavg,fedprox",
        "partition=choice(iid,dirichlet)",
    )
    assert space["strategy.mu"] == FloatDistribution(0.001, 1.0, log=True)
    assert space["train.learning_rate"] == FloatDistribution(0.01, 0.1)
    assert space["train.local_epochs"] == IntDistribution(1, 5)
    # Hydra's range excludes its stop, Optuna's high is included.
    assert space["seed"] == IntDistribution(0, 8, step=2)
    assert space["strategy"] == CategoricalDistribution(["fedavg", "fedprox"])
    assert space["partition"] == CategoricalDistribution(["iid", "dirichlet"])


def test_fixed_overrides_go_to_every_trial_and_the_command_line_wins() -> None:
    space, fixed = search_space(
        ["strategy=fedprox", "strategy.mu=0.1"],
        {"strategy.mu": "interval(0,1)", "train.learning_rate": "interval(0.01,0.1)"},
    )
    assert list(space) == ["train.learning_rate"]
    assert fixed == ["strategy=fedprox", "strategy.mu=0.1"]
    with pytest.raises(ValueError, match="nothing to search"):
        search_space(["strategy=fedprox"], None)
    with pytest.raises(ValueError, match="cannot search"):
        (override,) = OverridesParser.create().parse_overrides(["x=glob(*)"])
        from flwr_prox_strategies.experiment.sweeps.search import distribution_of

        distribution_of(override)


@pytest.mark.parametrize(
    ("objective", "direction"),
    [
        ("final-accuracy", "maximize"),
        ("best-accuracy", "maximize"),
        ("rounds-to-target", "minimize"),
        ("final-loss", "minimize"),
    ],
)
def test_the_direction_follows_the_objective(objective, direction) -> None:
    assert Search(objective=objective).direction == direction


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("objective", "accuracy"),
        ("n_trials", 0),
        ("n_jobs", 0),
        ("sampler", "cmaes"),
    ],
)
def test_bad_options_name_the_option(option, value) -> None:
    with pytest.raises(ValueError, match=f"hydra.sweeper.{option}"):
        Search(**{option: value})


def _search(sweep: Path, trials: int, *extra: str) -> subprocess.CompletedProcess:
    return small_sweep(
        sweep,
        "hydra/sweeper=search",
        "strategy=fedprox",
        "strategy.mu=tag(log,interval(0.001,1))",
        "hydra.sweeper.objective=final-loss",
        f"hydra.sweeper.n_trials={trials}",
        *extra,
        cwd=sweep.parent,
    )


@pytest.mark.long
def test_a_three_trial_study_reports_the_best(tmp_path: Path) -> None:
    sweep = tmp_path / "search"
    out = _search(sweep, 3)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads((sweep / "search.json").read_text())
    assert found["objective"] == "final-loss" and found["direction"] == "minimize"
    values = [t["value"] for t in found["trials"]]
    assert len(values) == 3 and found["best"]["value"] == min(values)
    # The objective is the jobs' own final loss, read from their summaries.
    with open(sweep / "summary.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert sorted(float(r["final-loss"]) for r in rows) == sorted(values)
    best_job = rows[found["best"]["job"]]
    assert (
        f"strategy.mu={found['best']['params']['strategy.mu']!r}"
        in best_job["overrides"]
    )
    assert "Search: best final-loss" in out.stderr
    assert (sweep / "search.png").stat().st_size > 5_000


class _Jobs:
    """Hydra's launcher protocol, each job's summary written as ``record`` says.

    The objective is read from the jobs' ``job.json`` files, so a launcher that
    writes them stands for every real one (joblib, SLURM, Ray) here.
    """

    def __init__(self, sweep: Path, record) -> None:
        self.sweep, self.record, self.launched = sweep, record, []

    def launch(self, batch, initial_job_idx):
        from hydra.core.utils import JobReturn
        from omegaconf import OmegaConf

        returns = []
        for offset, overrides in enumerate(batch):
            job = self.sweep / str(initial_job_idx + offset)
            job.mkdir(parents=True, exist_ok=True)
            self.launched.append((job.name, list(overrides)))
            mu = float(
                next(o for o in overrides if o.startswith("strategy.mu=")).split("=")[1]
            )
            (job / "job.json").write_text(json.dumps(self.record(mu)))
            ret = JobReturn()
            ret.hydra_cfg = OmegaConf.create(
                {"hydra": {"runtime": {"output_dir": str(job)}}}
            )
            ret.cfg = OmegaConf.create({"num_rounds": 30})
            returns.append(ret)
        return returns


def _study(tmp_path: Path, record, **options) -> tuple[Search, _Jobs]:
    search = Search(**options)
    search.sweep_dir = tmp_path
    search.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    search.launcher = _Jobs(tmp_path, record)  # type: ignore[assignment]
    return search, search.launcher


def test_a_failed_trial_is_failed_in_the_study_and_a_missed_target_counts_more_rounds(
    tmp_path: Path,
) -> None:
    def record(mu: float) -> dict:
        if mu > 0.3:  # the job raised: its summary says so
            return {"status": "failed", "error": "ValueError: boom"}
        # rounds-to-target None: the target was never reached in 30 rounds
        return {"status": "completed", "rounds-to-target": None if mu < 0.01 else 7}

    search, jobs = _study(
        tmp_path, record, objective="rounds-to-target", n_trials=8, n_jobs=3, seed=3
    )
    best = search.sweep(["strategy=fedprox", "strategy.mu=tag(log,interval(0.001,1))"])
    found = json.loads((tmp_path / "search.json").read_text())
    assert found["direction"] == "minimize" and len(found["trials"]) == 8
    # Jobs 0..7 in batches of 3, 3, 2; every trial gets the fixed override.
    assert [name for name, _ in jobs.launched] == [str(n) for n in range(8)]
    assert all(overrides[0] == "strategy=fedprox" for _, overrides in jobs.launched)
    for trial in found["trials"]:
        mu = trial["params"]["strategy.mu"]
        if mu > 0.3:
            assert trial["state"] == "fail" and trial["value"] is None
        else:
            assert trial["state"] == "complete"
            assert trial["value"] == (31 if mu < 0.01 else 7)  # num_rounds + 1
    assert best["value"] == 7 and found["best"] == best
    # The seeded sampler drew each case: a failed job, a missed target, a hit.
    values = [t["value"] for t in found["trials"]]
    assert None in values and 31 in values and 7 in values, found["trials"]
    assert (tmp_path / "search.png").stat().st_size > 5_000


def test_an_interrupted_study_resumes_where_it_stopped(tmp_path: Path) -> None:
    """A trial an interrupted search left running (as if killed) runs again in
    its own job folder, first; then only the missing trials run. Resuming
    with another objective is refused: the stored values would mix."""

    def record(mu: float) -> dict:
        return {"status": "completed", "final-loss": mu}

    arguments = ["strategy.mu=tag(log,interval(0.001,1))"]
    search, _ = _study(tmp_path, record, objective="final-loss", n_trials=3)
    search.sweep(arguments)
    study = optuna.load_study(
        study_name="search", storage=f"sqlite:///{tmp_path}/study.db"
    )
    cut_short = study.ask({"strategy.mu": FloatDistribution(0.001, 1.0, log=True)})
    cut_short.set_user_attr("job", 3)
    search, jobs = _study(tmp_path, record, objective="final-loss", n_trials=5)
    search.sweep(arguments)
    assert [name for name, _ in jobs.launched] == ["3", "4"]
    # The cut-short trial's job, alone, is told to continue from its checkpoint.
    told = "++hydra.job.env_set.FLWR_PROX_CUT_SHORT=1"
    assert [told in overrides for _, overrides in jobs.launched] == [True, False]
    found = json.loads((tmp_path / "search.json").read_text())
    states = [
        (t["job"], t["state"], t.get("interrupted", False)) for t in found["trials"]
    ]
    assert states == [
        (0, "complete", False),
        (1, "complete", False),
        (2, "complete", False),
        (3, "fail", True),
        (3, "complete", False),
        (4, "complete", False),
    ]
    assert found["trials"][4]["params"] == cut_short.params
    assert found["best"]["value"] == min(
        t["value"] for t in found["trials"] if t["value"]
    )
    search, jobs = _study(tmp_path, record, objective="best-accuracy", n_trials=6)
    with pytest.raises(ValueError, match="optimises final-loss"):
        search.sweep(arguments)
    assert jobs.launched == []


def test_an_extended_study_proposes_new_points(tmp_path: Path) -> None:
    """The sampler keeps no state in the storage: a second command with more
    trials must not draw the first command's points again (same seed)."""

    def record(mu: float) -> dict:
        return {"status": "completed", "final-loss": mu}

    arguments = ["strategy.mu=tag(log,interval(0.001,1))"]
    search, _ = _study(tmp_path, record, objective="final-loss", n_trials=3)
    search.sweep(arguments)
    search, jobs = _study(tmp_path, record, objective="final-loss", n_trials=6)
    search.sweep(arguments)
    assert [name for name, _ in jobs.launched] == ["3", "4", "5"]
    found = json.loads((tmp_path / "search.json").read_text())
    mus = [t["params"]["strategy.mu"] for t in found["trials"]]
    assert len(mus) == 6 and len(set(mus)) == 6, mus
    # A new study with the same seed still draws the same points: reproducible.
    again, _ = _study(tmp_path / "again", record, objective="final-loss", n_trials=3)
    (tmp_path / "again").mkdir()
    again.sweep(arguments)
    first = json.loads((tmp_path / "again" / "search.json").read_text())
    assert [t["params"]["strategy.mu"] for t in first["trials"]] == mus[:3]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _kill_during_trial(sweep: Path, sig: signal.Signals, trials: int) -> None:
    """Start a search of ``trials`` and send ``sig`` while job 1 runs, after its
    first checkpoint: the search stops with trial 1 cut short."""
    command = [
        sys.executable,
        "-m",
        "flwr_prox_strategies.experiment",
        *_SEARCH,
        f"hydra.sweeper.n_trials={trials}",
        f"hydra.sweep.dir={sweep}",
    ]
    sweep.mkdir(parents=True)
    with open(sweep.parent / f"{sweep.name}-killed.log", "w") as sink:
        proc = subprocess.Popen(
            command,
            cwd=sweep.parent,
            stdout=sink,
            stderr=sink,
            # A pytest-xdist worker may ignore SIGINT, and a child inherits an
            # ignored signal (Python then installs no KeyboardInterrupt handler):
            # give the search the disposition a shell gives it.
            preexec_fn=_default_sigint,
        )
        checkpoint = sweep / "1" / "checkpoint.npz"
        deadline = time.monotonic() + 120
        while not checkpoint.exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "job 1 wrote no checkpoint"
            time.sleep(0.02)
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
    assert code != 0, "the search ended before it was interrupted"
    # Cut short: a checkpoint, but no summary of the job.
    assert checkpoint.exists() and not (sweep / "1" / "job.json").exists()


# Rounds of a few tenths of a second, a checkpoint each: the kill lands in a
# trial, after its first checkpoint, before its end.
_SEARCH = (
    "-m",
    "engine=inprocess",
    "num_clients=3",
    "num_rounds=12",
    "model=logreg",
    "checkpoint_every=1",
    "hydra/sweeper=search",
    "hydra.sweeper.sampler=random",
    "strategy=fedprox",
    "strategy.mu=tag(log,interval(0.001,1))",
    "hydra.sweeper.objective=final-loss",
)


@pytest.mark.long
@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"]
)
def test_a_search_killed_during_a_trial_resumes_it_from_its_checkpoint(
    tmp_path: Path, sig: signal.Signals
) -> None:
    sweep = tmp_path / "search"
    _kill_during_trial(sweep, sig, trials=3)
    out = hydra_entry(
        *_SEARCH, "hydra.sweeper.n_trials=3", f"hydra.sweep.dir={sweep}", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming from {sweep / '1' / 'checkpoint.npz'}" in out.stderr
    assert "Resuming" in out.stderr and "from round" in out.stderr
    found = json.loads((sweep / "search.json").read_text())
    counted = [t for t in found["trials"] if not t.get("interrupted")]
    cut_short = [t for t in found["trials"] if t.get("interrupted")]
    assert [t["job"] for t in counted] == [0, 1, 2]
    assert all(t["state"] == "complete" for t in counted)
    mus = [t["params"]["strategy.mu"] for t in counted]
    assert len(set(mus)) == 3, mus
    assert [t["job"] for t in cut_short] == [1]
    assert cut_short[0]["params"] == counted[1]["params"]
    # Job 1 ran to its end in its own folder: every round, once.
    results = json.loads((sweep / "1" / "results.json").read_text())
    assert results["summary"]["complete"] is True
    assert [r["round"] for r in results["rounds"]] == list(range(13))
    with open(sweep / "summary.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["status"] for r in rows] == ["completed"] * 3
    if sig == signal.SIGTERM:
        # Extending the study spends the new trial on a new point.
        out = hydra_entry(
            *_SEARCH,
            "hydra.sweeper.n_trials=4",
            f"hydra.sweep.dir={sweep}",
            cwd=tmp_path,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        found = json.loads((sweep / "search.json").read_text())
        counted = [t for t in found["trials"] if not t.get("interrupted")]
        assert [t["job"] for t in counted] == [0, 1, 2, 3]
        assert counted[3]["params"]["strategy.mu"] not in mus


def test_a_cut_short_trials_job_resumes_only_from_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a checkpoint the job starts again, with the client state the
    cut-short run mirrored moved aside (no checkpoint pairs with it, and the
    new run would refuse the folder that holds it)."""
    from flwr_prox_strategies.experiment.sweeps.sweep import (
        CUT_SHORT_ENV,
        rerun_of_cut_short,
    )

    job = tmp_path / "1"
    (job / "client-state").mkdir(parents=True)
    (job / "client-state" / "node-1.npz").write_bytes(b"state")
    monkeypatch.delenv(CUT_SHORT_ENV, raising=False)
    assert not rerun_of_cut_short(job)  # not a search's rerun: left alone
    assert (job / "client-state" / "node-1.npz").is_file()
    monkeypatch.setenv(CUT_SHORT_ENV, "1")
    assert not rerun_of_cut_short(job)
    assert not (job / "client-state").exists()
    assert (job / "client-state.cut-short" / "node-1.npz").read_bytes() == b"state"
    (job / "checkpoint.npz").write_bytes(b"")
    assert rerun_of_cut_short(job)

"""Hyper-parameter search with Optuna (``hydra/sweeper=search``).

The search space comes from Hydra's sweep grammar, the objective from a job's
summary by key (its direction follows the key), and the study lives in SQLite
in the sweep folder: a second command with more trials runs only the missing
ones, and a trial an interrupted search left running runs again in its own
job folder.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from optuna.distributions import (
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from flwr_prox_strategies.experiment.search import Search, search_space


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
        from flwr_prox_strategies.experiment.search import distribution_of

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
    command = [
        sys.executable,
        "-m",
        "flwr_prox_strategies.experiment",
        "-m",
        "hydra/sweeper=search",
        "engine=inprocess",
        "num_clients=3",
        "num_rounds=2",
        "model=logreg",
        "strategy=fedprox",
        "strategy.mu=tag(log,interval(0.001,1))",
        "hydra.sweeper.objective=final-loss",
        f"hydra.sweeper.n_trials={trials}",
        f"hydra.sweep.dir={sweep}",
        *extra,
    ]
    return subprocess.run(
        command, capture_output=True, text=True, cwd=sweep.parent, timeout=300
    )


@pytest.mark.long
def test_a_three_trial_study_reports_the_best_and_resumes(tmp_path: Path) -> None:
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
    # A trial an interrupted search left running (as if killed), then a
    # second command asking for 5 trials: the cut-short one runs again in its
    # own folder (job 3), and one new trial (job 4).
    study = optuna.load_study(
        study_name="search", storage=f"sqlite:///{sweep}/study.db"
    )
    cut_short = study.ask({"strategy.mu": FloatDistribution(0.001, 1.0, log=True)})
    cut_short.set_user_attr("job", 3)
    out = _search(sweep, 5)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "was cut short: it runs again" in out.stderr
    assert "Search: maximize" not in out.stderr and "3 of 5 trials done" in out.stderr
    found = json.loads((sweep / "search.json").read_text())
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
    rerun = found["trials"][4]["params"]["strategy.mu"]
    assert rerun == cut_short.params["strategy.mu"]
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == list("01234")
    # Resuming with another objective is refused: the stored values would mix.
    out = _search(sweep, 6, "hydra.sweeper.objective=best-accuracy")
    assert out.returncode != 0 and "optimises final-loss" in out.stderr

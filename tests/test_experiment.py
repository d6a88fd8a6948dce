"""The experiment layer: composing conf/, the ServerApp/ClientApp path, sweeps."""

from __future__ import annotations

import csv
import inspect
import json
from pathlib import Path

import pytest
from hydra.utils import get_class

from flwr_prox_strategies import FedAvg, FedProx
from flwr_prox_strategies.algorithms import ALGORITHMS
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
from flwr_prox_strategies.experiment.build import build_strategy, wait_for_clients
from flwr_prox_strategies.experiment.config import (
    compose_config,
    overrides_from_run_config,
)
from flwr_prox_strategies.experiment.server import run_experiment

from .helpers import run_app, small_sweep
from .system.engine import hydra_entry

REPO = Path(__file__).resolve().parents[1]


def test_issue_example_overrides_compose() -> None:
    cfg = compose_config("strategy=fedavg partition=iid model=logreg num_rounds=30")
    assert cfg["num_rounds"] == 30
    assert cfg.partition.scheme == "iid"
    assert cfg.model._target_.endswith("LogisticRegression")
    strategy = build_strategy(cfg)
    assert type(strategy) is FedAvg  # the sweep-only `mu` is not passed


def test_run_config_keys_map_to_overrides_and_overrides_win() -> None:
    run_config = {
        "overrides": "num_rounds=7 strategy.mu=0.5",
        "num-rounds": 3,
        "seed": 4,
    }
    overrides = overrides_from_run_config(run_config)
    cfg = compose_config(overrides)
    assert cfg["num_rounds"] == 7 and cfg.seed == 4
    strategy = build_strategy(cfg)
    assert isinstance(strategy, FedProx) and strategy.mu == 0.5
    assert overrides_from_run_config({"num-rounds": 0, "seed": -1}) == []


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_strategy_config_builds_its_strategy(name: str) -> None:
    cfg = compose_config(f"strategy={name} num_clients=7")
    strategy = build_strategy(cfg)
    assert type(strategy) is ALGORITHMS[name].strategy
    assert cfg.client._target_.endswith("Client")
    if getattr(strategy, "requires_num_clients", False):
        assert strategy.num_clients == 7


def _passed_keys(node) -> set[str]:
    """The keyword arguments a strategy node gives its class (Hydra's keys out)."""
    unused = set(node.get("_unused_") or ())
    return {
        str(key)
        for key in node
        if not (str(key).startswith("_") and str(key).endswith("_"))
        and key not in unused
    }


def _accepted(cls: type) -> set[str]:
    if hasattr(cls, "accepted_kwargs"):
        return cls.accepted_kwargs()
    return {
        name
        for name, param in inspect.signature(cls).parameters.items()
        if param.kind is param.KEYWORD_ONLY
    }


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_the_shared_base_gives_each_strategy_only_keys_it_accepts(name: str) -> None:
    """conf/strategy/_base/ feeds every strategy YAML (and P-FedAvg's inner one):
    what it adds must be a keyword argument of the class that gets it."""
    cfg = compose_config(f"strategy={name}")
    nodes = [(ALGORITHMS[name].strategy, cfg.strategy)]
    if "inner" in cfg.strategy:
        nodes.append((get_class(cfg.strategy.inner._target_), cfg.strategy.inner))
    for cls, node in nodes:
        extra = _passed_keys(node) - _accepted(cls)
        assert not extra, f"{cls.__name__} does not accept {sorted(extra)}"
        assert node.seed == cfg.seed  # the base reached it


def test_official_non_iid_preset() -> None:
    cfg = compose_config("+experiment=non-iid-official strategy=feddyn")
    assert cfg.dataset.name == "fashion-mnist" and cfg.dataset.normalize == "official"
    assert cfg.partition._target_.endswith("official_dirichlet_partition")
    assert cfg.partition.alpha == 0.3
    assert cfg["num_clients"] == 100 and cfg.train["lr_decay"] == 0.998
    strategy = build_strategy(cfg)
    assert strategy.fraction_train == 0.1 and strategy.lr_decay == 0.998
    assert strategy.participation == "bernoulli" and strategy.min_train_nodes == 1
    scaffold = build_strategy(
        compose_config(
            "+experiment=non-iid-official strategy=scaffold strategy.control_lr=base"
        )
    )
    assert scaffold.control_lr == "base" and scaffold.participation == "bernoulli"


def _keys(node, path=""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield f"{path}.{key}" if path else str(key)
            yield from _keys(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for value in node:
            yield from _keys(value, path)


def test_the_conf_tree_is_snake_case() -> None:
    """Kebab-case is for the wire and Flower's --run-config, not for conf/."""
    import yaml

    kebab = [
        f"{path.relative_to(REPO)}: {key}"
        for path in sorted((REPO / "conf").rglob("*.yaml"))
        for key in _keys(yaml.safe_load(path.read_text()) or {})
        if "-" in key.rsplit(".", 1)[-1]
    ]
    assert not kebab, kebab


@pytest.mark.parametrize(
    ("override", "snake"),
    [
        ("num-clients=3", "num_clients"),
        ("train.learning-rate=0.5", "train.learning_rate"),
    ],
)
def test_an_old_kebab_key_names_its_snake_case_spelling(override, snake) -> None:
    with pytest.raises(ValueError, match=f"write '{snake}'"):
        compose_config(override)
    out = hydra_entry(override, cwd=REPO, timeout=120)
    assert out.returncode != 0 and f"write '{snake}'" in out.stderr, out.stderr[-2000:]


def test_unknown_override_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="strategy=nope"):
        compose_config("strategy=nope")


def test_node_count_mismatch_is_an_error_not_a_hang() -> None:
    grid = InProcessGrid(lambda m, c: m, num_nodes=3)
    with pytest.raises(RuntimeError, match="num-supernodes=5"):
        wait_for_clients(grid, 5, timeout=0.0)
    with pytest.raises(RuntimeError, match="num_clients=2"):
        wait_for_clients(grid, 2, timeout=10.0)  # more nodes than clients: at once


def test_app_path_writes_results_and_plots(tmp_path: Path) -> None:
    out, results = run_app(
        tmp_path,
        "num_clients=5 num_rounds=2 model=logreg evaluate.fraction_clients=1.0"
        " evaluate.local_test_fraction=0.2",
        num_nodes=5,
    )
    assert results["summary"]["complete"]
    rounds = results["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert rounds[2]["train"]["replies-valid"] == 5
    assert "accuracy" in rounds[2]["evaluate"]  # federated evaluation ran on clients
    # on held-out data: 20% of each partition (digits train split = 1437 rows)
    assert 250 <= rounds[2]["evaluate"]["num-examples"] <= 330
    assert (
        rounds[2]["train"]["num-examples"] + rounds[2]["evaluate"]["num-examples"]
        == 1437
    )
    assert rounds[2]["central"]["accuracy"] > rounds[0]["central"]["accuracy"]
    assert (out / "metrics.png").stat().st_size > 10_000
    assert (out / "config.yaml").is_file()


@pytest.mark.parametrize(
    ("overrides", "personal_key"),
    [
        ("strategy=apfl strategy.sync_gap=5", "personal-accuracy"),
        (
            "strategy=fedavg train.local_steps=5 train.finetune_steps=5",
            "personal-accuracy",
        ),
    ],
)
def test_personalised_evaluation_reaches_results_and_plots(
    tmp_path: Path, overrides: str, personal_key: str
) -> None:
    """Every client evaluates the global and its personalised model on its own
    held-out split; results.json carries the per-client table and the summary."""
    out, results = run_app(
        tmp_path,
        f"num_clients=4 num_rounds=2 model=logreg partition=pathological "
        f"evaluate.fraction_clients=1.0 evaluate.local_test_fraction=0.25 {overrides}",
        num_nodes=4,
    )
    evaluation = results["rounds"][-1]["evaluate"]
    assert evaluation["eval-client-keys"] == [0, 1, 2, 3]
    for name in ("accuracy", personal_key):
        per_client = evaluation[f"{name}-per-client"]
        assert len(per_client) == 4
        assert evaluation[f"{name}-worst"] == min(per_client)
        assert evaluation[f"{name}-clients-mean"] == pytest.approx(sum(per_client) / 4)
    summary = results["summary"]
    assert summary["final-personal-accuracy-worst"] == min(
        evaluation["personal-accuracy-per-client"]
    )
    # 2 classes per client: personalisation must beat the global model there
    assert (
        summary["final-personal-accuracy-mean"]
        > summary["final-global-accuracy-on-clients-mean"]
    )
    assert (out / "clients.png").stat().st_size > 5_000


@pytest.mark.long
def test_multirun_sweep_writes_summary_and_plot(tmp_path: Path) -> None:
    out = small_sweep(
        tmp_path,
        "strategy=fedavg,fedprox",
        "strategy.mu=0.01,1.0",
        "logger=tensorboard",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    printed = (out.stdout + out.stderr).splitlines()
    # Each of Flower's records printed once, in Flower's format (not Hydra's too).
    sampled = [line for line in printed if "configure_train: sampled" in line]
    assert len(sampled) == 4 * 2 and all(line.startswith("\x1b") for line in sampled)
    assert not [line for line in printed if "][flwr][" in line]
    progress = [line.split("Sweep: ")[1] for line in printed if "Sweep: job" in line]
    assert [p.split(":")[0].split(",")[0] for p in progress] == [
        f"job {n} of 4" for n in range(1, 5)
    ]
    assert "about" in progress[-1] and "left" in progress[-1]
    # One TensorBoard root, a run per job named by its overrides.
    runs = sorted(p.name for p in (tmp_path / "tensorboard").iterdir())
    assert len(runs) == 4 and all("strategy=" in r and "logger" not in r for r in runs)
    assert f"tensorboard --logdir {tmp_path}/tensorboard" in printed[-1]
    with open(tmp_path / "summary.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 4
    assert {r["strategy"] for r in rows} == {"FedAvg", "FedProx"}
    assert all(0.0 < float(r["final-accuracy"]) <= 1.0 for r in rows)
    fedavg = [r for r in rows if r["strategy"] == "FedAvg"]
    # FedAvg ignores mu: both of its jobs give the same numbers (seeded runs).
    assert fedavg[0]["final-accuracy"] == fedavg[1]["final-accuracy"]
    fedprox = {
        r["overrides"]: float(r["final-accuracy"])
        for r in rows
        if r["strategy"] == "FedProx"
    }
    assert len(set(fedprox.values())) == 2  # mu matters
    assert (tmp_path / "comparison.png").stat().st_size > 10_000


def test_a_run_where_every_client_fails_is_an_error(tmp_path: Path) -> None:
    from flwr_prox_strategies import to_client_app

    def broken_client(context):
        raise RuntimeError("cannot load my data")

    run_config = {
        "overrides": "num_clients=3 num_rounds=2 model=logreg",
        "output-dir": str(tmp_path),
    }
    grid = InProcessGrid(
        to_client_app(broken_client), num_nodes=3, run_config=run_config
    )
    with pytest.raises(RuntimeError, match="no round aggregated"):
        run_experiment(grid, run_config)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["summary"]["complete"] is False
    assert results["rounds-without-valid-reply"] == [1, 2]


@pytest.mark.parametrize("name", ["fedepm", "sfedprox"])
def test_fedepm_family_runs_on_adult_and_reports_privacy(tmp_path: Path, name) -> None:
    _, results = run_app(
        tmp_path,
        f"strategy={name} dataset=adult model=logreg num_clients=4 "
        "num_rounds=2 strategy.k0=2 train.batch_size=4096",
        num_nodes=4,
    )
    assert results["summary"]["complete"]
    train = results["rounds"][-1]["train"]
    assert train["replies-valid"] == 2  # ceil(0.5 * 4)
    assert train["dp-epsilon-total-max"] == pytest.approx(0.1)  # <= 1 upload each


def test_pfedavg_runs_from_the_topology_group(tmp_path: Path) -> None:
    """The issue's override string, in-process: every server's model is evaluated."""
    issue = "strategy=pfedavg topology=ring topology.servers=4 num_clients=8"
    _, results = run_app(tmp_path, f"{issue} num_rounds=2 model=logreg", num_nodes=8)
    last = results["rounds"][-1]
    assert last["train"]["replies-valid"] == 8
    assert "consensus-distance" in last["train"]
    assert all(f"server-{i}" in last for i in range(4))
    assert last["central"]["accuracy"] > results["rounds"][0]["central"]["accuracy"]


def test_a_failed_engine_run_is_named_by_the_run_id_flwr_printed() -> None:
    from flwr_prox_strategies.experiment.sweeps.superlink import started_run_id

    log = "Using SuperLink: job (127.0.0.1:31011)\n🎊 Successfully started run 4242\n"
    assert started_run_id(log) == "4242"
    assert started_run_id("Connection to the SuperLink is unavailable") is None

"""What a run's ``overrides`` may instantiate: the ``_target_`` allow-list and the
other doors Hydra opens (its own config, group options outside conf/, resolvers).

Whoever submits a run writes its run config; the ServerApp composes it on the
SuperLink host and the ClientApp on every SuperNode. Fast: nothing here starts
Flower's engine.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from flwr_prox_strategies.experiment import config as config_module
from flwr_prox_strategies.experiment.build import (
    build_client,
    build_model,
    build_strategy,
)
from flwr_prox_strategies.experiment.config import (
    ALLOWED_TARGETS_ENV,
    ConfigNotAllowedError,
    allow_targets,
    check_targets,
    compose_config,
    config_from_run_config,
    instantiate,
)
from flwr_prox_strategies.experiment.server import make_client, run_experiment

from .helpers import node_context

CONF = Path(config_module.CONF_DIR)


class TinyNet(torch.nn.Module):
    """A user's own model, for the user-added target."""

    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


@pytest.fixture(autouse=True)
def _clean_allow_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOWED_TARGETS_ENV, raising=False)
    monkeypatch.setattr(config_module, "_added_targets", [])


def refused(overrides: str, *fragments: str) -> str:
    """Compose through the ServerApp's path; return the refusal message."""
    with pytest.raises(ConfigNotAllowedError) as info:
        config_from_run_config({"overrides": overrides})
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_the_issue_s_run_is_refused_with_the_target_and_the_fix() -> None:
    message = refused(
        "strategy._target_=builtins.open",
        "strategy._target_='builtins.open'",
        ALLOWED_TARGETS_ENV,
        "allow_targets('builtins.open')",
    )
    assert "SuperNode" in message  # says where the setting must be made


@pytest.mark.parametrize(
    ("overrides", "where"),
    [
        ("model._target_=os.system", "model._target_"),
        ("dataset.loader._target_=builtins.open", "dataset.loader._target_"),
        (
            "strategy=pfedavg strategy.inner._target_=builtins.eval",
            "strategy.inner._target_",
        ),
        (
            "+model._args_=[{_target_:builtins.open,file:/etc/hostname}]",
            "model._args_[0]._target_",
        ),
        (
            "+strategy.extra={_target_:logging.basicConfig,level:10}",
            "strategy.extra._target_",
        ),
    ],
)
def test_nested_targets_are_refused(overrides: str, where: str) -> None:
    refused(overrides, f"{where}=")


@pytest.mark.parametrize(
    "overrides",
    [
        # partition/*.yaml already says _partial_: true
        "partition._target_=subprocess.run",
        "+strategy._partial_=true strategy._target_=os.system",
        "+client._partial_=true client._target_=builtins.exec",
    ],
)
def test_partial_targets_are_refused(overrides: str) -> None:
    refused(overrides, "is not allowed")


def test_a_pack_path_through_an_imported_module_is_refused() -> None:
    # task/datasets.py imports os: the name starts with the pack's prefix, but
    # the object is os.system.
    refused(
        "dataset.loader._target_=flwr_prox_strategies.task.datasets.os.system",
        "is posix.system" if os.name == "posix" else "is nt.system",
    )


@pytest.mark.parametrize(
    "target",
    [
        "flwr_prox_strategies.experiment.sweeps.sweep.flwr_run",  # starts processes
        "flwr_prox_strategies.experiment.appdir.write_app_dir",  # writes files
        "flwr_prox_strategies.experiment.config._compose_cached",
        "flwr_prox_strategies.FedDyn.__init__",
        "flwr_prox_strategies.FedAvg.__init__.__globals__",
    ],
)
def test_the_pack_s_glue_and_private_names_are_refused(target: str) -> None:
    refused(f"strategy._target_={target}", f"'{target}'")


def test_a_refused_module_is_never_imported(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "side_effect_mod.py").write_text(
        "import os\nos.environ['SIDE_EFFECT_RAN'] = '1'\ndef f(): pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("SIDE_EFFECT_RAN", raising=False)
    refused("strategy._target_=side_effect_mod.f", "'side_effect_mod.f'")
    assert "side_effect_mod" not in sys.modules
    assert "SIDE_EFFECT_RAN" not in os.environ


def test_the_client_side_refuses_too() -> None:
    """The ClientApp composes the run config on each SuperNode: same refusal."""
    context = node_context(7, 0, 3, "num_clients=3 client._target_=builtins.open")
    with pytest.raises(
        ConfigNotAllowedError, match=r"client\._target_='builtins\.open'"
    ):
        make_client(context)


def test_the_server_app_refuses_before_touching_the_grid() -> None:
    class NoGrid:
        def __getattr__(self, name: str):
            raise AssertionError(f"the grid was used ({name}) before the check")

    with pytest.raises(ConfigNotAllowedError, match=r"builtins\.open"):
        run_experiment(NoGrid(), {"overrides": "strategy._target_=builtins.open"})  # type: ignore[arg-type]


def test_instantiate_checks_configs_built_elsewhere() -> None:
    """build_* and the data loaders check again: a config not from compose_config."""
    with pytest.raises(ConfigNotAllowedError, match=r"builtins\.print"):
        instantiate({"_target_": "builtins.print", "_partial_": True})
    with pytest.raises(ConfigNotAllowedError, match=r"x\[1\]\._target_"):
        check_targets({"x": [1, {"_target_": "os.getcwd"}]})


# -- Hydra's other doors -----------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        "hydra.searchpath=[file:///tmp]",
        "hydra/launcher=basic",
        "+hydra.job.env_set.X=1",
        "+x@hydra.job=digits",
    ],
)
def test_hydra_s_own_config_is_refused(overrides: str) -> None:
    refused(overrides, "Hydra's own configuration")


def test_group_options_come_from_conf_only(tmp_path: Path) -> None:
    # A YAML file outside conf/, reachable by a relative path from conf/dataset/.
    evil = tmp_path / "evil.yaml"
    evil.write_text("name: evil\nnum-features: 4\nnum-classes: 2\nloader: {}\n")
    relative = os.path.relpath(evil.with_suffix(""), CONF / "dataset")
    refused(f"dataset={relative}", "is not an option of dataset", "digits")
    refused(f"+experiment={relative}", "is not an option of experiment")
    refused("dataset=/etc/hostname", "is not an option of dataset")


@pytest.mark.parametrize(
    ("overrides", "shown"),
    [
        ("dataset.name=${oc.env:HOME}", "${oc.env:HOME}"),
        ("+dataset.secret=${oc.env:SOME_SECRET}", "${oc.env:SOME_SECRET}"),
        ("dataset.name=${now:%H}", "${now:%H}"),
        # escaped: a later YAML round trip (data.py) would revive it
        (r"dataset.name=\${oc.env:HOME}", "${oc.env:HOME}"),
        # built by concatenation: the resolved value is a resolver call
        (
            "+dataset.part=\"'{oc.env:HOME}'\" dataset.name=$${dataset.part}",
            "${oc.env:HOME}",
        ),
    ],
)
def test_resolver_calls_are_refused(overrides: str, shown: str) -> None:
    refused(overrides, "calls a resolver", shown)


def test_plain_references_still_work() -> None:
    cfg = compose_config("strategy.min_available_nodes=${num_clients} num_clients=4")
    assert cfg.strategy.min_available_nodes == 4


# -- what is accepted --------------------------------------------------------


# Options that leave their target to the user (``_target_: ???``), with one filled in.
USER_FILLS = {
    "partition=custom": "partition._target_="
    "flwr_prox_strategies.task.partition.official_iid_partition",
}


def every_group_option() -> list[str]:
    options = []
    for group in sorted(p for p in CONF.iterdir() if p.is_dir()):
        prefix = "+" if group.name == "experiment" else ""
        for yaml in sorted(group.glob("*.yaml")):
            option = f"{prefix}{group.name}={yaml.stem}"
            fill = USER_FILLS.get(option)
            options.append(option if fill is None else f"{option} {fill}")
    return options


@pytest.mark.parametrize("override", every_group_option())
def test_every_option_of_the_pack_s_tree_is_accepted(override: str) -> None:
    cfg = compose_config(override)
    check_targets(cfg)


def test_the_pack_s_objects_build() -> None:
    cfg = compose_config("model=logreg strategy=pfedavg num_clients=4")
    assert type(build_strategy(cfg)).__name__ == "PFedAvg"
    model = build_model(cfg)
    client = build_client(
        cfg, model=model, train_loader=[], test_loader=None, relative_size=1.0, seed=0
    )
    assert type(client).__name__ == "FedAvgClient"


@pytest.mark.parametrize(
    "entry",
    [
        f"{__name__}.TinyNet",  # exactly this name
        f"{__name__.split('.')[0]}.",  # a prefix ending in '.'
        f"torch.nn.Identity, {__name__}.TinyNet",  # a list, comma-separated
        "*",  # everything (trusted submitters only)
    ],
)
def test_a_target_the_operator_adds_is_accepted(monkeypatch, entry: str) -> None:
    override = f"model=logreg model._target_={__name__}.TinyNet"
    refused(override, f"{__name__}.TinyNet")
    monkeypatch.setenv(ALLOWED_TARGETS_ENV, entry)
    model = build_model(config_from_run_config({"overrides": override}))
    assert isinstance(model, TinyNet)


def test_a_target_added_in_python_is_accepted() -> None:
    override = f"model=logreg model._target_={__name__}.TinyNet"
    refused(override)
    allow_targets(f"{__name__}.TinyNet")
    assert isinstance(build_model(compose_config(override)), TinyNet)
    with pytest.raises(ValueError, match="not a dotted name"):
        allow_targets("os.system; rm")


def test_a_prefix_does_not_reach_through_imported_modules(monkeypatch) -> None:
    """``tests.`` allows this module's objects, not ``os`` imported into it."""
    monkeypatch.setenv(ALLOWED_TARGETS_ENV, f"{__name__.split('.')[0]}.")
    refused(f"strategy._target_={__name__}.os.system", "is posix.system")
    # ... but an exact entry is the operator's explicit choice.
    monkeypatch.setenv(ALLOWED_TARGETS_ENV, "os.getcwd")
    cfg = compose_config("+strategy.extra={_target_:os.getcwd}")
    assert instantiate(cfg.strategy.extra) == os.getcwd()

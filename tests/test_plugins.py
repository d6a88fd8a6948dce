"""Algorithms registered by installed packages (the entry-point group).

Each test installs a real tiny distribution in ``tmp_path`` (a package with an
``Algorithm``, its ``conf/strategy/<name>.yaml`` and a ``*.dist-info`` with
``entry_points.txt``) by putting it on ``sys.path``: importlib.metadata finds it
as it finds a pip-installed one, with no environment variable. Fast: one
subprocess (the Hydra command line, which composes and prints).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from flwr_prox_strategies.algorithms import (
    ALGORITHMS,
    ENTRY_POINT_GROUP,
    PluginError,
    registered_algorithm,
    registered_algorithms,
)
from flwr_prox_strategies.experiment import config as config_module
from flwr_prox_strategies.experiment.__main__ import refuse_broken_plugins
from flwr_prox_strategies.experiment.build import build_strategy, client_factory
from flwr_prox_strategies.experiment.config import (
    ALLOWED_TARGETS_ENV,
    ConfigNotAllowedError,
    check_target,
    compose_config,
    config_from_run_config,
    plugin_targets,
)
from flwr_prox_strategies.experiment.server import make_client

from .helpers import node_context
from .system.engine import hydra_entry

SMALL = "num_clients=4 num_rounds=1 model=logreg train.local_epochs=1"

PLUGIN_CODE = '''
from flwr_prox_strategies import FedAvg, FedAvgClient
from flwr_prox_strategies.extend import Algorithm, ClientRule


class Nova(FedAvg):
    """FedAvg with one option of its own."""

    def __init__(self, *, boost: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.boost = float(boost)


class NovaClient(FedAvgClient):
    pass


ALGORITHM = Algorithm(Nova, NovaClient, ClientRule, conf="{package}.conf")
NOT_AN_ALGORITHM = {{"strategy": Nova}}
NO_CONF = Algorithm(Nova, NovaClient, ClientRule)
'''

STRATEGY_YAML = """\
# @package _global_
defaults:
  - _base/common
  - _base/sgd
  - _self_
strategy:
  _target_: {package}.Nova
  boost: 2.5
  min_train_nodes: 2
  local_epochs: ${{train.local_epochs}}
client:
  _target_: {package}.NovaClient
"""


def install(
    root: Path,
    entry_points: dict[str, str],
    *,
    dist: str = "flwr-nova",
    package: str = "flwr_nova",
    strategies: tuple[str, ...] = ("nova",),
    extra_files: dict[str, str] | None = None,
    code: str = PLUGIN_CODE,
) -> Path:
    """Write a distribution ``dist`` (package ``package``) under ``root``."""
    pkg = root / package
    (pkg / "conf" / "strategy").mkdir(parents=True)
    (pkg / "__init__.py").write_text(code.format(package=package))
    (pkg / "conf" / "__init__.py").write_text("")
    for name in strategies:
        (pkg / "conf" / "strategy" / f"{name}.yaml").write_text(
            STRATEGY_YAML.format(package=package)
        )
    for relative, text in (extra_files or {}).items():
        (pkg / "conf" / relative).parent.mkdir(parents=True, exist_ok=True)
        (pkg / "conf" / relative).write_text(text)
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n"
    )
    lines = [f"{name} = {value}" for name, value in entry_points.items()]
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n" + "\n".join(lines) + "\n"
    )
    return root


@pytest.fixture
def plugin_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Forget the plugins (and their modules) the test installed, before and after."""
    monkeypatch.delenv(ALLOWED_TARGETS_ENV, raising=False)
    monkeypatch.setattr(config_module, "_added_targets", [])

    def forget() -> None:
        for module in [
            m for m in sys.modules if m.split(".")[0].startswith("flwr_nova")
        ]:
            del sys.modules[module]
        registered_algorithms(refresh=True)

    forget()
    yield
    monkeypatch.undo()  # the plugins leave sys.path first
    forget()


@pytest.fixture
def nova(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plugin_path: None) -> Path:
    root = install(
        tmp_path / "site",
        {"nova": "flwr_nova:ALGORITHM"},
        extra_files={
            "dataset/evil.yaml": "name: evil\n",
            "strategy/helper.yaml": "# @package _global_\n",
        },
    )
    monkeypatch.syspath_prepend(str(root))
    registered_algorithms(refresh=True)
    return root


def test_a_plugin_builds_through_the_app_s_path(nova: Path) -> None:
    algorithm = registered_algorithm("nova")
    assert algorithm.strategy.__module__ == "flwr_nova"
    assert "nova" not in ALGORITHMS  # the pack's own table stays the pack's
    assert list(registered_algorithms())[: len(ALGORITHMS)] == list(ALGORITHMS)

    cfg = compose_config(f"strategy=nova strategy.boost=3.0 {SMALL}")
    strategy = build_strategy(cfg)
    assert isinstance(strategy, algorithm.strategy)
    assert strategy.boost == 3.0
    assert strategy.min_available_nodes == 4  # from the pack's _base/common
    assert client_factory(cfg).func is algorithm.client

    # flwr run: the ServerApp composes the run config, each SuperNode too.
    served = config_from_run_config({"overrides": f"strategy=nova {SMALL}"})
    assert served.strategy.boost == 2.5
    context = node_context(7, 0, 4, f"strategy=nova {SMALL}")
    assert type(make_client(context)) is algorithm.client


def test_the_allow_list_takes_the_plugin_s_targets_only(nova: Path) -> None:
    assert plugin_targets() == ("flwr_nova.",)
    check_target("flwr_nova.Nova")
    check_target("flwr_nova.NovaClient")
    for target in (
        "os.system",
        "flwr_prox_strategies.experiment.sweeps.sweep.flwr_run",
    ):
        with pytest.raises(ConfigNotAllowedError, match="is not allowed"):
            check_target(target)
    with pytest.raises(ConfigNotAllowedError, match=r"builtins\.open"):
        compose_config(f"strategy=nova client._target_=builtins.open {SMALL}")


def test_only_the_plugin_s_strategy_is_an_option(nova: Path) -> None:
    # Its conf package holds more, but a run selects the pack's groups only,
    # and among strategies only what a plugin registers.
    with pytest.raises(ConfigNotAllowedError, match="'evil' is not an option"):
        compose_config("dataset=evil")
    with pytest.raises(ConfigNotAllowedError, match="installed plugins: nova") as err:
        compose_config("strategy=helper")
    # Plugin words: where each plugin comes from, and how a package adds one.
    assert re.search(r"nova \(\S+ \S+\)", str(err.value)), err.value
    assert "entry point in the group 'flwr_prox_strategies.algorithms'" in str(
        err.value
    )


def test_an_unknown_strategy_says_how_a_plugin_registers_one() -> None:
    with pytest.raises(ConfigNotAllowedError) as err:
        compose_config("strategy=fedadmm")
    text = str(err.value)
    assert "'fedadmm' is not an option of strategy" in text
    assert "installed plugins: " in text
    assert "Registering an algorithm from your own package" in text


def test_a_plugin_reusing_others_classes_opens_those_classes_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plugin_path: None
) -> None:
    code = (
        "from flwr.serverapp.strategy import FedAvg\n"
        "from flwr_prox_strategies import FedAvgClient\n"
        "from flwr_prox_strategies.extend import Algorithm\n"
        "ALGORITHM = Algorithm(FedAvg, FedAvgClient, None, conf='{package}.conf')\n"
    )
    root = install(tmp_path / "site", {"nova": "flwr_nova:ALGORITHM"}, code=code)
    monkeypatch.syspath_prepend(str(root))
    registered_algorithms(refresh=True)
    assert plugin_targets() == ("flwr_nova.", "flwr.serverapp.strategy.fedavg.FedAvg")


@pytest.mark.parametrize(
    ("entry_points", "message"),
    [
        ({"nova": "flwr_nova:NOT_AN_ALGORITHM"}, "is a dict, not a"),
        ({"nova": "flwr_nova:NO_CONF"}, "conf is None"),
        ({"nova": "flwr_nova:MISSING"}, "cannot be loaded"),
        ({"nova": "flwr_nova_gone:ALGORITHM"}, "cannot be loaded"),
        ({"nova2": "flwr_nova:ALGORITHM"}, "holds no strategy/nova2.yaml"),
    ],
)
def test_a_broken_plugin_is_named_when_asked_for_and_breaks_nothing_else(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    plugin_path: None,
    entry_points: dict[str, str],
    message: str,
) -> None:
    (name,) = entry_points
    root = install(tmp_path / "site", entry_points)
    monkeypatch.syspath_prepend(str(root))
    with caplog.at_level(logging.WARNING, logger="flwr"):
        algorithms = registered_algorithms(refresh=True)
    assert name not in algorithms
    assert f"{name} = {entry_points[name]!r} of flwr-nova" in caplog.text
    assert message in caplog.text

    with pytest.raises(PluginError, match="of flwr-nova") as info:
        compose_config(f"strategy={name}")
    assert message in str(info.value)
    with pytest.raises(SystemExit, match=message):
        refuse_broken_plugins([f"strategy=fedavg,{name}"])
    assert compose_config(f"strategy=fedavg {SMALL}").strategy._target_.endswith(
        "FedAvg"
    )


def test_a_name_collision_is_an_error_naming_both_sides(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    plugin_path: None,
) -> None:
    root = tmp_path / "site"
    install(root, {"fedavg": "flwr_nova:ALGORITHM", "nova": "flwr_nova:ALGORITHM"})
    install(
        root,
        {"nova": "flwr_nova_two:ALGORITHM", "bad.name": "flwr_nova_two:ALGORITHM"},
        dist="flwr-nova-two",
        package="flwr_nova_two",
    )
    monkeypatch.syspath_prepend(str(root))
    with caplog.at_level(logging.WARNING, logger="flwr"):
        algorithms = registered_algorithms(refresh=True)
    # The pack keeps its name; the plugins' clash leaves neither in.
    assert algorithms["fedavg"] is ALGORITHMS["fedavg"]
    assert "nova" not in algorithms
    assert "'fedavg' is one of the pack's own algorithms" in caplog.text
    assert "'bad.name' is not a valid conf name" in caplog.text
    with pytest.raises(PluginError, match="two installed packages") as info:
        registered_algorithm("nova")
    assert "of flwr-nova (" in str(info.value)
    assert "of flwr-nova-two (" in str(info.value)


def test_a_plugin_whose_yaml_another_plugin_shadows_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plugin_path: None
) -> None:
    # Hydra takes the first strategy/orion.yaml on its search path: flwr_nova's
    # copy could replace the one of the plugin that registers orion.
    root = tmp_path / "site"
    install(root, {"nova": "flwr_nova:ALGORITHM"}, strategies=("nova", "orion"))
    install(
        root,
        {"orion": "flwr_nova_two:ALGORITHM"},
        dist="flwr-nova-two",
        package="flwr_nova_two",
        strategies=("orion",),
    )
    monkeypatch.syspath_prepend(str(root))
    algorithms = registered_algorithms(refresh=True)
    assert "nova" in algorithms
    with pytest.raises(PluginError, match=r"also in flwr_nova\.conf"):
        registered_algorithm("orion")


def test_the_hydra_command_line_finds_the_plugin(nova: Path, tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(nova), env.get("PYTHONPATH", "")) if p
    )
    env.pop(ALLOWED_TARGETS_ENV, None)
    out = hydra_entry(
        *("strategy=nova", "strategy.boost=4.0", *SMALL.split()),
        *("--cfg", "job"),
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    job = textwrap.dedent(out.stdout)
    assert "_target_: flwr_nova.Nova" in job
    assert "boost: 4.0" in job
    assert "_target_: flwr_nova.NovaClient" in job

"""Import light: the base import leaves logging alone; optional parts name their extra."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import textwrap
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
import tomllib
from torch import nn

from flwr_prox_strategies import DPSGD, make_private_model
from flwr_prox_strategies._optional import require, require_installed
from flwr_prox_strategies.ops.graphs import adjacency
from flwr_prox_strategies.ops.mixing import mixing_matrix

HEAVY = (
    "opacus",
    "cvxpy",
    "hydra",
    "omegaconf",
    "matplotlib",
    "sklearn",
    "datasets",
    "flwr_datasets",
    "pandas",
    "scipy",
    "ray",
)
# flwr < 1.24 imports flwr.simulation, and so Ray where it is installed, on
# `import flwr`: the pack cannot keep Ray out there.
FLWR_IMPORTS_RAY = tuple(int(p) for p in version("flwr").split(".")[:2]) < (1, 24)


def run_python(code: str, cwd: Path | None = None) -> str:
    """Run ``code`` in a fresh interpreter; return its stdout (fail on error)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_leaves_logging_alone_and_imports_nothing_optional() -> None:
    out = run_python(
        f"""
        import logging, sys
        before = list(logging.getLogger().handlers)
        level = logging.getLogger().level
        import flwr_prox_strategies
        import flwr_prox_strategies.task
        import flwr_prox_strategies.ops.mixing
        import flwr_prox_strategies.algorithms.pfedavg
        assert logging.getLogger().handlers == before, logging.getLogger().handlers
        assert logging.getLogger().level == level
        print(sorted(m for m in {HEAVY!r} if m in sys.modules))
        """
    )
    assert out.strip() == ("['ray']" if FLWR_IMPORTS_RAY and find_spec("ray") else "[]")


# What a SuperNode's ClientApp process may load before a message needs the client.
CLIENT_HEAVY = (*HEAVY, "torch")
PACK_HEAVY = (
    "flwr_prox_strategies.algorithms",
    "flwr_prox_strategies.task",
    "flwr_prox_strategies.core.client.client",
    "flwr_prox_strategies.experiment.server",
    "flwr_prox_strategies.experiment.build",
    "flwr_prox_strategies.experiment.config",
    "flwr_prox_strategies.experiment.data",
)


def test_clientapp_answers_a_key_exchange_stage_without_torch_or_the_model() -> None:
    """On a SuperNode every message starts a ClientApp process: the stages of
    secure aggregation that carry no training must not pay for torch, the
    model or the data code (``apps/client_app.py`` imported as ``flwr run``
    imports it, from the app's folder)."""
    out = run_python(
        f"""
        import sys
        from flwr.app import ConfigRecord, Context, Message, RecordDict
        from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage

        from apps.client_app import app
        from flwr_prox_strategies.core.transport.flower import set_task_identity

        set_task_identity(1)
        setup = ConfigRecord(
            {{
                Key.STAGE: Stage.SETUP,
                "server-round": 1,
                Key.SAMPLE_NUMBER: 1,
                Key.SHARE_NUMBER: 1,
                Key.THRESHOLD: 1,
                Key.CLIPPING_RANGE: 8.0,
                Key.TARGET_RANGE: 2**22,
                Key.MOD_RANGE: 2**32,
                Key.MAX_WEIGHT: 100.0,
            }}
        )
        message = Message(
            RecordDict({{"secagg-plus": setup}}),
            dst_node_id=1001,
            message_type="train",
            group_id="1",
        )
        node = {{"partition-id": 0, "num-partitions": 1}}
        reply = app(message, Context(1, 1001, node, RecordDict(), {{}}))
        assert not reply.has_error(), reply.error
        keys = reply.content.config_records["secagg-plus"]
        assert keys[Key.PUBLIC_KEY_1] and keys[Key.PUBLIC_KEY_2], dict(keys)
        print(sorted(m for m in {CLIENT_HEAVY + PACK_HEAVY!r} if m in sys.modules))
        """,
        cwd=REPO,
    )
    loaded = out.strip()
    assert loaded == ("['ray']" if FLWR_IMPORTS_RAY and find_spec("ray") else "[]")


def test_public_names_load_on_first_use_from_their_modules() -> None:
    """The top level is lazy (PEP 562): importing it loads none of its names'
    modules; each name, asked for, is its module's object; ``dir()`` and
    ``import *`` see them all."""
    out = run_python(
        """
        import importlib, sys
        import flwr_prox_strategies as pack
        assert "torch" not in sys.modules
        assert "flwr_prox_strategies.algorithms" not in sys.modules
        assert set(pack._MODULE_OF) == set(pack.__all__)
        assert set(pack.__all__) <= set(dir(pack))
        names = {}
        exec("from flwr_prox_strategies import *", names)
        for name in pack.__all__:
            module = importlib.import_module(pack._MODULE_OF[name], "flwr_prox_strategies")
            assert names[name] is getattr(module, name) is getattr(pack, name), name
        print("torch" in sys.modules)
        """
    )
    assert out.strip() == "True"


def test_dp_settings_build_without_opacus_and_using_them_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "opacus", None)  # "not installed"
    dp = DPSGD(noise_multiplier=1.0, clipping_norm=1.0)
    model = nn.Linear(3, 2)
    assert make_private_model(model, None) is model
    with pytest.raises(ImportError, match=r'pip install "flwr-prox-strategies\[dp\]"'):
        make_private_model(model, dp)


def test_sdp_mixing_without_cvxpy_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "cvxpy", None)
    ring = adjacency("ring", 6)
    assert np.allclose(mixing_matrix(ring, "metropolis").sum(axis=1), 1.0)
    with pytest.raises(ImportError, match=r"cvxpy.*flwr-prox-strategies\[sdp\]"):
        mixing_matrix(ring, "sdp")


def test_experiment_layer_without_hydra_names_the_extra() -> None:
    out = run_python(
        """
        import sys
        sys.modules["hydra"] = None
        try:
            import flwr_prox_strategies.experiment.config
        except ImportError as err:
            print(err)
        """
    )
    assert "hydra-core" in out
    assert 'pip install "flwr-prox-strategies[experiment]"' in out


def test_require_passes_on_an_import_error_from_inside_an_installed_package(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text("import not_there_at_all\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError) as info:
        require("brokenpkg", "dp", "a feature")
    assert info.value.name == "not_there_at_all"  # the real cause, not "install dp"
    with pytest.raises(ImportError, match=r"flwr-prox-strategies\[sdp\]"):
        require("surely_not_a_module_xyz", "sdp", "a feature")
    require_installed(("brokenpkg",), "dp", "a feature")  # installed: no error
    with pytest.raises(ImportError, match="surely_not_a_module_xyz"):
        require_installed(("surely_not_a_module_xyz",), "sdp", "a feature")


# ------------------------------------------------------------ layout: conf/, the app

REPO = Path(__file__).resolve().parents[1]


def test_conf_tree_is_package_data_when_installed_else_the_checkouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flwr_prox_strategies.experiment import config

    assert config.CONF_DIR == REPO / "conf"  # this checkout
    installed = tmp_path / "site-packages" / "flwr_prox_strategies"
    monkeypatch.setattr(config, "_PACKAGE", installed)
    with pytest.raises(FileNotFoundError, match=r"conf/config\.yaml"):
        config.find_conf_dir()
    (installed / "conf").mkdir(parents=True)
    (installed / "conf" / "config.yaml").write_text("seed: 0\n")
    assert config.find_conf_dir() == installed / "conf"


def test_the_wheel_holds_one_package_with_the_hydra_tree_inside(wheel: Path) -> None:
    """What ``pip install flwr-prox-strategies`` unpacks: the package and its
    ``conf/`` (package data), and the search sweeper's shim in Hydra's plugin
    namespace (a portion of it: no ``hydra_plugins/__init__.py``, which would
    hide every other Hydra plugin); nothing else at the top (no apps/, tests/)."""
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {
        "flwr_prox_strategies",
        "hydra_plugins",
        wheel.name.split("-py3")[0] + ".dist-info",
    }
    plugins = [name for name in names if name.startswith("hydra_plugins/")]
    assert plugins == ["hydra_plugins/flwr_prox_search/__init__.py"]
    conf = sorted(
        p.relative_to(REPO).as_posix() for p in (REPO / "conf").rglob("*.yaml")
    )
    assert len(conf) > 20
    assert {f"flwr_prox_strategies/{p}" for p in conf} <= set(names)
    modules = {
        f"flwr_prox_strategies/{p.relative_to(REPO / 'flwr_prox_strategies').as_posix()}"
        for p in (REPO / "flwr_prox_strategies").rglob("*.py")
    }
    assert modules <= set(names), modules - set(names)


def test_written_app_declares_the_repository_apps_config_and_components() -> None:
    import importlib

    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    from apps.client_app import app as repo_client_app
    from apps.server_app import app as repo_server_app
    from flwr_prox_strategies.experiment.appdir import app_pyproject

    repo = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    written = tomllib.loads(app_pyproject())["tool"]["flwr"]["app"]
    assert written["config"] == repo["config"]
    objects = {}
    for kind, ref in written["components"].items():
        module, attr = ref.split(":")
        objects[kind] = getattr(importlib.import_module(module), attr)
    assert isinstance(objects["serverapp"], ServerApp)
    assert isinstance(objects["clientapp"], ClientApp)
    # apps/ only re-exports the package's objects: one app.
    assert objects["serverapp"] is repo_server_app
    assert objects["clientapp"] is repo_client_app


def test_sweep_outside_a_checkout_runs_its_own_written_app(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flwr_prox_strategies.experiment.sweeps import sweep
    from flwr_prox_strategies.experiment.sweeps.sweep import APP_DIR_ENV, app_dir

    assert app_dir() == REPO  # in a checkout: the checkout
    site = tmp_path / "site-packages" / "flwr_prox_strategies" / "experiment" / "sweeps"
    monkeypatch.setattr(sweep, "__file__", str(site / "sweep.py"))
    users_app = tmp_path / "users-own-app"  # another Flower app: not ours to run
    users_app.mkdir()
    (users_app / "pyproject.toml").write_text(
        '[project]\nname = "quickstart"\n[tool.flwr.app]\npublisher = "me"\n'
    )
    monkeypatch.chdir(users_app)
    monkeypatch.delenv(APP_DIR_ENV, raising=False)
    sweep._written_app_dir.cache_clear()
    try:
        written = app_dir()
        assert written != users_app and written.parent == Path(tempfile.gettempdir())
        components = tomllib.loads((written / "pyproject.toml").read_text())["tool"][
            "flwr"
        ]["app"]["components"]
        assert components["serverapp"].startswith("flwr_prox_strategies.experiment.")
        assert app_dir() == written  # written once per process
        monkeypatch.setenv(APP_DIR_ENV, str(users_app))  # explicit: honoured
        assert app_dir() == users_app
        monkeypatch.setenv(APP_DIR_ENV, str(tmp_path))
        with pytest.raises(FileNotFoundError, match=APP_DIR_ENV):
            app_dir()
    finally:
        sweep._written_app_dir.cache_clear()
        shutil.rmtree(written, ignore_errors=True)

"""The wheel, installed with no extras into a clean venv, then with ``[sweeps]``.

Slow (creates a venv, installs torch and flwr into it, then the launchers). The wheel's contents are
checked in the fast suite (``tests/test_packaging.py``) on the same ``wheel``
fixture; the sweep of a pip-installed pack (its own written app) runs in
``test_flwr_run.py``.
"""

from __future__ import annotations

import subprocess
import textwrap
import time
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# Runs inside the clean venv, outside the checkout.
VENV_SCRIPT = r"""
import importlib.resources
import importlib.util
import logging
import sys

before = list(logging.getLogger().handlers)
level = logging.getLogger().level
import flwr_prox_strategies as fps

assert logging.getLogger().handlers == before, logging.getLogger().handlers
assert logging.getLogger().level == level
assert fps.__file__.startswith(sys.prefix), fps.__file__
for name in ("opacus", "cvxpy", "hydra", "matplotlib", "sklearn", "datasets",
             "flwr_datasets", "pandas", "ray", "apps", "tests"):
    assert name not in sys.modules, name
    assert importlib.util.find_spec(name) is None, f"{name} is installed"
conf = importlib.resources.files("flwr_prox_strategies") / "conf"
assert (conf / "config.yaml").is_file() and (conf / "strategy" / "fedprox.yaml").is_file()

# Optional parts say which extra to install, when used.
try:
    import flwr_prox_strategies.experiment
except ImportError as err:
    assert "flwr-prox-strategies[experiment]" in str(err), err
else:
    raise AssertionError("the experiment layer imported without its extra")
model = __import__("torch").nn.Linear(4, 3)
try:
    fps.make_private_model(model, fps.DPSGD(noise_multiplier=1.0, clipping_norm=1.0))
except ImportError as err:
    assert "flwr-prox-strategies[dp]" in str(err), err
else:
    raise AssertionError("DP-SGD ran without opacus")

# One FedProx round, in process, with a tiny model and random tensors.
import numpy as np
import torch
from flwr.app import ArrayRecord
from torch.utils.data import DataLoader, TensorDataset

from flwr_prox_strategies import FedProx, FedProxClient, to_client_app
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid


def net():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def client_fn(context):
    gen = torch.Generator().manual_seed(int(context.node_config["partition-id"]))
    data = TensorDataset(torch.randn(32, 4, generator=gen), torch.randint(0, 3, (32,), generator=gen))
    return FedProxClient(net(), DataLoader(data, batch_size=8), local_epochs=1, learning_rate=0.1)


torch.manual_seed(0)
initial = ArrayRecord(net().state_dict())
grid = InProcessGrid(to_client_app(client_fn), num_nodes=3)
result = FedProx(mu=0.1, min_available_nodes=3).start(grid=grid, initial_arrays=initial, num_rounds=1)
final = {k: v.numpy() for k, v in result.arrays.items()}
start = {k: v.numpy() for k, v in initial.items()}
assert final.keys() == start.keys()
assert all(np.isfinite(v).all() for v in final.values())
assert any(not np.array_equal(final[k], start[k]) for k in start), "the round changed nothing"
assert 1 in result.train_metrics_clientapp, result.train_metrics_clientapp
print("VENV OK", sorted(result.train_metrics_clientapp[1]))
"""

# Runs inside the venv after the [sweeps] extra: every launcher and the search
# sweeper are Hydra plugins, Optuna is current, flwr's pins hold.
SWEEPS_SCRIPT = r"""
from importlib.metadata import version

from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper

import flwr_prox_strategies.experiment.sweeps.search
import optuna
import submitit

launchers = {c.__name__ for c in Plugins.instance().discover(Launcher)}
assert {"JoblibLauncher", "SlurmLauncher", "RayLauncher"} <= launchers, launchers
sweepers = {c.__name__ for c in Plugins.instance().discover(Sweeper)}
assert "SearchSweeper" in sweepers, sweepers
assert int(optuna.__version__.split(".")[0]) >= 4, optuna.__version__
assert int(version("rich").split(".")[0]) < 15, version("rich")
assert version("flwr").startswith("1.4"), version("flwr")
print("SWEEPS OK", optuna.__version__, version("flwr"), version("ray"))
"""

HEAVY_DISTRIBUTIONS = (
    "opacus",
    "cvxpy",
    "hydra-core",
    "matplotlib",
    "scikit-learn",
    "datasets",
    "flwr-datasets",
    "pandas",
    "pyarrow",
    "ray",
)


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)
    assert out.returncode == 0, (
        f"{command}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    )
    return out


def test_wheel_with_no_extras_in_a_clean_venv(tmp_path: Path, wheel: Path) -> None:
    # A clean venv (no system site-packages): torch first, then the wheel alone.
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    python = str(env_dir / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # --no-compile: torch's .pyc files are not what this test is about.
    run([*pip, "--no-compile", "torch==2.13.0"], timeout=900)
    start = time.monotonic()
    run([*pip, str(wheel)], timeout=900)
    install_s = time.monotonic() - start
    print(f"wheel install (flwr and its deps, no extras): {install_s:.1f} s")
    assert install_s < 300, f"installing the wheel took {install_s:.0f} s"
    listed = run([python, "-m", "pip", "list", "--format", "freeze"]).stdout.lower()
    installed = {line.split("==")[0] for line in listed.split()}
    assert "flwr" in installed and "torch" in installed
    assert not installed & set(HEAVY_DISTRIBUTIONS), installed & set(
        HEAVY_DISTRIBUTIONS
    )

    # In the venv, outside the checkout: light import, clear errors, a FedProx round.
    script = tmp_path / "check_install.py"
    script.write_text(textwrap.dedent(VENV_SCRIPT))
    out = run([python, str(script)], cwd=tmp_path, timeout=600)
    assert "VENV OK" in out.stdout, out.stdout + out.stderr

    # Then the [sweeps] extra in the same venv: Hydra's launchers and Optuna
    # resolve with flwr's pins (pip check), and Hydra finds every plugin.
    start = time.monotonic()
    run([*pip, "--no-compile", f"{wheel}[sweeps]"], timeout=900)
    print(f"[sweeps] extra install: {time.monotonic() - start:.1f} s")
    run([python, "-m", "pip", "check"])
    script = tmp_path / "check_sweeps.py"
    script.write_text(textwrap.dedent(SWEEPS_SCRIPT))
    out = run([python, str(script)], cwd=tmp_path, timeout=600)
    assert "SWEEPS OK" in out.stdout, out.stdout + out.stderr

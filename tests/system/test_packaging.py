"""The wheel, installed with no extras into a clean venv, and the pack's own app.

Slow (builds a wheel, creates a venv, installs torch and flwr into it; starts
Flower's engine) but run in CI.
"""

from __future__ import annotations

import csv
import subprocess
import sys
import textwrap
import time
import venv
import zipfile
from pathlib import Path

import pytest

from .engine import REPO, managed_engine

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
from flwr_prox_strategies.core.inprocess import InProcessGrid


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


def test_wheel_with_no_extras_in_a_clean_venv(tmp_path: Path) -> None:
    # The wheel: one top-level package, the Hydra tree inside it.
    wheels = tmp_path / "wheels"
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), "."],
        cwd=REPO,
        timeout=600,
    )
    (wheel,) = wheels.glob("flwr_prox_strategies-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"flwr_prox_strategies", wheel.name.split("-py3")[0] + ".dist-info"}
    conf = sorted(
        p.relative_to(REPO).as_posix() for p in (REPO / "conf").rglob("*.yaml")
    )
    assert len(conf) > 20
    assert {f"flwr_prox_strategies/{p}" for p in conf} <= set(names)

    # A clean venv (no system site-packages): torch first, then the wheel alone.
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    python = str(env_dir / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run([*pip, "torch==2.13.0"], timeout=900)
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


def test_sweep_runs_the_installed_packs_own_app(tmp_path: Path) -> None:
    """Outside a checkout the sweep runs the Flower app the pack writes for itself:
    a folder holding only a pyproject.toml whose components are the package's."""
    from flwr_prox_strategies.experiment.appdir import write_app_dir

    app = write_app_dir(tmp_path / "app")
    assert [p.name for p in app.iterdir()] == ["pyproject.toml"]
    sweep_dir = tmp_path / "sweep"
    with managed_engine(tmp_path / "home") as env:
        env["FLWR_PROX_APP_DIR"] = str(app)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "flwr_prox_strategies.experiment",
                "-m",
                "strategy=fedprox",
                "num_clients=3",
                "num_rounds=2",
                "model=logreg",
                f"hydra.sweep.dir={sweep_dir}",
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=600,
            check=False,
        )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"flwr run {app} --stream" in out.stdout + out.stderr, out.stderr[-2000:]
    with open(sweep_dir / "summary.csv") as handle:
        (row,) = list(csv.DictReader(handle))
    assert row["strategy"] == "FedProx" and float(row["final-accuracy"]) > 0.3

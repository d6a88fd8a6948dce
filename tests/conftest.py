"""Suite-wide settings.

* Under pytest-xdist every worker gets one torch thread: two workers with two
  threads each on a 2-core machine fight over the cores.
* ``wheel``: the package's wheel, built once a session (no isolated build
  env: hatchling comes with the ``test`` extra).
* Tests marked ``long`` (tens of seconds) are collected first, so that the
  workers share them out early and end together.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout (``pip wheel --no-deps``), built once."""
    folder = tmp_path_factory.mktemp("wheel")
    out = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--no-deps"),
            *("--no-build-isolation", "-q", "-w", str(folder), str(REPO)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (built,) = folder.glob("flwr_prox_strategies-*.whl")
    return built

"""The layering contracts of pyproject.toml ([tool.importlinter]) hold, and can fail."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")


def lint(folder: Path) -> subprocess.CompletedProcess[str]:
    # import-linter puts the working directory first on sys.path, so the
    # package it analyses is the one in `folder`.
    return subprocess.run(
        [str(LINT)], cwd=folder, capture_output=True, text=True, timeout=300
    )


def test_the_pack_keeps_its_layers() -> None:
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "12 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("ops/proximal.py", "import flwr", "ops is pure maths"),
        (
            "core/transport/records.py",
            "from ...algorithms import fedavg",
            "core knows no",
        ),
        (
            "core/transport/keys.py",
            "from ..server import strategy",
            "core's rooms are layers",
        ),
        ("core/server/sampling.py", "from . import strategy", "no import cycle"),
        (  # an import for type hints only closes a cycle too
            "core/server/population.py",
            "import typing\nif typing.TYPE_CHECKING:\n    from . import strategy",
            "no import cycle",
        ),
        ("algorithms/fedavg.py", "from ..task import models", "algorithms know no"),
        (
            "experiment/sweeps/sweep.py",
            "import apps.client_app",
            "nothing imports the apps",
        ),
        (
            "experiment/sweeps/sweep.py",
            "from .. import apps",
            "nothing in the pack imports",
        ),
        ("__init__.py", "from .experiment.apps import main", "nothing in the pack"),
        ("experiment/rounds.py", "from . import build", "the experiment's steps"),
        ("experiment/results.py", "from . import record", "the experiment's steps"),
    ],
)
def test_a_back_arrow_breaks_its_contract(
    tmp_path: Path, module: str, line: str, contract: str
) -> None:
    for name in ("flwr_prox_strategies", "apps"):
        shutil.copytree(
            ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    target = tmp_path / "flwr_prox_strategies" / module
    target.write_text(target.read_text() + f"\n{line}  # noqa\n")
    result = lint(tmp_path)
    assert result.returncode != 0
    # A back arrow into core/ also closes a cycle: name the contract it breaks.
    broken = result.stdout.split("Broken contracts")[1]
    assert contract in broken

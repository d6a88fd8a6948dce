"""The architecture page cannot drift: its map is generated, its names resolve."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "explanation" / "architecture.md"
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import packagemap  # noqa: E402

# "About a dozen": ops/ (pure maths, one module per formula family) holds 13.
MAX_MODULES = 13


def resolve(dotted: str) -> object:
    """Import the longest module prefix of ``dotted``, then get the attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_folder_holds_about_a_dozen_modules() -> None:
    sizes = packagemap.folder_sizes()
    assert "flwr_prox_strategies/core/server" in sizes
    crowded = {folder: n for folder, n in sizes.items() if n > MAX_MODULES}
    assert not crowded, f"split these folders by concern: {crowded}"


def test_every_module_and_folder_says_what_it_is() -> None:
    for path in sorted((ROOT / "flwr_prox_strategies").rglob("*.py")):
        assert packagemap.first_line(path), f"{path} has no docstring"


def test_the_page_shows_the_generated_map_and_contracts() -> None:
    text = PAGE.read_text()
    assert "```{package-map}" in text and "```{import-contracts}" in text
    tree = packagemap.package_map()
    assert "│   ├── server/" in tree and "strategy.py" in tree
    assert len(packagemap.import_contracts()) >= 10


def test_every_name_in_the_round_path_exists() -> None:
    names = set(re.findall(r"`(flwr_prox_strategies(?:\.\w+)+)`", PAGE.read_text()))
    assert len(names) >= 25
    missing = []
    for name in sorted(names):
        try:
            resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    assert not missing, f"the architecture page names what the code lacks: {missing}"


@pytest.mark.parametrize(
    "name", ["flwr_prox_strategies.core.server.sampling.Sampler.sample_all"]
)
def test_a_stale_name_is_caught(name: str) -> None:
    with pytest.raises(AttributeError):
        resolve(name)


def test_an_experiment_is_four_steps_each_in_its_own_module() -> None:
    """``run_experiment`` calls compose, build, run, record: once each, in order."""
    import ast

    import flwr_prox_strategies.experiment.server as server

    source = Path(server.__file__).read_text()
    tree = ast.parse(source)
    imported = {
        alias.asname or alias.name: node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 1
        for alias in node.names
    }
    (function,) = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "run_experiment"
    ]
    calls = [
        node.func.id
        for node in sorted(
            ast.walk(function), key=lambda n: getattr(n, "lineno", 0) or 0
        )
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    ]
    assert [imported.get(name) for name in calls] == [
        "config",
        "build",
        "run",
        "record",
    ], calls
    assert function.end_lineno is not None
    assert function.end_lineno - function.lineno < 60

"""The package's map, generated from the code when the site is built.

Directives:

``package-map``
    The folders and modules of ``flwr_prox_strategies`` as a tree, each with the
    first line of its docstring (a folder: its ``__init__``'s).
``import-contracts``
    The names of the import-linter contracts of ``pyproject.toml``, the layers
    CI checks, as a list.

:func:`package_map` and :func:`folder_sizes` are what the tests check too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "flwr_prox_strategies"


def first_line(path: Path) -> str:
    """Return the first line of a module's docstring ('' without one)."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    line = doc.strip().splitlines()[0].strip() if doc else ""
    line = re.sub(r":[a-z]+:`~?\.*([^`]+)`", r"\1", line)  # :mod:`.x` -> x
    return line.replace("``", "")


def modules_of(folder: Path) -> list[Path]:
    """Return a folder's modules (not ``__init__``), sorted."""
    return sorted(p for p in folder.glob("*.py") if p.name != "__init__.py")


def folders_of(folder: Path) -> list[Path]:
    """Return a folder's subpackages, sorted."""
    return sorted(p.parent for p in folder.glob("*/__init__.py"))


def folder_sizes() -> dict[str, int]:
    """Return each folder of the package (relative path) -> its number of modules."""
    sizes = {}
    for init in sorted(PACKAGE.rglob("__init__.py")):
        sizes[str(init.parent.relative_to(ROOT))] = len(modules_of(init.parent))
    return sizes


def package_map(width: int = 34) -> str:
    """Return the package as a text tree, each entry with its docstring's first line."""
    lines = [f"{PACKAGE.name + '/':<{width}}{first_line(PACKAGE / '__init__.py')}"]

    def walk(folder: Path, prefix: str) -> None:
        entries = [*folders_of(folder), *modules_of(folder)]
        for number, path in enumerate(entries, 1):
            last = number == len(entries)
            branch = "└── " if last else "├── "
            is_folder = path.is_dir()
            name = path.name + ("/" if is_folder else "")
            doc = first_line(path / "__init__.py" if is_folder else path)
            label = f"{prefix}{branch}{name}"
            lines.append(f"{label:<{width}}{doc}" if len(label) < width else label)
            if len(label) >= width:
                lines.append(f"{'':<{width}}{doc}")
            if is_folder:
                walk(path, prefix + ("    " if last else "│   "))

    walk(PACKAGE, "")
    return "\n".join(lines)


def import_contracts() -> list[str]:
    """Return the names of pyproject's import-linter contracts, in order."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [c["name"] for c in config["tool"]["importlinter"]["contracts"]]


def setup(app: Any) -> dict[str, Any]:
    """Register the directives."""
    from docutils import nodes
    from sphinx.util.docutils import SphinxDirective

    class PackageMap(SphinxDirective):
        """``package-map``: the package's folders and modules, as a text tree."""

        has_content = False

        def run(self) -> list[nodes.Node]:
            for path in PACKAGE.rglob("*.py"):
                self.env.note_dependency(str(path))
            text = package_map()
            return [nodes.literal_block(text, text, language="text")]

    class ImportContracts(SphinxDirective):
        """``import-contracts``: the import-linter contracts CI checks."""

        has_content = False

        def run(self) -> list[nodes.Node]:
            self.env.note_dependency(str(ROOT / "pyproject.toml"))
            items = nodes.bullet_list()
            for name in import_contracts():
                items += nodes.list_item("", nodes.paragraph(text=name))
            return [items]

    app.add_directive("package-map", PackageMap)
    app.add_directive("import-contracts", ImportContracts)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}

"""The repository's scripts and tests on the site, and the pages' mentions linked.

Pages cite files that live beside the package: ``python benchmarks/privacy.py``,
``tests/test_fedepm.py``, ``examples/plugin-fednova/``. Two pieces make every
such mention reachable from the site:

* ``source-docstrings GLOB``: one section per file matching ``GLOB`` (from the
  repository root), titled with its path, holding its module docstring as
  written, so the page cannot drift from the file. Each section's anchor is
  :func:`anchor_of` the path.
* A transform over every page: an inline literal that names such a file
  (``benchmarks/x.py``, ``tests/test_x.py``, ``tests/system/test_x.py``, an
  example folder that has a page under ``docs/examples/``, or the benchmarks'
  README and results) becomes a link to its section or page. Code blocks are
  left as they are.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
#: Where each kind of file is documented: (glob, docname of its page).
PAGES = {
    "benchmarks/*.py": "benchmarks/scripts",
    "tests/test_*.py": "reference/tests",
    "tests/system/test_*.py": "reference/tests",
}
_FILE = re.compile(r"(?<![\w/.-])((?:benchmarks|tests(?:/system)?)/[\w-]+\.py)\b")
_EXAMPLE = re.compile(r"(?<![\w/.-])examples/([\w-]+)/?")
# The benchmarks' README and results are the site's results page.
_RESULTS = re.compile(r"(?<![\w/.-])benchmarks/(README\.md|results/)")
RESULTS_PAGE = "benchmarks/index"


def anchor_of(path: str) -> str:
    """Return the section anchor of a repository file (``benchmarks/x.py``)."""
    return "file-" + re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")


def module_docstring(path: Path) -> str:
    """Return the module docstring of a Python file ('' when it has none)."""
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def documented_files() -> dict[str, str]:
    """Return every documented file (repository path) and its page's docname."""
    found: dict[str, str] = {}
    for pattern, docname in PAGES.items():
        for path in sorted(REPO.glob(pattern)):
            found[path.relative_to(REPO).as_posix()] = docname
    return found


def example_pages(docs: Path = REPO / "docs") -> set[str]:
    """Return the example folders that have a page under ``docs/examples/``."""
    return {p.stem for p in (docs / "examples").glob("*.md") if p.stem != "index"}


def link_target(
    text: str, files: dict[str, str], examples: set[str]
) -> tuple[str, str]:
    """Return (docname, anchor) a literal's text links to, or ('', '')."""
    match = _FILE.search(text)
    if match and match.group(1) in files:
        return files[match.group(1)], anchor_of(match.group(1))
    match = _EXAMPLE.search(text)
    if match and match.group(1) in examples:
        return f"examples/{match.group(1)}", ""
    if _RESULTS.search(text):
        return RESULTS_PAGE, ""
    return "", ""


def setup(app: Any) -> dict[str, Any]:
    """Register the directive and the transform (Sphinx entry point)."""
    from docutils import nodes
    from sphinx.util.docutils import SphinxDirective

    class SourceDocstrings(SphinxDirective):
        """``source-docstrings GLOB``: each matching file's module docstring."""

        required_arguments = 1
        has_content = False

        def run(self) -> list[nodes.Node]:
            out: list[nodes.Node] = []
            pattern = self.arguments[0]
            paths = sorted(REPO.glob(pattern))
            if not paths:
                raise self.error(f"source-docstrings: nothing matches {pattern}")
            for path in paths:
                rel = path.relative_to(REPO).as_posix()
                self.env.note_dependency(str(path))
                section = nodes.section(ids=[anchor_of(rel)])
                section += nodes.title(rel, "", nodes.literal(rel, rel))
                text = module_docstring(path)
                if not text:
                    raise self.error(f"{rel} has no module docstring to show")
                first, _, rest = text.partition("\n")
                section += nodes.paragraph(first, first)
                if rest.strip():
                    block = nodes.literal_block(rest.strip("\n"), rest.strip("\n"))
                    block["language"] = "text"
                    section += block
                out.append(section)
            return out

    def link_mentions(app: Any, doctree: nodes.document, docname: str) -> None:
        if app.builder.format != "html":
            return
        files = documented_files()
        examples = example_pages()
        for literal in list(doctree.findall(nodes.literal)):
            if isinstance(literal.parent, nodes.reference | nodes.title):
                continue
            target, anchor = link_target(literal.astext(), files, examples)
            if not target or (target == docname and not anchor):
                continue
            uri = app.builder.get_relative_uri(docname, target)
            if anchor:
                uri = f"{uri}#{anchor}" if target != docname else f"#{anchor}"
            reference = nodes.reference("", "", internal=True, refuri=uri)
            literal.replace_self(reference)
            reference += literal

    app.add_directive("source-docstrings", SourceDocstrings)
    app.connect("doctree-resolved", link_mentions)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

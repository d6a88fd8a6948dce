"""The class attributes an algorithm declares, as a table built from the code.

``class-attributes`` takes a dotted class path and renders one row per
attribute the class documents with a ``#:`` comment: its name, its default
and the comment (the same text ``help()`` and the API reference show, read
by :func:`flwr_prox_strategies.core.docstrings.attribute_comments`), so the
guide's table cannot drift from the code.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

# reStructuredText literals -> MyST's, which parses the table.
_LITERAL = re.compile(r"``(?P<text>[^`]+)``")


def to_myst(text: str) -> str:
    """Return a comment's text as MyST: references and literals as code."""
    from flwr_prox_strategies.core.docstrings import plain_roles

    text = _LITERAL.sub(lambda m: "`" + m["text"] + "`", plain_roles(text))
    return text.replace("|", "\\|")


def table(path: str) -> list[str]:
    """Return the Markdown table of the class at ``path`` (``module.Class``)."""
    from flwr_prox_strategies.core.docstrings import attribute_comments

    module, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    rows = attribute_comments(cls)
    if not rows:
        raise ValueError(f"class-attributes: {path} documents no attribute")
    lines = ["| attribute | default | what it declares |", "|---|---|---|"]
    for attribute, (default, text) in rows.items():
        shown = default if len(default) <= 40 else "(a sentence)"
        lines.append(f"| `{attribute}` | `{shown}` | {to_myst(text)} |")
    return lines


def setup(app: Any) -> dict[str, Any]:
    """Register the directive."""
    from docutils.statemachine import StringList
    from sphinx.util.docutils import SphinxDirective

    class ClassAttributes(SphinxDirective):
        required_arguments = 1

        def run(self) -> list[Any]:
            from docutils import nodes

            container = nodes.container()
            where = self.get_source_info()[0]
            source = StringList(table(self.arguments[0]), source=where)
            self.state.nested_parse(source, self.content_offset, container)
            return container.children

    app.add_directive("class-attributes", ClassAttributes)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

"""Docstrings of classes that inherit their constructor.

A class that does not define ``__init__`` (``FedAvg``, ``FedAvgClient``, the
client rules) takes its base's parameters. :func:`inherit_parameters` copies
the base's ``Parameters`` (and ``Raises``) sections into the class's docstring,
so ``help()`` and the API reference show them where a user looks, and they
never drift from the base's.
"""

from __future__ import annotations

import inspect
import itertools
import re
import textwrap
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T", bound=type)

# A numpydoc section header: a title line, then a line of dashes as long.
_HEADER = re.compile(r"^(?P<title>[A-Z][A-Za-z ]+)\n-+\n", re.MULTILINE)


def sections(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a docstring into its summary part and its numpydoc sections.

    Parameters
    ----------
    doc : str | None
        A docstring (indented as written, or cleaned).

    Returns
    -------
    tuple[str, dict[str, str]]
        The text before the first section, and section title -> body, in order.
    """
    text = inspect.cleandoc(doc or "")
    matches = list(_HEADER.finditer(text))
    if not matches:
        return text.rstrip(), {}
    found = {}
    for match, following in zip(matches, [*matches[1:], None], strict=True):
        end = following.start() if following is not None else len(text)
        found[match.group("title")] = text[match.end() : end].strip("\n")
    return text[: matches[0].start()].rstrip(), found


def _joined(summary: str, found: dict[str, str]) -> str:
    """Return a docstring of ``summary`` and the sections ``found``, in order."""
    parts = [summary, *(f"{t}\n{'-' * len(t)}\n{b}" for t, b in found.items())]
    return "\n\n".join(parts) + "\n"


def inherit_parameters(base: type) -> Callable[[T], T]:
    """Return a class decorator: ``base``'s ``Parameters`` and ``Raises`` sections.

    For a class that inherits ``base``'s constructor: the sections it does not
    write itself are copied from ``base``'s docstring, placed before its own
    sections (``Notes``, ``Examples``, ...).
    """

    def decorate(cls: T) -> T:
        summary, own = sections(cls.__doc__)
        _, inherited = sections(base.__doc__)
        first: dict[str, str] = {
            title: inherited[title]
            for title in ("Parameters", "Raises")
            if title in inherited and title not in own
        }
        cls.__doc__ = _joined(summary, {**first, **own})
        return cls

    return decorate


def _entries(body: str) -> dict[str, str]:
    """Split a ``Parameters`` section into its entries, by the names they start with."""
    found: dict[str, str] = {}
    for line in body.splitlines():
        if line and not line[0].isspace():
            name = line.split(" :", 1)[0]
            found[name] = line
        elif found:
            found[name] += "\n" + line
    return found


def with_parameters_of(source: Callable[..., object], after: str) -> Callable[[T], T]:
    """Return a class decorator: ``source``'s ``Parameters`` entries after ``after``.

    For settings a class passes on to the function ``source``: they are
    documented once, in ``source``'s docstring, and read in the class's (after
    its entry ``after``) where a user looks. The entries the class documents
    itself, and ``source``'s first (positional) parameter, are not inserted.
    """

    def decorate(cls: T) -> T:
        summary, own = sections(cls.__doc__)
        mine = _entries(own["Parameters"])
        theirs = list(_entries(sections(source.__doc__)[1]["Parameters"]).items())
        merged: dict[str, str] = {}
        for name, entry in mine.items():
            merged[name] = entry
            if name == after:
                merged.update((n, e) for n, e in theirs[1:] if n not in mine)
        own["Parameters"] = "\n".join(merged.values())
        cls.__doc__ = _joined(summary, own)
        return cls

    return decorate


def attribute_comments(cls: type) -> dict[str, tuple[str, str]]:
    """Return the class attributes a class documents with ``#:`` comments.

    The documentation of an algorithm's declarations lives once, in the
    ``#:`` comment above each (what Sphinx's autodoc reads);
    :func:`with_class_attributes` puts it in ``help()`` and the
    documentation's tables are built from it.

    Parameters
    ----------
    cls : type
        A class defined in a source file.

    Returns
    -------
    dict[str, tuple[str, str]]
        Attribute name -> (its default, as written; its comment's text), in
        source order; empty when the source cannot be read.
    """
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    found: dict[str, tuple[str, str]] = {}
    comment: list[str] = []
    body = textwrap.dedent("".join(lines)).splitlines()
    for index, line in enumerate(body):
        stripped = line.strip()
        if stripped.startswith("#:"):
            comment.append(stripped[2:].strip())
            continue
        match = _ATTRIBUTE.match(line)
        if comment and match:
            default = match.group("default").strip()
            if default.endswith("("):  # a value over several lines
                rest = itertools.takewhile(
                    lambda text: not text.startswith("    )"), body[index + 1 :]
                )
                default += " ".join(part.strip() for part in rest) + ")"
            found[match.group("name")] = (default, " ".join(comment))
        comment = []
    return found


# A cross-reference role (``:meth:`~a.b.name```, ``:attr:`Text <target>```).
_ROLE = re.compile(r":(?!math:)[a-z:]+:`~?(?P<target>[^`<]+?)(?:\s*<[^>]+>)?`")


def plain_roles(text: str) -> str:
    """Return ``text`` with its cross-references as literals.

    ``:meth:`~a.b.name``` becomes ````name````, ``:attr:`Text <target>```
    becomes ````Text````: the text reads the same wherever it is placed
    (where a reference would not resolve).
    """

    def literal(match: re.Match[str]) -> str:
        target = match.group("target").strip()
        if match.group(0).split("`", 1)[1].startswith("~"):
            target = target.rsplit(".", 1)[-1]
        return f"``{target}``"

    return _ROLE.sub(literal, text)


def _short(default: str) -> str:
    """Return a default as written, cut to a table cell's length."""
    return default if len(default) <= 40 else default[:36].rstrip() + " ..."


# A class-level assignment: ``    name: type = default`` or ``    name = default``.
_ATTRIBUTE = re.compile(
    r"^    (?P<name>[a-z_][a-z0-9_]*)(?:\s*:\s*[^=]+)?\s*=\s*(?P<default>.+)$"
)


def with_class_attributes(*sources: type) -> Callable[[T], T]:
    """Return a class decorator listing the ``#:``-documented attributes of ``sources``.

    So ``help()`` lists what an algorithm declares, with the text the API
    reference shows, as a definition list before the class's sections.
    ``sources``: the classes whose attributes to list (:func:`attribute_comments`);
    none: the decorated class's own.
    """

    def decorate(cls: T) -> T:
        entries = {}
        for source in sources or (cls,):
            entries.update(attribute_comments(source))
        if not entries:
            return cls
        items = "\n".join(
            f"``{name}`` (default ``{_short(default)}``)\n"
            + textwrap.indent(textwrap.fill(plain_roles(text), 72), "    ")
            for name, (default, text) in entries.items()
        )
        # Before the numpydoc sections, which would take it in otherwise.
        summary, own = sections(cls.__doc__)
        listed = f"The class attributes a subclass declares:\n\n{items}"
        cls.__doc__ = _joined(f"{summary}\n\n{listed}", own)
        return cls

    return decorate

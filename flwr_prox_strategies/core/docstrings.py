"""Docstrings of classes that inherit their constructor.

A class that does not define ``__init__`` (``FedAvg``, ``FedAvgClient``, the
client rules) takes its base's parameters. :func:`inherit_parameters` copies
the base's ``Parameters`` (and ``Raises``) sections into the class's docstring,
so ``help()`` and the API reference show them where a user looks, and they
never drift from the base's.
"""

from __future__ import annotations

import inspect
import re
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


def inherit_parameters(base: type) -> Callable[[T], T]:
    """Give a class the ``Parameters`` and ``Raises`` sections of ``base``.

    For a class that inherits ``base``'s constructor: the sections it does not
    write itself are copied from ``base``'s docstring, placed before its own
    sections (``Notes``, ``Examples``, ...).

    Parameters
    ----------
    base : type
        The class whose constructor (and docstring) the decorated class uses.

    Returns
    -------
    Callable[[type], type]
        The class decorator.
    """

    def decorate(cls: T) -> T:
        summary, own = sections(cls.__doc__)
        _, inherited = sections(base.__doc__)
        first: dict[str, str] = {
            title: inherited[title]
            for title in ("Parameters", "Raises")
            if title in inherited and title not in own
        }
        merged: dict[str, str] = {**first, **own}
        parts = [summary]
        for title, body in merged.items():
            parts.append(f"{title}\n{'-' * len(title)}\n{body}")
        cls.__doc__ = "\n\n".join(parts) + "\n"
        return cls

    return decorate

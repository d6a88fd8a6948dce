"""Hyper-parameter checks: one place, one wording, the parameter always named.

Every constructor and partition function of the pack checks its arguments with
these, so a bad value fails where it is given with ``<name> must be ...``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# The sections every check's docstring shares, filled in by @_check_doc.
_CHECK_DOC = """

Parameters
----------
name : str
    The parameter's name, as the user wrote it (named in the error).
value : {kind}
    The value given{given}.{extra}

Returns
-------
{kind}
    ``value``{converted}.

Raises
------
ValueError
    ``"<name> must be {message}, got <value>"``{also}.
"""

_F = TypeVar("_F", bound=Callable[..., Any])


def _check_doc(
    kind: str, message: str, also: str = "", **parts: str
) -> Callable[[_F], _F]:
    """Append the shared sections to a check's docstring (its summary line)."""
    parts = {"given": "", "extra": "", "converted": f" as a {kind}", **parts}
    sections = _CHECK_DOC.format(kind=kind, message=message, also=also, **parts)

    def decorate(check: _F) -> _F:
        check.__doc__ = (check.__doc__ or "") + sections
        return check

    return decorate


_FINITE = " (also for a bool, NaN, inf or a non-number)"


@_check_doc("float", "a number in [0, 1]", " (also for a bool or a non-number)")
def check_fraction(name: str, value: float) -> float:
    """Raise ``ValueError`` naming ``name`` unless ``0 <= value <= 1``."""
    if not _real(value) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


@_check_doc("float", "in (0, 1)", " (also for a bool or a non-number)")
def check_probability(name: str, value: float) -> float:
    """Raise ``ValueError`` naming ``name`` unless ``0 < value < 1``."""
    if not _real(value) or not 0.0 < float(value) < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return float(value)


@_check_doc("float", "a finite number >= 0", _FINITE)
def check_non_negative(name: str, value: float) -> float:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is finite and >= 0."""
    if not _real(value) or not math.isfinite(float(value)) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


@_check_doc("float", "a finite number > 0", _FINITE)
def check_positive(name: str, value: float) -> float:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is finite and > 0."""
    if not _real(value) or not math.isfinite(float(value)) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


@_check_doc(
    "int",
    "an integer >= <minimum>",
    given=" (any integral type; not a bool or a float)",
    converted=" as an int",
    extra="\nminimum : int\n    The smallest value allowed.",
)
def check_int(name: str, value: int, minimum: int) -> int:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int >= minimum."""
    integer = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not integer or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


@_check_doc(
    "str",
    "one of '<a>', '<b>'",
    extra="\nchoices : Sequence[str]\n    The values allowed, named in the error.",
    converted="",
)
def check_choice(name: str, value: str, choices: Sequence[str]) -> str:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {valid}, got {value!r}")
    return value


def check_unset(
    owner: str, given: Mapping[str, Any], names: Sequence[str], why: str
) -> None:
    """Raise ``ValueError`` if ``given`` holds any of ``names``, set by ``owner``.

    For keywords of a base class that a subclass derives itself: ``why`` says
    from what, in the error.
    """
    for name in names:
        if name in given:
            raise ValueError(
                f"{owner} sets {name} itself ({why}); got {name}={given[name]!r}"
            )


__all__ = [
    "check_choice",
    "check_fraction",
    "check_int",
    "check_non_negative",
    "check_positive",
    "check_unset",
]

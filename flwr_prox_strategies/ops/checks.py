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


_NUMBER_CHECK_DOC = """

Parameters
----------
name : str
    The parameter's name, as the user wrote it (named in the error).
value : float
    The value given.

Returns
-------
float
    ``value`` as a float.

Raises
------
ValueError
    ``"<name> must be {message}, got <value>"`` (also for {also}).
"""

_F = TypeVar("_F", bound=Callable[..., float])


def _number_check(message: str, also: str) -> Callable[[_F], _F]:
    """Append the sections the three number checks share to one's docstring."""

    def decorate(check: _F) -> _F:
        sections = _NUMBER_CHECK_DOC.format(message=message, also=also)
        check.__doc__ = (check.__doc__ or "") + sections
        return check

    return decorate


@_number_check("a number in [0, 1]", "a bool or a non-number")
def check_fraction(name: str, value: float) -> float:
    """Raise ``ValueError`` naming ``name`` unless ``0 <= value <= 1``."""
    if not _real(value) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


_FINITE = "a bool, NaN, inf or a non-number"


@_number_check("a finite number >= 0", _FINITE)
def check_non_negative(name: str, value: float) -> float:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is finite and >= 0."""
    if not _real(value) or not math.isfinite(float(value)) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


@_number_check("a finite number > 0", _FINITE)
def check_positive(name: str, value: float) -> float:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is finite and > 0."""
    if not _real(value) or not math.isfinite(float(value)) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_int(name: str, value: int, minimum: int) -> int:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int >= minimum.

    Parameters
    ----------
    name : str
        The parameter's name, as the user wrote it (named in the error).
    value : int
        The value given (any integral type; not a bool or a float).
    minimum : int
        The smallest value allowed.

    Returns
    -------
    int
        ``value`` as an int.

    Raises
    ------
    ValueError
        ``"<name> must be an integer >= <minimum>, got <value>"``.
    """
    integer = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not integer or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_choice(name: str, value: str, choices: Sequence[str]) -> str:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is one of ``choices``.

    Parameters
    ----------
    name : str
        The parameter's name, as the user wrote it (named in the error).
    value : str
        The value given.
    choices : Sequence[str]
        The values allowed, named in the error.

    Returns
    -------
    str
        ``value``.

    Raises
    ------
    ValueError
        ``"<name> must be one of '<a>', '<b>', got <value>"``.
    """
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

"""The server state a rule reads: read-only, and only what it declared.

A server rule may run twice in a round (a reply found non-finite is dropped and
the rule re-run) and its new state is committed only if the round is
aggregated, so it must return new values instead of changing the ones it is
given. :func:`freeze_state` makes that impossible to get wrong: the arrays it
hands over are read-only views, the mappings refuse assignment, and asking for a
field that ``state_fields`` does not declare names ``state_fields``. An update
that returns a value it was given unchanged is committed as the original
(:meth:`FrozenState.thaw`), so nothing read-only outlives the call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from .fields import RoundUpdate

#: What the errors tell a rule that wrote into what it was given.
RETURN_NEW = (
    "return new values in RoundUpdate.state instead (x = x * 0.9, not "
    "x *= 0.9; {**old, 'w': w}, not old['w'] = w)"
)


class StateMutationError(TypeError):
    """A server rule tried to change the state (or a reply) it was given."""


class UndeclaredStateError(KeyError):
    """A server rule read a state field its strategy does not declare."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class _ReadOnlyDict(Mapping[str, Any]):
    """A mapping inside the state: readable, never assignable."""

    def __init__(self, values: dict[Any, Any], owner: str) -> None:
        self._values = values
        self._owner = owner

    def __getitem__(self, key: Any) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __setitem__(self, key: Any, value: Any) -> None:
        raise StateMutationError(
            f"{self._owner}.server_update assigned [{key!r}] in a mapping of the "
            f"state it was given: {RETURN_NEW}"
        )

    def __delitem__(self, key: Any) -> None:
        self.__setitem__(key, None)

    def __repr__(self) -> str:
        return f"ReadOnly({self._values!r})"


class FrozenState(_ReadOnlyDict):
    """The state handed to ``server_update``: declared fields, read-only values.

    Parameters
    ----------
    values : dict[str, Any]
        Field name -> current value.
    owner : str
        The strategy's class name, for the errors.
    fields : tuple[str, ...]
        The declared ``state_fields``, for the errors.

    Raises
    ------
    TypeError
        If a value holds a torch tensor (it cannot be made read-only: hold
        numpy arrays).
    """

    def __init__(
        self, values: Mapping[str, Any], owner: str, fields: tuple[str, ...]
    ) -> None:
        self._originals: dict[int, Any] = {}
        self._keep: list[Any] = []  # keeps the ids above unique while alive
        self._fields = fields
        self._owner = owner
        super().__init__(
            {name: self._freeze(name, value) for name, value in values.items()},
            owner,
        )

    def _freeze(self, name: str, value: Any) -> Any:
        if isinstance(value, np.ndarray):
            frozen: Any = value.view()
            frozen.flags.writeable = False
        elif isinstance(value, Mapping):
            frozen = _ReadOnlyDict(
                {k: self._freeze(name, v) for k, v in value.items()}, self._owner
            )
        elif isinstance(value, list):
            frozen = tuple(self._freeze(name, v) for v in value)
        elif type(value).__module__.split(".")[0] == "torch":
            raise TypeError(
                f"{self._owner}.{name} holds a {type(value).__name__}: server "
                "state holds numpy arrays (handed to server_update read-only), "
                "not torch tensors"
            )
        else:
            return value
        self._originals[id(frozen)] = value
        self._keep.append(frozen)
        return frozen

    def __getitem__(self, key: Any) -> Any:
        try:
            return self._values[key]
        except KeyError:
            raise UndeclaredStateError(
                f"{self._owner}.server_update read state[{key!r}], which is not "
                f"in {self._owner}.state_fields {self._fields}: declare it there "
                "(it is then checkpointed, restored and handed to every round)"
            ) from None

    def __setitem__(self, key: Any, value: Any) -> None:
        raise StateMutationError(
            f"{self._owner}.server_update assigned state[{key!r}]: {RETURN_NEW}"
        )

    def thaw(self, value: Any) -> Any:
        """Return ``value`` with each frozen piece of this state back as its original.

        Parameters
        ----------
        value : Any
            A value a rule returned (a new array, or one it was given).

        Returns
        -------
        Any
            The value to commit: nothing in it is read-only or a view made here.
        """
        original = self._originals.get(id(value), _MISSING)
        if original is not _MISSING:
            return original
        if isinstance(value, dict):
            return {k: self.thaw(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.thaw(v) for v in value]
        if isinstance(value, np.ndarray) and not value.flags.writeable:
            # A view of a frozen array (a slice of it): commit a copy.
            return np.array(value)
        return value


_MISSING = object()


def mutation_error(owner: str, err: ValueError) -> StateMutationError | None:
    """Return the error to raise for numpy's read-only ``ValueError``, else None."""
    if "read-only" not in str(err):
        return None
    return StateMutationError(
        f"{owner}.server_update wrote into an array it was given (the state and "
        f"the replies' arrays are read-only): {RETURN_NEW}. numpy said: {err}"
    )


def call_rule(
    rule: Callable[[FrozenState], RoundUpdate],
    state: Mapping[str, Any],
    owner: str,
    fields: tuple[str, ...],
) -> RoundUpdate:
    """Call a server rule on ``state`` made read-only; return its update, thawed.

    A write into an array it was given becomes a :class:`StateMutationError`
    naming the fix; the state it returns is handed back writable.
    """
    frozen = FrozenState(state, owner, fields)
    try:
        update = rule(frozen)
    except ValueError as err:  # numpy refusing a read-only array
        mutation = mutation_error(owner, err)
        if mutation is None:
            raise
        raise mutation from err
    update.state = {k: frozen.thaw(v) for k, v in update.state.items()}
    return update

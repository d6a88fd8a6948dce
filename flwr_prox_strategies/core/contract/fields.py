"""Declared server state: what a strategy saves, checks on resume, and shows.

A strategy declares three tuples of attribute names instead of writing
``state_dict``/``load_state_dict``/``__repr__``/``summary`` by hand:

* ``state_fields``: the algorithm's state (FedDyn's drift sum). Saved deep-copied
  under the kebab-case name (``drift_sum`` -> ``drift-sum``), restored as saved,
  passed to the server rule and replaced by what it returns;
* ``resume_settings``: constructor settings a checkpoint must have been made
  with (FedEPM's ``k0``), saved and compared on restore;
* ``settings``: what ``repr()`` and the run's summary show.

The base strategy also uses :class:`RoundUpdate`, what a server rule returns.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord


@dataclass
class RoundUpdate:
    """What a server rule returns for one round.

    What :meth:`~flwr_prox_strategies.extend.ValidatedFedAvg.server_update`
    returns: ``RoundUpdate(dict_to_record(model), {"drift_sum": drift},
    {"drift-norm": norm})``.

    Parameters
    ----------
    arrays : ArrayRecord
        The new global model.
    state : dict[str, Any]
        New values of declared state fields (names of
        :attr:`~flwr_prox_strategies.extend.ValidatedFedAvg.state_fields`),
        committed only if the round is aggregated (a round whose model is kept
        never touches the state). Default: empty.
    metrics : dict[str, Any]
        Extra per-round metrics (reported with the aggregated round only).
        Default: empty.
    """

    arrays: ArrayRecord
    state: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


def field_key(name: str) -> str:
    """Return the checkpoint key of an attribute (``drift_sum`` -> ``drift-sum``)."""
    return name.replace("_", "-")


def save_fields(owner: Any, names: Iterable[str]) -> dict[str, Any]:
    """Return the checkpoint entries of ``names`` (kebab-case keys, deep copies)."""
    return {field_key(name): copy.deepcopy(getattr(owner, name)) for name in names}


def load_fields(owner: Any, names: Iterable[str], state: Mapping[str, Any]) -> None:
    """Restore the attributes ``names`` from a checkpoint made by :func:`save_fields`.

    A key missing from ``state`` is an error naming it: a checkpoint of another
    version of the strategy must not resume with a field silently at its default.
    """
    missing = [field_key(name) for name in names if field_key(name) not in state]
    if missing:
        raise ValueError(
            f"checkpoint for {type(owner).__name__} has no {missing}: it was made "
            "by another version of the strategy"
        )
    for name in names:
        setattr(owner, name, copy.deepcopy(state[field_key(name)]))


def check_settings(owner: Any, names: Iterable[str], state: Mapping[str, Any]) -> None:
    """Refuse a checkpoint made with other values of the settings ``names``."""
    for name in names:
        mine, saved = getattr(owner, name), state.get(field_key(name))
        if saved != mine:
            raise ValueError(
                f"checkpoint was made with {name}={saved!r}, the strategy has "
                f"{mine!r}: the run would not resume identically"
            )


def settings_text(owner: Any, names: Iterable[str]) -> str:
    """Return ``name=value, ...`` of the settings, for ``repr()``."""
    return ", ".join(f"{name}={getattr(owner, name)!r}" for name in names)

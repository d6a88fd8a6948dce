"""Algorithms that installed packages register through an entry point.

A plugin is a distribution with an entry point of the group
:data:`ENTRY_POINT_GROUP` in its metadata; the entry point's name is the conf
name (``strategy=<name>``) and its object an
:class:`~flwr_prox_strategies.extend.Algorithm` whose ``conf`` names the
package holding ``strategy/<name>.yaml``::

    [project.entry-points."flwr_prox_strategies.algorithms"]
    fednova = "flwr_fednova:FEDNOVA"

A broken plugin does not break the pack: it is logged (WARNING) when the
plugins are read and left out, and :func:`registered_algorithm` raises
:class:`PluginError`, naming its distribution and entry point, when it is
asked for.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.resources
import re
from dataclasses import dataclass
from logging import WARNING
from typing import TYPE_CHECKING

from flwr.common.logger import log

if TYPE_CHECKING:
    from . import Algorithm

#: The entry-point group through which an installed package registers an
#: algorithm: the entry point's name is the conf name (``strategy=<name>``), its
#: object an ``Algorithm`` whose ``conf`` names the package holding
#: ``strategy/<name>.yaml``.
ENTRY_POINT_GROUP = "flwr_prox_strategies.algorithms"

# A conf option: a file name that Hydra and every file system take as it is.
# No leading "_": "_base" is the strategies' shared folder, not an option.
_CONF_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]*")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class PluginError(ValueError):
    """An installed package's entry point that cannot register an algorithm.

    The message names the distribution, the entry point and what is wrong
    with it. The pack's own algorithms and the other plugins keep working:
    the error is logged when the plugins are read and raised when the broken
    algorithm is asked for (:func:`registered_algorithm`).
    """


@dataclass(frozen=True)
class _Registry:
    """The plugins found in one reading of the installed distributions."""

    algorithms: dict[str, Algorithm]
    errors: dict[str, PluginError]


def _describe(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = getattr(entry_point, "dist", None)
    name = getattr(dist, "name", None) or "an unknown distribution"
    return (
        f"the entry point {entry_point.name} = {entry_point.value!r} of {name} "
        f"(group {ENTRY_POINT_GROUP})"
    )


def _has_strategy_file(conf: str, name: str) -> bool:
    try:
        root = importlib.resources.files(conf)
    except (ImportError, TypeError, ValueError):
        return False
    return root.joinpath("strategy", f"{name}.yaml").is_file()


def _check(entry_point: importlib.metadata.EntryPoint, obj: object) -> Algorithm:
    from . import Algorithm

    where = _describe(entry_point)
    name = entry_point.name
    if not isinstance(obj, Algorithm):
        raise PluginError(
            f"{where} is a {type(obj).__name__}, not a "
            "flwr_prox_strategies.extend.Algorithm: point it at "
            "Algorithm(strategy, client, rule, conf=...)."
        )
    roles = {"strategy": obj.strategy, "client": obj.client, "rule": obj.rule}
    roles["deployed"] = obj.deployed
    for role, cls in roles.items():
        if cls is None and role != "strategy":
            continue
        if not isinstance(cls, type):
            raise PluginError(f"{where}: its {role} is {cls!r}, not a class.")
    if obj.conf is None or not _DOTTED.fullmatch(obj.conf):
        raise PluginError(
            f"{where}: its Algorithm's conf is {obj.conf!r}; it must name the "
            f"package holding strategy/{name}.yaml (conf='my_plugin.conf')."
        )
    if not _has_strategy_file(obj.conf, name):
        raise PluginError(
            f"{where}: the package {obj.conf!r} (its Algorithm's conf) cannot be "
            f"imported or holds no strategy/{name}.yaml. Ship that file as "
            "package data, with an __init__.py beside strategy/."
        )
    return obj


def _read() -> _Registry:
    from . import ALGORITHMS

    found: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry_point.name, []).append(entry_point)
    algorithms: dict[str, Algorithm] = {}
    errors: dict[str, PluginError] = {}
    for name, entry_points in sorted(found.items()):
        where = _describe(entry_points[0])
        # Checked before loading: a refused name imports nothing of the plugin.
        if not _CONF_NAME.fullmatch(name):
            errors[name] = PluginError(
                f"{where}: {name!r} is not a valid conf name (letters, digits, "
                "'_' and '-', not starting with '_' or '-'): strategy=<name> "
                "could not select it."
            )
        elif name in ALGORITHMS:
            errors[name] = PluginError(
                f"{where}: {name!r} is one of the pack's own algorithms, which "
                "keeps the name. Register the plugin under another name."
            )
        elif len(entry_points) > 1:
            errors[name] = PluginError(
                f"two installed packages register strategy={name}: "
                + " and ".join(_describe(e) for e in entry_points)
                + ". Uninstall one, or register one under another name."
            )
        else:
            try:
                obj = entry_points[0].load()
            except Exception as err:  # whatever the plugin's own import raises
                errors[name] = PluginError(f"{where} cannot be loaded: {err!r}")
                continue
            try:
                algorithms[name] = _check(entry_points[0], obj)
            except PluginError as err:
                errors[name] = err
    # Hydra takes the first strategy/<name>.yaml along its search path: another
    # plugin's package holding one could replace this plugin's silently.
    for name, algorithm in algorithms.items():
        others = sorted(
            {
                str(other.conf)
                for other_name, other in algorithms.items()
                if other_name != name
                and other.conf != algorithm.conf
                and _has_strategy_file(str(other.conf), name)
            }
        )
        if others:
            errors[name] = PluginError(
                f"{_describe(found[name][0])}: strategy/{name}.yaml is also in "
                f"{', '.join(others)} (another plugin's conf), which Hydra could "
                "load instead. Remove it from there."
            )
    for name, error in errors.items():
        algorithms.pop(name, None)
        log(
            WARNING,
            "Plugin algorithm %r is unavailable (the pack's own algorithms and "
            "the other plugins work): %s",
            name,
            error,
        )
    return _Registry(algorithms, errors)


@functools.cache
def _registry() -> _Registry:
    return _read()


def registered_algorithms(*, refresh: bool = False) -> dict[str, Algorithm]:
    """Return the pack's algorithms and the installed plugins', by conf name.

    The entry points of :data:`ENTRY_POINT_GROUP` are read and loaded once per
    process, at the first call (not when the pack is imported, so a plugin may
    import the pack). That call logs (WARNING) every plugin that cannot be
    registered, and leaves it out.

    Parameters
    ----------
    refresh : bool (default: False)
        Read the installed entry points again (after installing a plugin in a
        running process, or in tests).

    Returns
    -------
    dict[str, Algorithm]
        A new dict: the pack's ``ALGORITHMS``, then the plugins' in name order.
    """
    from . import ALGORITHMS

    if refresh:
        _registry.cache_clear()
    return {**ALGORITHMS, **_registry().algorithms}


def plugin_sources() -> dict[str, str]:
    """Return each installed plugin's conf name and where it comes from.

    Returns
    -------
    dict[str, str]
        Conf name -> ``"<distribution> <version>"`` for the plugins that
        registered, ``"<distribution> <version>, unavailable"`` for those that
        could not (the log says why).
    """
    sources = {}
    errors = _registry().errors
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(entry_point, "dist", None)
        name = getattr(dist, "name", None) or "an unknown distribution"
        version = getattr(dist, "version", None) or "?"
        broken = ", unavailable" if entry_point.name in errors else ""
        sources[entry_point.name] = f"{name} {version}{broken}"
    return sources


def registered_algorithm(name: str) -> Algorithm:
    """Return the algorithm registered under the conf name ``name``.

    Parameters
    ----------
    name : str
        A conf name (``strategy=<name>``): the pack's own or a plugin's.

    Returns
    -------
    Algorithm
        The pack's or the plugin's entry.

    Raises
    ------
    PluginError
        When an installed plugin registers ``name`` but cannot be used, naming
        its distribution, its entry point and the reason.
    KeyError
        When nothing registers ``name``.
    """
    algorithms = registered_algorithms()
    if name in algorithms:
        return algorithms[name]
    error = _registry().errors.get(name)
    if error is not None:
        raise PluginError(str(error)) from error
    raise KeyError(name)

"""Compose the ``conf/`` tree, and what a run's configuration may instantiate.

Every Flower app of the pack (and the sweep launcher) composes its configuration
here (:mod:`.build` then instantiates it). A run's ``overrides`` come from whoever
submits it and are composed on every host, so a composition may only select from
the pack's tree: every ``_target_`` must be on the allow-list (the pack's own
names, the installed plugins' (:func:`plugin_targets`), and what the operator adds
with :data:`ALLOWED_TARGETS_ENV` or :func:`allow_targets`); overrides may not
touch ``hydra.*``, leave a group's options or call a resolver. Plugins' ``conf``
packages join the search path after ``conf/`` (:class:`PluginSearchPath`).
Anything else raises :class:`ConfigNotAllowedError` before anything is imported
or instantiated. The rules and their reasons: the documentation's deployment
guide ("What a run's overrides may do") and configuration reference.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.initialize import get_gh_backup, restore_gh_from_backup
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import DictConfig, ListConfig, OmegaConf

from ..algorithms import (
    ALGORITHMS,
    Algorithm,
    PluginError,
    registered_algorithm,
    registered_algorithms,
)
from ..algorithms.plugins import ENTRY_POINT_GROUP, plugin_sources
from . import RUN_NUM_ROUNDS, RUN_OVERRIDES, RUN_SEED

_PACKAGE = Path(__file__).resolve().parent.parent


def find_conf_dir() -> Path:
    """Return the Hydra tree: package data when installed, else the checkout's.

    A wheel ships the tree as ``flwr_prox_strategies/conf``; a checkout, an
    editable install and the FAB that ``flwr run .`` ships hold it at the top
    level, beside ``flwr_prox_strategies/``.

    Raises
    ------
    FileNotFoundError
        When neither holds ``config.yaml``.
    """
    candidates = (_PACKAGE / "conf", _PACKAGE.parent / "conf")
    for candidate in candidates:
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(
        "the Hydra tree (conf/config.yaml) is missing: looked in "
        + ", ".join(str(c) for c in candidates)
    )


CONF_DIR = find_conf_dir()


def _plugins() -> dict[str, Algorithm]:
    """Return the installed plugins' algorithms (the pack's own left out)."""
    return {
        name: algorithm
        for name, algorithm in registered_algorithms().items()
        if name not in ALGORITHMS and algorithm.conf is not None
    }


def plugin_conf_packages() -> list[str]:
    """Return the installed plugins' conf packages, in the search path's order."""
    packages: list[str] = []
    for algorithm in _plugins().values():
        if algorithm.conf not in packages:
            packages.append(str(algorithm.conf))
    return packages


class PluginSearchPath(SearchPathPlugin):
    """Hydra search-path plugin: the installed plugins' conf packages.

    Appended after ``conf/`` (first match wins in Hydra, so a plugin adds
    options and replaces none of the pack's files), and only to a search path
    whose primary tree is the pack's ``conf/``: another Hydra app in the same
    process is left as it is. Registered with Hydra when this module is
    imported, so ``initialize_config_dir`` + ``compose`` and ``@hydra.main``
    (the command line, sweeps) both see it.
    """

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        """Append ``pkg://<conf>`` for every plugin when the tree is the pack's."""
        conf = (str(CONF_DIR), f"file://{CONF_DIR}")
        ours = any(
            element.provider == "main" and element.path in conf
            for element in search_path.get_path()
        )
        if not ours:
            return
        for package in plugin_conf_packages():
            search_path.append("flwr-prox-strategies-plugin", f"pkg://{package}")


def _register_search_path() -> None:
    # Hydra keeps its plugins in a process-wide singleton; registering twice is
    # a no-op. A hydra_plugins namespace package would do the same for every
    # Hydra app, but the wheel and the editable install ship only this package.
    Plugins.instance().register(PluginSearchPath)


_register_search_path()


#: Environment variable that adds to the ``_target_`` allow-list of this process:
#: entries separated by commas or spaces; ``pkg.module.Name`` allows exactly that
#: name, ``pkg.`` (trailing dot) everything under ``pkg``, ``*`` everything.
#: Set it where the config is instantiated: the SuperLink (ServerApp) host and
#: every SuperNode (for ``flwr run`` simulations: the shell that starts the
#: managed SuperLink).
ALLOWED_TARGETS_ENV = "FLWR_PROX_ALLOWED_TARGETS"
PACK_PREFIX = "flwr_prox_strategies."
# The pack's glue (sweep launcher, app writer, results): it starts processes and
# writes files, and no config needs it. Allowed only when added explicitly.
_GLUE_PREFIXES = ("flwr_prox_strategies.experiment.",)
_added_targets: list[str] = []
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
# A resolver call inside an interpolation: ${oc.env:X}, ${now:...}, ${a.${oc.env:X}}.
_RESOLVER = re.compile(r"\$\{\s*[A-Za-z_][\w.\-]*\s*:")
_GROUP_OPTION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]*")


class ConfigNotAllowedError(ValueError):
    """A composition that a run's ``overrides`` may not ask for (see the module doc)."""


def allow_targets(*entries: str) -> None:
    """Add entries to this process's ``_target_`` allow-list.

    For your own Flower app (call it where the app module is imported, on the
    server and in the ClientApp) or scripts; operators of the pack's app use
    :data:`ALLOWED_TARGETS_ENV`. ``"mypkg.models.Net"`` allows exactly that name,
    ``"mypkg."`` everything under ``mypkg``, ``"*"`` everything.
    """
    for entry in entries:
        entry = entry.strip()
        if entry != "*" and not _DOTTED.fullmatch(entry.rstrip(".")):
            raise ValueError(
                f"allow-list entry {entry!r} is not a dotted name (pkg.module.Name), "
                "a prefix ending in '.' (pkg.), or '*'"
            )
        _added_targets.append(entry)


def allowed_targets() -> tuple[str, ...]:
    """Return what this process adds to the pack's own targets (env, then calls)."""
    from_env = re.split(r"[,\s]+", os.environ.get(ALLOWED_TARGETS_ENV, ""))
    return tuple(e for e in (*from_env, *_added_targets) if e)


def _matches(name: str, entries: Sequence[str], *, exact_only: bool = False) -> bool:
    for entry in entries:
        if entry == "*" or name == entry:
            return True
        if not exact_only and entry.endswith(".") and name.startswith(entry):
            return True
    return False


def _pack_default(name: str) -> bool:
    return name.startswith(PACK_PREFIX) and not name.startswith(_GLUE_PREFIXES)


def plugin_targets() -> tuple[str, ...]:
    """Return the allow-list entries the installed plugins add.

    For each plugin: its own top-level package (the one holding its ``conf``,
    ``"flwr_fednova."``), and the exact names of its strategy, client, rule and
    deployed classes that live elsewhere (a plugin reusing a class of another
    package opens that class, not the package). Nothing of the pack's own is
    added: its classes are allowed anyway, its glue stays off the list.
    """
    entries: list[str] = []
    for algorithm in _plugins().values():
        own = str(algorithm.conf).split(".")[0] + "."
        if own != PACK_PREFIX:
            entries.append(own)
        classes = (
            algorithm.strategy,
            algorithm.client,
            algorithm.rule,
            algorithm.deployed,
        )
        for cls in classes:
            if cls is None:
                continue
            name = f"{cls.__module__}.{cls.__qualname__}"
            if not name.startswith((own, PACK_PREFIX)):
                entries.append(name)
    return tuple(dict.fromkeys(entries))


def _how_to_allow(target: str) -> str:
    return (
        "A run's overrides may only instantiate the pack's own classes and "
        f"functions ({PACK_PREFIX}*, but not its glue {_GLUE_PREFIXES[0]}*) "
        "and what the operator allows: to allow "
        f"it, set {ALLOWED_TARGETS_ENV}='{target}' (an exact name, or a prefix "
        "ending in '.'; comma-separated) in the environment of every process "
        "that builds the config (the SuperLink/ServerApp host and every "
        "SuperNode; in a simulation, the shell that starts the SuperLink), or "
        f"call flwr_prox_strategies.experiment.config.allow_targets('{target}') "
        "in your own app."
    )


def check_target(
    target: object, where: str = "_target_", *, locate: bool = True
) -> None:
    """Refuse a ``_target_`` that is not on the allow-list (nothing is imported first).

    The dotted name must be allowed, and, unless it is listed exactly, so must
    the module and name the object really has once located (so that
    ``flwr_prox_strategies.task.datasets.os.system`` is not ``os.system``
    in disguise). Names with a ``_private`` part must be listed exactly.
    ``locate=False`` checks the name only and imports nothing: the object is
    located when :func:`instantiate` builds it.

    Raises
    ------
    ConfigNotAllowedError
        Naming ``where``, the target and how to allow it.
    """
    if not isinstance(target, str) or not _DOTTED.fullmatch(target):
        raise ConfigNotAllowedError(
            f"{where}={target!r} is not a dotted name of a class or function."
        )
    extra = (*allowed_targets(), *plugin_targets())
    if _matches(target, extra, exact_only=True):
        return  # listed exactly: the operator asked for this very name
    private = any(part.startswith("_") for part in target.split("."))
    if private or not (_pack_default(target) or _matches(target, extra)):
        raise ConfigNotAllowedError(
            f"{where}={target!r} is not allowed. {_how_to_allow(target)}"
        )
    if not locate:
        return
    try:
        obj = hydra.utils.get_object(target)
    except Exception as err:  # Hydra raises ImportError or ValueError
        raise ValueError(f"{where}={target!r} cannot be located: {err}") from err
    module, qualname = (
        getattr(obj, "__module__", None),
        getattr(obj, "__qualname__", None),
    )
    actual = f"{module}.{qualname}" if module and qualname else repr(obj)
    if not (
        module
        and qualname
        and "<" not in qualname
        and (_pack_default(actual) or _matches(actual, extra))
    ):
        raise ConfigNotAllowedError(
            f"{where}={target!r} is {actual}, which is not allowed. "
            f"{_how_to_allow(target)}"
        )


def check_targets(node: Any, where: str = "", *, locate: bool = True) -> None:
    """Check every ``_target_`` in a config (any depth, lists and ``_args_`` too).

    ``node`` is a ``DictConfig``/``ListConfig`` (read as it is, not resolved) or
    plain containers; ``locate`` as :func:`check_target`.
    """
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=False)
    if isinstance(node, Mapping):
        for key, value in node.items():
            path = f"{where}.{key}" if where else str(key)
            if key == "_target_":
                check_target(value, path, locate=locate)
            else:
                check_targets(value, path, locate=locate)
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            check_targets(value, f"{where}[{index}]", locate=locate)


def _check_no_resolvers(node: Any, where: str = "") -> None:
    if isinstance(node, Mapping):
        for key, value in node.items():
            _check_no_resolvers(value, f"{where}.{key}" if where else str(key))
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            _check_no_resolvers(value, f"{where}[{index}]")
    elif isinstance(node, str) and _RESOLVER.search(node):
        raise ConfigNotAllowedError(
            f"{where}={node!r} calls a resolver: a run's overrides may refer to "
            "other keys (${seed}) but not call resolvers (${oc.env:...} would "
            "read the host's environment). Write the value itself."
        )


class KebabKeyError(ValueError):
    """An override names a key of conf/ in kebab-case (the tree is snake_case)."""


def check_snake_key(key: str, text: str = "") -> None:
    """Refuse a kebab-case key, naming its snake_case spelling.

    The tree's keys were kebab-case before 0.2 (``num-clients``); Hydra would
    only say it cannot override them. Kebab-case stays on the wire and in
    Flower's ``--run-config`` (``num-rounds``, ``output-dir``), not in conf/.

    Raises
    ------
    KebabKeyError
        When a part of ``key`` (not a config-group path) holds a ``-``.
    """
    if "/" in key or "-" not in key:
        return
    snake = key.replace("-", "_")
    raise KebabKeyError(
        f"override {text or key!r}: the keys of conf/ are snake_case: write "
        f"{snake!r} (kebab-case is for Flower's --run-config keys and the "
        'messages, e.g. --run-config "num-rounds=5").'
    )


def _plugin_option(key: str, option: object) -> bool:
    """Whether ``option`` of group ``key`` is an installed plugin's strategy.

    Only ``strategy=<name>``: a plugin's conf package may hold other files (its
    strategy's defaults list picks them), but a run's overrides choose among
    the pack's data sets, models and partitions only.

    Raises
    ------
    PluginError
        When ``option`` is a plugin that is installed but broken.
    """
    if key != "strategy" or not isinstance(option, str) or option in ALGORITHMS:
        return False
    try:
        return registered_algorithm(option).conf is not None
    except KeyError:
        return False


def check_overrides(overrides: Sequence[str]) -> None:
    """Refuse overrides of Hydra's own config and config-group options not in conf/.

    Raises
    ------
    ConfigNotAllowedError
        For ``hydra.*`` / ``hydra/...`` keys (``hydra.searchpath`` loads YAML from
        any folder) and for a group option that is not a file of ``conf/<group>/``
        (``dataset=../../x`` reads any YAML file) nor, for ``strategy``, an
        installed plugin's.
    PluginError
        For ``strategy=<name>`` of an installed plugin that cannot be used,
        naming its distribution and entry point.
    KebabKeyError
        For a kebab-case key (``num-clients``), naming the snake_case one.
    ValueError
        When Hydra cannot parse an override.
    """
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as err:  # Hydra's OverrideParseException and friends
        raise ValueError(f"cannot parse overrides {list(overrides)!r}: {err}") from err
    for override in parsed:
        key = override.key_or_group
        text = override.input_line or key
        package = override.package or ""
        check_snake_key(key, text)
        if key.split(".")[0].split("/")[0] == "hydra" or package.startswith("hydra"):
            raise ConfigNotAllowedError(
                f"override {text!r} changes Hydra's own configuration, which a "
                "run's overrides may not do (e.g. hydra.searchpath would load YAML "
                "from any folder). Use the groups and keys of conf/."
            )
        if "." in key or not (CONF_DIR / key.split("/")[0]).is_dir():
            continue  # a value, not a config group
        parts = key.split("/")
        group_dir = CONF_DIR.joinpath(*parts)
        if not all(_GROUP_OPTION.fullmatch(p) for p in parts) or not group_dir.is_dir():
            raise ConfigNotAllowedError(
                f"override {text!r}: {key!r} is not a config group of conf/."
            )
        if override.is_delete() and override.value() is None:
            continue
        value = override.value()
        options = value if isinstance(value, list) else [value]
        for option in options:
            if (
                isinstance(option, str)
                and _GROUP_OPTION.fullmatch(option)
                and (group_dir / f"{option}.yaml").is_file()
            ) or _plugin_option(key, option):
                continue
            choices = sorted(p.stem for p in group_dir.glob("*.yaml"))
            raise ConfigNotAllowedError(
                f"override {text!r}: {option!r} is not an option of {key} "
                f"(conf/{key}/: {', '.join(choices)}"
                + (_plugin_words() if key == "strategy" else ")")
                + "."
            )


def _plugin_words() -> str:
    """Say which plugins are installed and how a package adds a strategy."""
    sources = plugin_sources()
    installed = ", ".join(f"{n} ({sources[n]})" for n in sorted(sources)) or "none"
    return (
        f"; installed plugins: {installed}). A package adds a strategy with an "
        f"entry point in the group {ENTRY_POINT_GROUP!r} (the documentation's "
        "guide to adding an algorithm, 'Registering an algorithm from your own "
        "package')"
    )


def split_overrides(overrides: str | Sequence[str]) -> list[str]:
    """Split a run-config override string (shell-like quoting) into a list."""
    if isinstance(overrides, str):
        return shlex.split(overrides)
    return [str(o) for o in overrides]


def overrides_from_run_config(run_config: Mapping[str, Any]) -> list[str]:
    """Turn Flower's run config into Hydra overrides.

    ``num-rounds`` and ``seed`` apply only when set (> 0 and >= 0); the
    ``overrides`` string is applied last, so it wins.
    """
    result = []
    rounds = int(run_config.get(RUN_NUM_ROUNDS, 0) or 0)
    if rounds > 0:
        result.append(f"num_rounds={rounds}")
    seed = int(run_config.get(RUN_SEED, -1) if run_config.get(RUN_SEED) != "" else -1)
    if seed >= 0:
        result.append(f"seed={seed}")
    result.extend(split_overrides(str(run_config.get(RUN_OVERRIDES, "") or "")))
    return result


@functools.lru_cache(maxsize=32)
def _compose_cached(
    overrides: tuple[str, ...],
    plugins: tuple[tuple[str, str | None], ...],  # part of the key: a refresh
) -> DictConfig:
    # Inside a @hydra.main job (a sweep) Hydra is already initialised: compose
    # with a private instance and give the job's own back afterwards.
    check_overrides(overrides)
    _register_search_path()  # in case Hydra's plugin singleton was reset
    backup = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config_name="config", overrides=list(overrides))
    finally:
        restore_gh_from_backup(backup)
    _check_no_resolvers(OmegaConf.to_container(cfg, resolve=False))
    OmegaConf.resolve(cfg)
    # Again once resolved: "$${a}" with a="{oc.env:X}" resolves to a resolver
    # call, which a later OmegaConf.create (a YAML round trip) would run.
    _check_no_resolvers(OmegaConf.to_container(cfg, resolve=False))
    OmegaConf.set_readonly(cfg, True)
    return cfg


def compose_config(
    overrides: str | Sequence[str] = (), *, locate: bool = True
) -> DictConfig:
    """Compose ``conf/config.yaml`` with Hydra overrides (read-only result).

    Parameters
    ----------
    overrides : str | Sequence[str]
        E.g. ``"strategy=fedavg partition=iid num_rounds=30"`` or a list.
    locate : bool (default: True)
        Import every ``_target_`` to check what it really is. False checks
        the names only (a ServerApp, which must not import the clients' and
        the model's torch code: each target is located when it is
        instantiated, and the initial model's child process checks them all).

    Raises
    ------
    ConfigNotAllowedError
        When the overrides ask for what a run may not (a ``_target_`` off the
        allow-list, Hydra's own config, a group option outside conf/, a
        resolver call): see the module docstring.
    PluginError
        When ``strategy=<name>`` names an installed plugin that cannot be used.
    ValueError
        With Hydra's message when an override names an unknown group or key.
    """
    plugins = tuple((name, a.conf) for name, a in sorted(_plugins().items()))
    try:
        cfg = _compose_cached(tuple(split_overrides(overrides)), plugins)
    except (ConfigNotAllowedError, KebabKeyError, PluginError):
        raise
    except Exception as err:  # Hydra raises several unrelated exception types
        raise ValueError(
            f"cannot compose conf/ with overrides {overrides!r}: {err}"
        ) from err
    # Outside the cache: the allow-list may change between calls.
    check_targets(cfg, locate=locate)
    return cfg


def instantiate(node: Any, *args: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` after :func:`check_targets` on ``node``."""
    check_targets(node)
    return hydra.utils.instantiate(node, *args, **kwargs)


def config_from_run_config(
    run_config: Mapping[str, Any], *, locate: bool = True
) -> DictConfig:
    """Compose ``conf/`` from Flower's run config (overrides, num-rounds, seed).

    ``locate`` as :func:`compose_config`.
    """
    return compose_config(overrides_from_run_config(run_config), locate=locate)

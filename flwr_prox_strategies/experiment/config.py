"""Compose the ``conf/`` tree and build strategies, clients, models and data from it.

Every Flower app of the pack (and the sweep launcher) goes through these
functions, so an experiment means the same thing however it is started.
"""

from __future__ import annotations

import functools
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.initialize import get_gh_backup, restore_gh_from_backup
from omegaconf import DictConfig, OmegaConf

from ..core.central import central_dp
from ..core.dp import make_private_model

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

# Keys of [tool.flwr.app.config] that `flwr run --run-config` may set.
RUN_OVERRIDES = "overrides"
RUN_NUM_ROUNDS = "num-rounds"
RUN_SEED = "seed"
RUN_OUTPUT_DIR = "output-dir"
RUN_OUTPUT_ROOT = "output-root"

# Keys only Hydra's own machinery or the sweep use; stripped before building.
_UNUSED = "_unused_"


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
        result.append(f"num-rounds={rounds}")
    seed = int(run_config.get(RUN_SEED, -1) if run_config.get(RUN_SEED) != "" else -1)
    if seed >= 0:
        result.append(f"seed={seed}")
    result.extend(split_overrides(str(run_config.get(RUN_OVERRIDES, "") or "")))
    return result


@functools.lru_cache(maxsize=32)
def _compose_cached(overrides: tuple[str, ...]) -> DictConfig:
    # Inside a @hydra.main job (a sweep) Hydra is already initialised: compose
    # with a private instance and give the job's own back afterwards.
    backup = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config_name="config", overrides=list(overrides))
    finally:
        restore_gh_from_backup(backup)
    OmegaConf.resolve(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def compose_config(overrides: str | Sequence[str] = ()) -> DictConfig:
    """Compose ``conf/config.yaml`` with Hydra overrides (read-only result).

    Parameters
    ----------
    overrides : str | Sequence[str]
        E.g. ``"strategy=fedavg partition=iid num-rounds=30"`` or a list.

    Raises
    ------
    ValueError
        With Hydra's message when an override names an unknown group or key.
    """
    try:
        return _compose_cached(tuple(split_overrides(overrides)))
    except Exception as err:  # Hydra raises several unrelated exception types
        raise ValueError(
            f"cannot compose conf/ with overrides {overrides!r}: {err}"
        ) from err


def _kwargs(node: DictConfig) -> dict[str, Any]:
    container = OmegaConf.to_container(node, resolve=True)
    assert isinstance(container, dict)
    data: dict[str, Any] = {str(k): v for k, v in container.items()}
    for key in data.pop(_UNUSED, []) or []:
        data.pop(key, None)
    return data


def build_strategy(cfg: DictConfig, **runtime: Any) -> Any:
    """Instantiate ``cfg.strategy`` (keys listed in ``_unused_`` are dropped)."""
    return hydra.utils.instantiate(_kwargs(cfg.strategy), **runtime)


def build_model(cfg: DictConfig) -> Any:
    """Instantiate ``cfg.model`` (made DP-SGD ready when ``privacy.dp`` is set).

    Server and clients both build their model here, so opacus' fix (when
    ``privacy.dp.fix_model``) gives both the same ``state_dict``.
    """
    return make_private_model(hydra.utils.instantiate(cfg.model), build_dp(cfg))


def build_dp(cfg: DictConfig) -> Any:
    """Instantiate ``cfg.privacy.dp`` (None without sample-level privacy)."""
    node = cfg.get("privacy", {}).get("dp")
    return None if node is None else hydra.utils.instantiate(node)


def wrap_central_dp(cfg: DictConfig, strategy: Any) -> Any:
    """Return ``strategy`` in a central-DP wrapper when ``privacy.central`` is set."""
    node = cfg.get("privacy", {}).get("central")
    if node is None:
        return strategy
    # (central_dp refuses a strategy without one global model, P-FedAvg, clearly.)
    sampled = max(
        int(int(cfg["num-clients"]) * float(getattr(strategy, "fraction_train", 1))),
        int(getattr(strategy, "min_train_nodes", 1)),
    )
    return central_dp(
        strategy,
        clipping=str(node.clipping),
        noise_multiplier=float(node.noise_multiplier),
        clipping_norm=float(node.clipping_norm),
        num_sampled_clients=sampled,
    )


def build_client(cfg: DictConfig, **runtime: Any) -> Any:
    """Instantiate ``cfg.client`` with the ``train`` settings and runtime objects."""
    train = cfg.train
    # Runtime objects go in after Hydra: it would turn a dataclass (DPSGD)
    # into a DictConfig.
    factory = hydra.utils.instantiate(_kwargs(cfg.client), _partial_=True)
    return factory(
        local_epochs=int(train["local-epochs"]),
        learning_rate=float(train["learning-rate"]),
        momentum=float(train["momentum"]),
        weight_decay=float(train["weight-decay"]),
        max_grad_norm=train.get("max-grad-norm"),
        finetune_steps=int(train.get("finetune-steps", 0) or 0),
        dp=build_dp(cfg),
        **runtime,
    )


def config_yaml(cfg: DictConfig) -> str:
    """Return the resolved config as YAML (for results files and logs)."""
    return OmegaConf.to_yaml(cfg, resolve=True)

"""Run checkpoints: when a run writes them, and how a run resumes from one.

The file's format is :mod:`.store.checkpoint_file`'s; its names import from here too.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import random
import sys
from collections.abc import Callable, Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import hydra
import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.common.logger import log
from omegaconf import DictConfig, OmegaConf

from . import RUN_OUTPUT_DIR, RUN_OUTPUT_ROOT, RUN_RESUME
from .config import check_target
from .store.checkpoint_file import (
    CHECKPOINT_FILE,
    FORMAT,
    VERSION,
    CheckpointError,
    read_checkpoint,
    write_checkpoint,
)

#: Environment variable: the folder new runs' folders go in (run config
#: ``output-root`` first; default ``./outputs``).
OUTPUT_ROOT_ENV = "FLWR_PROX_OUTPUT_ROOT"
#: conf key: write a checkpoint every N rounds (and after the last); 0: never.
CHECKPOINT_EVERY = "checkpoint_every"
#: Sub-folder of the output folder where the app's clients mirror their state.
CLIENT_STATE_DIR = "client-state"
#: conf key: where stateful clients keep their cross-round state, ``memory``
#: (``context.state``, mirrored to CLIENT_STATE_DIR for resumes) or ``disk``
#: (in CLIENT_STATE_DIR only).
CLIENT_STATE = "client_state"
CLIENT_STATE_PLACES = ("memory", "disk")
#: conf keys that may differ between a run and its resume: they change neither
#: the model nor a round's results (``num_rounds`` may grow: extend a run).
RESUME_FREE_KEYS = frozenset(
    {
        "num_rounds",
        CHECKPOINT_EVERY,
        CLIENT_STATE,
        "node_wait_timeout",
        "round_timeout",
        "prompt_replies",
        "engine",
        "num_cpus_per_client",
        "cpus_per_job",
        "ray_address",
        "target_accuracy",
        "hydra",
    }
)
#: Strategies whose runs cannot continue exactly, and why.
NOT_RESUMABLE = {
    "APFL": (
        "APFL's clients update their personal model and mixing weight in place at "
        "every fit (no two-phase commit): a round redone after a crash would train "
        "them twice"
    ),
}


def checkpoint_every(cfg: DictConfig) -> int:
    """Return ``checkpoint_every`` (validated: an integer >= 0)."""
    value = cfg.get(CHECKPOINT_EVERY, 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{CHECKPOINT_EVERY} must be an integer >= 0 (0: no checkpoints), "
            f"got {value!r}"
        )
    return value


def resume_folder(run_config: Mapping[str, Any]) -> Path | None:
    """Return the folder of the run to resume (run config ``resume``), or None."""
    folder = str(run_config.get(RUN_RESUME, "") or "")
    return Path(folder).expanduser().resolve() if folder else None


def client_class(cfg: DictConfig) -> type:
    """Return the class ``cfg.client`` builds (allow-listed before it is imported)."""
    check_target(cfg.client._target_, "client._target_")
    cls = hydra.utils.get_class(str(cfg.client._target_))
    assert isinstance(cls, type)
    return cls


def mirrors_client_state(cfg: DictConfig, strategy: Any = None) -> bool:
    """Return True when the app's clients keep state a resumed run needs on disk.

    Stateful clients (two-phase state: SCAFFOLD, FedDyn, FedDC, FedEPM), clients
    whose rule keeps a privacy ledger (FedEPM's and SFedAvg's noisy uploads) and
    DP-SGD clients, when checkpoints are written. The server reads what its
    ``strategy`` declares (``stateful_clients``, ``ledger_clients``), so that
    it never imports the clients' torch code; a client (``strategy=None``)
    reads its own class's rule. The contract checks hold the two to agree.
    """
    if checkpoint_every(cfg) == 0:
        return False
    if cfg.get("privacy", {}).get("dp") is not None:
        return True
    if strategy is None:
        client = client_class(cfg)
        return keeps_state(client) or keeps_ledger(client)
    return any(
        getattr(s, "stateful_clients", False) or getattr(s, "ledger_clients", False)
        for s in _inner_strategies(strategy)
    )


def keeps_state(client: Any) -> bool:
    """Return True for a client class whose rule keeps two-phase state."""
    return bool(getattr(getattr(client, "rule_class", None), "stateful", False))


def keeps_ledger(client: Any) -> bool:
    """Return True for a client class whose rule spends privacy itself."""
    rule = getattr(client, "rule_class", None)
    return bool(getattr(rule, "keeps_privacy_ledger", False))


def client_state_on_disk(cfg: DictConfig) -> bool:
    """Return True when ``client_state=disk``: clients keep their state in files only.

    Raises
    ------
    ValueError
        If ``client_state`` is neither ``memory`` nor ``disk``.
    """
    place = cfg.get(CLIENT_STATE, "memory")
    if place not in CLIENT_STATE_PLACES:
        raise ValueError(
            f"{CLIENT_STATE} must be one of {', '.join(CLIENT_STATE_PLACES)}, "
            f"got {place!r}"
        )
    return bool(place == "disk")


def client_state_dir(
    cfg: DictConfig, run_config: Mapping[str, Any], strategy: Any = None
) -> str | None:
    """Return where this run's clients keep or mirror their state, or None.

    ``<folder>/client-state`` of the folder the run config names (``resume``,
    else ``output-dir``), when :func:`mirrors_client_state` (given the
    server's ``strategy``; a client passes none) or ``client_state=disk``. A
    run that lets the ServerApp name its folder (a timestamp) has none: the
    clients cannot know that name.
    """
    if not (client_state_on_disk(cfg) or mirrors_client_state(cfg, strategy)):
        return None
    folder = resume_folder(run_config)
    if folder is None:
        explicit = str(run_config.get(RUN_OUTPUT_DIR, "") or "")
        if not explicit:
            return None
        folder = Path(explicit).expanduser().resolve()
    return str(folder / CLIENT_STATE_DIR)


def _inner_strategies(strategy: Any) -> list[Any]:
    return list(getattr(strategy, "inner", [])) or [strategy]


def check_checkpointing(cfg: DictConfig, strategy: Any) -> int:
    """Return ``checkpoint_every``; refuse a value a resume could not honour.

    A stateful client commits its round-``r`` state when it is next trained;
    with checkpoints more than one round apart, a client may commit a round
    after the last checkpoint, which a resume cannot undo.
    """
    every = checkpoint_every(cfg)
    stateful = any(
        getattr(s, "stateful_clients", False) for s in _inner_strategies(strategy)
    )
    if every > 1 and stateful:
        raise ValueError(
            f"{CHECKPOINT_EVERY}={every}: {type(strategy).__name__}'s clients keep "
            "state that a resume can only roll back by one round (a client commits "
            "round r's state when it is next trained), so it needs a checkpoint "
            f"every round: set {CHECKPOINT_EVERY}=1, or 0 for none"
        )
    return every


def resume_blockers(cfg: DictConfig, strategy: Any) -> list[str]:
    """Say why a run of this configuration cannot be resumed exactly (empty: it can)."""
    reasons = []
    for inner in _inner_strategies(strategy):
        name = type(inner).__name__
        if name in NOT_RESUMABLE:
            reasons.append(NOT_RESUMABLE[name])
        elif not hasattr(inner, "state_dict") or not hasattr(inner, "load_state_dict"):
            reasons.append(f"{name} has no state_dict()/load_state_dict()")
    if not hasattr(strategy, "state_dict"):
        reasons.append(f"{type(strategy).__name__} has no state_dict()")
    return sorted(set(reasons))


def refuse_used_folder(folder: Path) -> None:
    """Refuse to start a new run in a folder holding another run's checkpoint/state.

    Its clients would read the other run's state files.
    """
    checkpoint = folder / CHECKPOINT_FILE
    states = folder / CLIENT_STATE_DIR
    if checkpoint.exists():
        try:
            saved = read_checkpoint(folder)
            what = f"a checkpoint at round {saved['round']} of {saved['num-rounds']}"
        except CheckpointError:
            what = "a (damaged) checkpoint"
        raise CheckpointError(
            f"output folder {folder} already holds a run ({what}): continue it with "
            f"--run-config \"resume='{folder}'\" (the same run config otherwise), or "
            "choose another output-dir"
        )
    if states.is_dir() and any(states.iterdir()):
        raise CheckpointError(
            f"output folder {folder} already holds client state of another run "
            f"({states}), which this run's clients would read: choose another "
            "output-dir, or delete that folder"
        )


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, Mapping):
        flat: dict[str, Any] = {}
        for key, value in node.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: node}


def config_differences(
    saved: Mapping[Any, Any], current: Mapping[Any, Any]
) -> list[str]:
    """Return ``key: saved there, current here`` for every result-relevant key."""
    before, now = _flatten(saved), _flatten(current)
    missing = object()
    lines = []
    for key in sorted(set(before) | set(now)):
        if key.split(".", 1)[0] in RESUME_FREE_KEYS:
            continue
        old, new = before.get(key, missing), now.get(key, missing)
        if old != new or type(old) is not type(new):
            lines.append(
                f"{key}: {'(absent)' if old is missing else repr(old)} there, "
                f"{'(absent)' if new is missing else repr(new)} here"
            )
    return lines


def rng_state() -> dict[str, Any]:
    """Return the ServerApp process's global RNG states (Python, numpy, torch).

    The pack's sampling is seeded per round and needs none of them; Flower's
    central-DP wrappers draw their noise from numpy's global generator. Torch's
    only when the process has loaded torch (a ServerApp without central
    evaluation never does), as a numpy array.
    """
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state().numpy()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (torch's where torch is loaded)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch = sys.modules.get("torch")
    if torch is not None and state.get("torch") is not None:
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))


def record_to_saved(arrays: ArrayRecord) -> dict[str, Any]:
    """Return an ArrayRecord as names and numpy arrays (order kept)."""
    return {
        "names": list(arrays.keys()),
        "arrays": [a.numpy() for a in arrays.values()],
    }


def saved_to_record(saved: Mapping[str, Any]) -> ArrayRecord:
    """Return the ArrayRecord :func:`record_to_saved` described."""
    return ArrayRecord(
        array_dict={
            str(name): Array(np.asarray(value))
            for name, value in zip(saved["names"], saved["arrays"], strict=True)
        }
    )


@dataclasses.dataclass
class Resume:
    """What a run resumes from: its checkpoint, checked against this run."""

    folder: Path
    round: int
    arrays: ArrayRecord
    rng: dict[str, Any]
    results: dict[str, Any]


def load_resume(
    folder: Path,
    cfg: DictConfig,
    strategy: Any,
    run_config: Mapping[str, Any],
) -> Resume:
    """Read ``folder``'s checkpoint, check it fits this run, load the strategy's state.

    Raises
    ------
    CheckpointError
        When the checkpoint is missing or damaged, the configuration differs in
        anything that changes the result, the run config names another output
        folder, the strategy cannot be resumed exactly (:func:`resume_blockers`),
        or its clients' state was not kept on disk.
    """
    explicit = str(run_config.get(RUN_OUTPUT_DIR, "") or "")
    if explicit and Path(explicit).expanduser().resolve() != folder:
        raise CheckpointError(
            f"resume='{folder}' continues that folder's run there, but output-dir="
            f"'{explicit}' names another folder: give the same one, or only resume"
        )
    where = f"resume='{folder}'"
    try:
        saved = read_checkpoint(folder)
    except CheckpointError as err:
        raise CheckpointError(f"{where}: {err}") from err
    current = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(current, dict)
    differences = config_differences(saved["config"], current)
    if differences:
        raise CheckpointError(
            f"{where}: the run there had another configuration, so this one would "
            "not continue it: "
            + "; ".join(differences)
            + f". Resume with the crashed run's --run-config plus {where} "
            f"({folder / 'config.yaml'} is its configuration)"
        )
    done = int(saved["round"])
    num_rounds = int(cfg["num_rounds"])
    if num_rounds < done:
        raise CheckpointError(
            f"{where}: its checkpoint is at round {done}, beyond num_rounds="
            f"{num_rounds}"
        )
    reasons = resume_blockers(cfg, strategy)
    if mirrors_client_state(cfg, strategy) and saved.get("client-state") is None:
        reasons.append(
            "its clients kept their state in memory only (the run had no "
            "output-dir, so they could not mirror it to <output-dir>/client-state)"
        )
    if reasons:
        raise CheckpointError(
            f"{where}: {type(strategy).__name__} cannot be resumed exactly: "
            + "; ".join(reasons)
        )
    try:
        strategy.load_state_dict(saved["strategy"])
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{where}: the strategy's state does not fit: {err}"
        ) from err
    rejections = getattr(strategy, "rejections", None)
    if rejections is not None:  # diagnostics: the whole run's count in results
        rejections.update(saved.get("rejections", {}))
    if cfg.get("privacy", {}).get("dp") is not None:
        log(
            WARNING,
            "Resume with DP-SGD clients: a client's privacy ledger is never rolled "
            "back, so the DP-SGD steps a client took in a round the crash cut short "
            "stay counted: epsilon may exceed an uninterrupted run's by that "
            "round's (conservative), and a client may run out of budget a round "
            "earlier",
        )
    log(
        INFO,
        "Resuming %s from round %d of %d (checkpoint of %s)",
        folder,
        done,
        num_rounds,
        saved.get("saved-at", "?"),
    )
    return Resume(
        folder=folder,
        round=done,
        arrays=saved_to_record(saved["model"]),
        rng=saved["rng"],
        results=saved["results"],
    )


@dataclasses.dataclass
class Checkpointing:
    """Where one run writes, how it keeps checkpoints, and the run it continues."""

    folder: Path
    every: int
    client_states: str | None
    resume: Resume | None


def checkpointing(
    cfg: DictConfig,
    strategy: Any,
    run_config: Mapping[str, Any],
    new_folder: Callable[[], Path],
) -> Checkpointing:
    """Choose the run's folder, check its checkpoint policy, load a resumed run.

    With ``resume`` in ``run_config``, the run continues in that folder and
    the strategy's state is loaded here (:func:`load_resume`); else the run
    goes to ``new_folder()``, which must not hold another run's checkpoint or
    client state (:func:`refuse_used_folder`). Says where the checkpoints go
    and, when the run could not be resumed after a crash, why.

    Raises
    ------
    CheckpointError
        From :func:`load_resume` or :func:`refuse_used_folder`.
    ValueError
        From :func:`check_checkpointing`.
    """
    every = check_checkpointing(cfg, strategy)
    output_dir = resume_folder(run_config)
    resume = None
    if output_dir is not None:
        resume = load_resume(output_dir, cfg, strategy, run_config)
    else:
        output_dir = new_folder()
        refuse_used_folder(output_dir)
    states = client_state_dir(cfg, run_config, strategy)
    if client_state_on_disk(cfg):
        if states is None:
            raise ValueError(
                f"{CLIENT_STATE}=disk keeps the clients' state in <output-dir>/"
                f"{CLIENT_STATE_DIR}, and this run names no folder its clients "
                "can know: give the run config output-dir (or resume)"
            )
        log(INFO, "Clients keep their state on disk only: %s", states)
    if every:
        log(
            INFO,
            "Checkpoint every %d round(s): %s; client state: %s",
            every,
            output_dir / CHECKPOINT_FILE,
            states or "in memory only",
        )
        if mirrors_client_state(cfg, strategy) and states is None:
            log(
                WARNING,
                "%s's clients keep their state in memory only (no output-dir in the "
                "run config, so they cannot know this run's folder): this run "
                "cannot be resumed after a crash; give output-dir to make it so",
                type(strategy).__name__,
            )
        for reason in resume_blockers(cfg, strategy):
            log(WARNING, "This run cannot be resumed after a crash: %s", reason)
    return Checkpointing(
        folder=output_dir, every=every, client_states=states, resume=resume
    )


def output_dir_for(cfg: DictConfig, run_config: Mapping[str, Any]) -> Path:
    """Return the output folder: ``output-dir``, else a new one under the root."""
    explicit = str(run_config.get(RUN_OUTPUT_DIR, "") or "")
    if explicit:
        return Path(explicit).expanduser().resolve()
    root = str(
        run_config.get(RUN_OUTPUT_ROOT, "") or os.environ.get(OUTPUT_ROOT_ENV, "")
    )
    base = Path(root).expanduser() if root else Path.cwd() / "outputs"
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    name = (
        f"{stamp}-{cfg.strategy._target_.rsplit('.', 1)[-1].lower()}-{cfg.dataset.name}"
    )
    return (base / name).resolve()


__all__ = [
    "CHECKPOINT_EVERY",
    "CHECKPOINT_FILE",
    "CLIENT_STATE_DIR",
    "FORMAT",
    "OUTPUT_ROOT_ENV",
    "VERSION",
    "CheckpointError",
    "Checkpointing",
    "Resume",
    "check_checkpointing",
    "checkpointing",
    "client_state_dir",
    "client_state_on_disk",
    "load_resume",
    "output_dir_for",
    "read_checkpoint",
    "refuse_used_folder",
    "resume_blockers",
    "resume_folder",
    "write_checkpoint",
]

"""Shared helpers: messages, replies and contexts built by hand; the project's app
run in-process; small sweeps; scripts outside the package imported; log checks."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    RecordDict,
)

from flwr_prox_strategies.core.transport.flower import set_task_identity

# The conformance kit's builders, under the names the tests have always used.
from flwr_prox_strategies.testing import (
    error_reply,
    model_arrays,
    record,
    reply,
    sampling_grid,
)

from .system.engine import hydra_entry

__all__ = [
    "configure",
    "context",
    "error_reply",
    "honest_replies",
    "load_script",
    "logged",
    "model_arrays",
    "node_context",
    "record",
    "reply",
    "run_app",
    "sampling_grid",
    "small_sweep",
    "train_message",
]


def small_sweep(
    sweep_dir: Path, *overrides: str, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """An in-process multirun into ``sweep_dir``: 3 clients, 2 rounds, logreg jobs."""
    return hydra_entry(
        *("-m", "engine=inprocess", "num_clients=3", "num_rounds=2", "model=logreg"),
        *overrides,
        f"hydra.sweep.dir={sweep_dir}",
        cwd=sweep_dir if cwd is None else cwd,
    )


def load_script(path: Path, name: str | None = None) -> ModuleType:
    """Import a script outside the package (docs, benchmarks) as module ``name``."""
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def logged(caplog, text: str) -> bool:
    """Whether a record captured by ``caplog`` holds ``text``."""
    return any(text in r.getMessage() for r in caplog.records)


def run_app(output_dir: Path, overrides: str, num_nodes: int) -> tuple[Path, dict]:
    """The project's app run in-process: its output folder and its results.json."""
    from apps.client_app import app as client_app
    from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
    from flwr_prox_strategies.experiment.server import run_experiment

    run_config = {"overrides": overrides, "output-dir": str(output_dir)}
    grid = InProcessGrid(client_app, num_nodes=num_nodes, run_config=run_config)
    _, out = run_experiment(grid, run_config)
    return out, json.loads((out / "results.json").read_text())


def train_message(arrays, config: dict, extra: dict | None = None) -> Message:
    """A train message as a strategy sends it: the model, extra records, config.

    ``arrays`` and each value of ``extra`` are an ArrayRecord or a list of arrays.
    """
    set_task_identity(1)  # hand-built messages need it (DESIGN.md)

    def as_record(value) -> ArrayRecord:
        return value if isinstance(value, ArrayRecord) else ArrayRecord(value)

    content = RecordDict(
        {
            "arrays": as_record(arrays),
            **{name: as_record(v) for name, v in (extra or {}).items()},
            "config": ConfigRecord(config),
        }
    )
    return Message(content=content, message_type=MessageType.TRAIN, dst_node_id=1001)


def context(k: int = 0) -> Context:
    """A node's context with partition ``k`` and an empty state."""
    return Context(
        run_id=1,
        node_id=1001,
        node_config={"partition-id": k},
        state=RecordDict(),
        run_config={},
    )


def node_context(
    node_id: int, partition: int, num_partitions: int, overrides: str | None = None
) -> Context:
    """A SuperNode's context: partition k of n, an empty state, the run's overrides."""
    return Context(
        run_id=1,
        node_id=node_id,
        node_config={"partition-id": partition, "num-partitions": num_partitions},
        state=RecordDict(),
        run_config={} if overrides is None else {"overrides": overrides},
    )


def honest_replies(
    messages: list[Message], make: Callable[[int], dict[str, np.ndarray]]
) -> list[Message]:
    """One well-formed reply per message; node i returns make(i)."""
    return [reply(m, make(i), num_examples=10 + i) for i, m in enumerate(messages)]


def configure(strategy, arrays: dict[str, np.ndarray], grid, server_round: int = 1):
    return list(
        strategy.configure_train(server_round, record(arrays), ConfigRecord(), grid)
    )

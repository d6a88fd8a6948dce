"""The model a new run starts from, built where torch may be loaded.

A ServerApp needs the initial model's arrays, not torch: torch takes about
180 MB of a process, which at thousands of SuperNodes is a fifth of the
simulation's. When its process has not loaded torch, the model is built in a
child process (``python -m flwr_prox_strategies.experiment.initial``, the
configuration on its standard input), which sends the arrays back; a process
that has torch already (the in-process engine, a test, a ServerApp with central
evaluation) builds it itself. Both build it the same way, torch's generator
seeded with ``seed`` and then ``model`` instantiated (made DP-SGD ready when
``privacy.dp`` is set), so the arrays are the same bits either way.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

from flwr.app import Array, ArrayRecord
from omegaconf import DictConfig, OmegaConf

from . import config


def initial_arrays(cfg: DictConfig) -> ArrayRecord:
    """Return the arrays of ``cfg.model`` as a new run starts it.

    In this process when it has loaded torch, else in a child process.

    Raises
    ------
    RuntimeError
        When the child process fails; its error is in the message.
    """
    if "torch" in sys.modules:
        return built_here(cfg)
    return built_in_child(cfg)


def built_here(cfg: DictConfig) -> ArrayRecord:
    """Seed torch's generator with ``cfg.seed``, build the model, return its arrays."""
    import torch

    from .build import build_model  # build imports this module

    torch.manual_seed(int(cfg.seed))
    return ArrayRecord(build_model(cfg).state_dict())


def built_in_child(cfg: DictConfig) -> ArrayRecord:
    """Return :func:`built_here`'s arrays, built by a child process."""
    env = dict(os.environ)
    # The child imports what this process imports: the app's folder (a flwr
    # run's FAB) and a plugin's package may be on sys.path only.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env[config.ALLOWED_TARGETS_ENV] = ",".join(config.allowed_targets())
    done = subprocess.run(
        [sys.executable, "-m", __name__],
        input=OmegaConf.to_yaml(cfg, resolve=True).encode(),
        capture_output=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            "building the initial model in a child process failed "
            f"(exit {done.returncode}):\n{done.stderr.decode(errors='replace')[-3000:]}"
        )
    pieces: list[tuple[str, Array]] = pickle.loads(done.stdout)
    return ArrayRecord(array_dict=dict(pieces))


def _main() -> None:
    cfg = OmegaConf.create(sys.stdin.buffer.read().decode())
    assert isinstance(cfg, DictConfig)
    # The server checked the targets' names only; every one is located here,
    # so a wrong client or model fails the run's start, not its first round.
    config.check_targets(cfg)
    arrays = built_here(cfg)
    sys.stdout.buffer.write(pickle.dumps(list(arrays.items())))


if __name__ == "__main__":
    _main()

"""Data-parallel clients: one client's training on several processes (PyTorch DDP).

A ClientApp gets one message in one process. :func:`data_parallel` runs the
user's training function on ``world_size`` processes (``torch.distributed``,
the gloo backend on CPU by default), each with the message and the node's
context, and returns rank 0's reply with rank 0's ``context.state`` copied into
the node's context. Each rank builds its rule from the message on the module
inside ``DistributedDataParallel``: every rank loads the same model, DDP
averages the data gradients in ``backward()``, and the rule adds the same term
on every rank (after the reduction when attached), so the replicas stay equal
and each rank counts its own steps; rank 0's reply is the client's.
"""

from __future__ import annotations

import gc
import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch.distributed as dist
import torch.multiprocessing as mp
from flwr.app import Context, Message

TrainOnRank = Callable[[int, int, Message, Context], Message]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rank(
    rank: int,
    world_size: int,
    train: TrainOnRank,
    message: Message,
    context: Context,
    settings: tuple[str, int, str],
) -> None:
    backend, port, out = settings
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # The ranks of one client talk on this machine: over loopback, whatever
    # interface the hostname resolves to.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        reply = train(rank, world_size, message, context)
        # Free the training's DistributedDataParallel (its reducer holds the
        # process group) before the group goes: torch aborts the process at
        # exit otherwise, now and then ("terminate called without an active
        # exception").
        gc.collect()
        if rank == 0:
            Path(out).write_bytes(pickle.dumps((reply, context.state)))
        dist.barrier()  # no rank leaves while another still talks to it
    finally:
        dist.destroy_process_group()


def data_parallel(
    train: TrainOnRank,
    message: Message,
    context: Context,
    *,
    world_size: int = 2,
    backend: str = "gloo",
) -> Message:
    """Run ``train`` on ``world_size`` processes; return rank 0's reply.

    Parameters
    ----------
    train : Callable[[int, int, Message, Context], Message]
        ``train(rank, world_size, message, context)``, a module-level function
        (the processes are spawned): build the model, wrap it in
        ``DistributedDataParallel``, build the rule on the module inside it
        (``XxxRule.from_message(message, context, ddp.module)``), attach it,
        train on this rank's share of the data and return
        ``rule.reply(num_examples=...)`` with the examples of every rank.
    message, context : Message, Context
        What the ClientApp received.
    world_size : int (default: 2)
        The processes.
    backend : str (default: "gloo")
        The ``torch.distributed`` backend (gloo runs on CPU).

    Returns
    -------
    Message
        Rank 0's reply; ``context.state`` then holds rank 0's state (the
        rule's pending records), as if the node had trained alone.

    Raises
    ------
    ValueError
        ``world_size`` below 1.
    RuntimeError
        A rank failed (torch's error names it), or rank 0 returned no reply.
    """
    if (
        isinstance(world_size, bool)
        or not isinstance(world_size, int)
        or world_size < 1
    ):
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    with tempfile.TemporaryDirectory(prefix="data-parallel-") as folder:
        out = str(Path(folder) / "rank0.pkl")
        mp.spawn(
            _rank,
            args=(world_size, train, message, context, (backend, _free_port(), out)),
            nprocs=world_size,
            join=True,
        )
        if not Path(out).is_file():
            raise RuntimeError("data_parallel: rank 0 returned no reply")
        reply, state = pickle.loads(Path(out).read_bytes())
    for name in list(context.state):
        del context.state[name]
    for name, record in state.items():
        context.state[name] = record
    return cast(Message, reply)


__all__ = ["data_parallel"]

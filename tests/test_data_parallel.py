"""A data-parallel client (PyTorch DDP on CPU, gloo, two processes): every rank
adds the same term after the gradients are reduced, rank 0's reply and state
are the node's, and the update is the hand-computed one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flwr_prox_strategies import ScaffoldRule
from flwr_prox_strategies.integrations.distributed import data_parallel

from .helpers import context, train_message
from .lsq import LeastSquares, half_sse

LR, STEPS, C = 0.05, 3, 0.1


def train_on_rank(rank, world_size, message, ctx):
    """SCAFFOLD on this rank's half of client 1's data, through DDP."""
    problem = LeastSquares()
    model = torch.nn.Linear(problem.dim, 1, bias=False)
    rule = ScaffoldRule.from_message(message, ctx, model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = rule.attach(torch.optim.SGD(ddp.parameters(), lr=LR))
    x, y = torch.from_numpy(problem.a[1]), torch.from_numpy(problem.b[1])
    share = len(x) // world_size
    xs, ys = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
    for _ in range(STEPS):
        optimizer.zero_grad()
        half_sse(ddp(xs), ys).backward()
        optimizer.step()
    return rule.reply(num_examples=len(x))


@pytest.mark.long
def test_scaffold_on_two_ranks_is_the_hand_computed_client():
    problem = LeastSquares()
    message = train_message(
        [np.zeros((1, problem.dim), np.float32)],
        {"server-round": 1},
        {"control": [np.full((1, problem.dim), C, np.float32)]},
    )
    ctx = context(1)
    reply = data_parallel(train_on_rank, message, ctx, world_size=2)
    a, b = problem.a[1].astype(np.float64), problem.b[1].astype(np.float64)
    half = len(a) // 2
    w = np.zeros(problem.dim)
    for _ in range(STEPS):  # DDP averages the ranks' gradients; the term once
        grad = (
            sum(
                a[i * half : (i + 1) * half].T
                @ (a[i * half : (i + 1) * half] @ w - b[i * half : (i + 1) * half])
                for i in range(2)
            )
            / 2
        )
        w = w - LR * (grad + C)
    got = reply.content["arrays"].to_numpy_ndarrays()[0][0]
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    metrics = reply.content["metrics"]
    assert metrics["scaffold-applied"] == metrics["local-steps"] == STEPS
    assert metrics["num-examples"] == len(a)
    # Rank 0's pending state is the node's: the next round commits it.
    assert any("scaffold-control" in name for name in ctx.state.array_records)


def test_a_bad_world_size_is_refused():
    with pytest.raises(ValueError, match="world_size"):
        data_parallel(train_on_rank, None, None, world_size=0)  # type: ignore[arg-type]

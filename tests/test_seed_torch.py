"""``seed_torch``: the state ``torch.manual_seed`` gives, without its per-call cost."""

from __future__ import annotations

import pytest
import torch

from flwr_prox_strategies.core.client import training
from flwr_prox_strategies.core.client.training import seed_torch


@pytest.mark.parametrize("seed", [0, 7, 1_000_003 * 5 + 2, 2**63 + 11, -3])
def test_seed_torch_draws_as_manual_seed(seed: int) -> None:
    torch.manual_seed(seed)
    want = (torch.rand(5), torch.randn(3), torch.randperm(10))
    torch.manual_seed(12345)  # somewhere else
    seed_torch(seed)
    got = (torch.rand(5), torch.randn(3), torch.randperm(10))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_seed_torch_seeds_only_the_cpu_without_an_accelerator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refused(seed: int) -> None:
        raise AssertionError("torch.manual_seed called with the CPU alone")

    monkeypatch.setattr(training, "_cpu_only", lambda: True)
    monkeypatch.setattr(torch, "manual_seed", refused)
    seed_torch(3)  # the CPU generator only: no stack recorded for CUDA


def test_seed_torch_is_manual_seed_with_an_accelerator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[int] = []
    monkeypatch.setattr(training, "_cpu_only", lambda: False)
    monkeypatch.setattr(torch, "manual_seed", seen.append)
    seed_torch(9)
    assert seen == [9]


def test_cpu_only_matches_this_torch() -> None:
    assert training._cpu_only() == (
        not torch.cuda.is_available() and not torch.backends.mps.is_available()
    )

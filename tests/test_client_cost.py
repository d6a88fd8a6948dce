"""What a client pays at every message: the same behaviour, cheaper.

``seed_torch`` gives the state ``torch.manual_seed`` gives; ``check_batches`` does
not peek a loader whose batches cannot fail it.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from flwr_prox_strategies.core.client import training
from flwr_prox_strategies.core.client.training import (
    BatchFormatError,
    batch_unpacker,
    check_batches,
    seed_torch,
)


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


def _pairs(*tensors: torch.Tensor, **options: object) -> DataLoader:
    return DataLoader(TensorDataset(*tensors), **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options", [{"batch_size": 4, "shuffle": True}, {"batch_size": None}]
)
def test_check_batches_does_not_peek_a_loader_of_tensor_pairs(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, object]
) -> None:
    loader = _pairs(torch.zeros(6, 3), torch.zeros(6), **options)
    batch = next(iter(loader))  # what a peek would get: a pair of tensors
    assert len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)

    def refused(self: DataLoader) -> None:
        raise AssertionError("peeked")

    monkeypatch.setattr(DataLoader, "__iter__", refused)
    check_batches(loader, batch_unpacker(), "train_loader")
    check_batches(loader, batch_unpacker("img", "y"), "train_loader")


def test_check_batches_still_peeks_what_could_fail() -> None:
    triples = _pairs(torch.zeros(4, 3), torch.zeros(4), torch.zeros(4), batch_size=2)
    with pytest.raises(BatchFormatError, match="list of length 3"):
        check_batches(triples, batch_unpacker(), "train_loader")
    pairs = _pairs(torch.zeros(4, 3), torch.zeros(4), batch_size=2)

    def own(batch: object) -> tuple[torch.Tensor, torch.Tensor]:
        raise BatchFormatError("own unpacker refused it")

    with pytest.raises(BatchFormatError, match="own unpacker"):
        check_batches(pairs, own, "train_loader")
    collated = DataLoader(
        TensorDataset(torch.zeros(4, 3), torch.zeros(4)),
        batch_size=2,
        collate_fn=lambda samples: {"x": samples},
    )
    with pytest.raises(BatchFormatError, match="mapping"):
        check_batches(collated, batch_unpacker(), "train_loader")

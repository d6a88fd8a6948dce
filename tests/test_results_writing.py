"""A long run's record: ``results.json`` and the checkpoint's rounds.

Each holds every round so far, so writing it as every round ends would make
a run of R rounds spend R^2/2 rounds' worth of writing. ``results.json`` is
rewritten after every round while that is cheap and as often as
``write_share`` allows once it is not; a flush (the run's end, a failure, a
resume) always writes. The clock here is the test's own: a round lasts what
the test says, and a write lasts what the file's size says. A checkpoint
holds the rounds as one JSON text, each round encoded once, and gives back
every value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flwr_prox_strategies.experiment import results as results_module
from flwr_prox_strategies.experiment.results import RESULTS_FILE, RunRecorder
from flwr_prox_strategies.experiment.store.checkpoint_file import (
    read_checkpoint,
    write_checkpoint,
)


class Clock:
    """A clock the test moves: rounds and writes last what it is told."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def slow_writes(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """A clock where writing results.json takes 1 ms per round it holds."""
    clock = Clock()
    real_write = results_module.write_json

    def write(path: Path, data: Mapping[str, Any]) -> None:
        real_write(path, data)
        clock.now += 0.001 * len(data["rounds"])

    monkeypatch.setattr(results_module, "write_json", write)
    return clock


def run_rounds(recorder: RunRecorder, clock: Clock, rounds: int) -> list[bool]:
    """End ``rounds`` rounds of 1 s each; return whether each wrote the file."""
    wrote = []
    for rnd in range(1, rounds + 1):
        clock.now += 1.0
        recorder.record(rnd, "train", {"train-loss": 1.0 / rnd})
        wrote.append(recorder.end_round(rnd))
    return wrote


def written_rounds(output_dir: Path) -> list[int]:
    document = json.loads((output_dir / RESULTS_FILE).read_text())
    return [entry["round"] for entry in document["rounds"]]


def test_every_round_is_written_while_writing_is_cheap(
    tmp_path: Path, slow_writes: Clock
) -> None:
    recorder = RunRecorder(tmp_path, meta={}, target=0.9, clock=slow_writes)
    wrote = run_rounds(recorder, slow_writes, 20)
    # A write of 20 rounds takes 20 ms: 2% of a 1 s round, within the share.
    assert all(wrote)
    assert recorder.writes == 20
    assert written_rounds(tmp_path) == list(range(1, 21))


def test_a_growing_file_is_written_within_its_share_of_the_run(
    tmp_path: Path, slow_writes: Clock
) -> None:
    recorder = RunRecorder(tmp_path, meta={}, target=0.9, clock=slow_writes)
    wrote = run_rounds(recorder, slow_writes, 1000)
    writes = sum(wrote)
    assert recorder.writes == writes
    # Writing after every round would take sum(1..1000) ms = 500 s beside 1000 s
    # of rounds; within 2% it is at most 2% of the run plus the last write.
    write_s = sum(0.001 * rnd for rnd, w in enumerate(wrote, start=1) if w)
    assert write_s <= 0.02 * slow_writes.now + 1.0
    # Each write waits 49x its own length: about 20 + ln(1000/20)/0.049 writes.
    assert 80 < writes < 110
    # Skipped rounds are not lost: the next write holds them, a flush all.
    last = max(rnd for rnd, w in enumerate(wrote, start=1) if w)
    assert written_rounds(tmp_path) == list(range(1, last + 1))
    assert last < 1000
    recorder.flush()
    assert written_rounds(tmp_path) == list(range(1, 1001))


def test_every_write_and_no_write_are_the_two_ends_of_the_share(
    tmp_path: Path, slow_writes: Clock
) -> None:
    every = RunRecorder(
        tmp_path / "every", meta={}, target=0.9, clock=slow_writes, write_share=1.0
    )
    assert all(run_rounds(every, slow_writes, 200))
    never = RunRecorder(
        tmp_path / "never", meta={}, target=0.9, clock=slow_writes, write_share=0.0
    )
    assert not any(run_rounds(never, slow_writes, 5))
    assert not (tmp_path / "never" / RESULTS_FILE).exists()
    never.flush()
    assert written_rounds(tmp_path / "never") == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan")])
def test_a_share_outside_0_1_is_refused_by_name(tmp_path: Path, share: float) -> None:
    with pytest.raises(ValueError, match="write_share"):
        RunRecorder(tmp_path, meta={}, target=0.9, write_share=share)


def restored(state: Mapping[str, Any], tmp_path: Path, up_to: int) -> RunRecorder:
    """A new recorder restored from ``state`` through a real checkpoint file."""
    write_checkpoint(tmp_path / "ckpt", {"results": dict(state)})
    saved = read_checkpoint(tmp_path / "ckpt")["results"]
    again = RunRecorder(tmp_path / "again", meta={}, target=0.9)
    again.restore(saved, up_to=up_to)
    return again


def test_a_checkpoint_keeps_every_value_of_every_round(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path, meta={"strategy": "FedDC"}, target=0.9)
    values = {
        "nan": float("nan"),
        "inf": float("inf"),
        "float32": np.float32(0.1),
        "int64": np.int64(7),
        "list": [1, 2.5, None],
        "text": "ok",
    }
    for rnd in (1, 2, 3):
        recorder.record(rnd, "train", values)
        recorder.end_round(rnd)
    again = restored(recorder.state(), tmp_path, up_to=2)
    assert sorted(again.rounds) == [1, 2]
    train = again.rounds[2]["train"]
    assert math.isnan(train["nan"]) and train["inf"] == math.inf
    assert train["float32"] == float(np.float32(0.1))  # the float32's exact value
    assert train["int64"] == 7 and isinstance(train["int64"], int)
    assert train["list"] == [1, 2.5, None] and train["text"] == "ok"
    assert again.rounds[2]["elapsed-s"] == recorder.rounds[2]["elapsed-s"]


def test_a_round_recorded_again_is_encoded_again(tmp_path: Path) -> None:
    clock = Clock()
    recorder = RunRecorder(tmp_path, meta={}, target=0.9, clock=clock)
    recorder.record(1, "train", {"loss": 1.0})
    clock.now = 1.0
    recorder.end_round(1)
    recorder.state()  # round 1 encoded
    recorder.record(1, "evaluate", {"accuracy": 0.5})
    assert restored(recorder.state(), tmp_path / "a", 1).rounds[1]["evaluate"] == {
        "accuracy": 0.5
    }
    clock.now = 2.0
    recorder.end_round(1)  # stamped again
    assert restored(recorder.state(), tmp_path / "b", 1).rounds[1]["elapsed-s"] == 2.0


def test_a_checkpoint_that_holds_its_rounds_as_a_list_still_restores(
    tmp_path: Path,
) -> None:
    # Checkpoints written before the rounds were kept as one JSON text.
    old = {
        "meta": {"strategy": "FedAvg"},
        "rounds": [
            {"round": r, "train": {"loss": np.float64(1.0 / r)}} for r in (1, 2)
        ],
        "elapsed-s": 3.0,
    }
    again = restored(old, tmp_path, up_to=2)
    assert [again.rounds[r]["train"]["loss"] for r in (1, 2)] == [1.0, 0.5]
    assert again.elapsed_before == 3.0

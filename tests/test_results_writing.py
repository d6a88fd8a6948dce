"""``results.json`` is rewritten as rounds end, within a share of the run's time.

Each write holds every round so far, so a write after every round would make
a run of R rounds spend R^2/2 rounds' worth of writing. The recorder writes
after every round while that is cheap and as often as ``write_share`` allows
once it is not; a flush (the run's end, a failure, a resume) always writes.
The clock here is the test's own: a round lasts what the test says, and a
write lasts what the file's size says.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from flwr_prox_strategies.experiment import results as results_module
from flwr_prox_strategies.experiment.results import RESULTS_FILE, RunRecorder


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

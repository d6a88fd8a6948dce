"""A long run's record: ``results.json`` and the checkpoint, over thousands of rounds.

Both hold every round so far, so each write grows with the round number, and
writing as every round ends costs a run of R rounds R^2/2 rounds' worth of
writing. The pack's ``RunRecorder`` rewrites ``results.json`` after every round
while that takes at most ``write_share`` (2%) of the run's time and as often as
that allows once it does not (the end of a run, a failure and a resume always
write), and gives a checkpoint its rounds as one JSON text, each round encoded
once when it ends. Side by side in one run, the same rounds recorded both ways
(before: ``write_share=1.0``, after every round, and a checkpoint document
holding the rounds as a list, which the checkpoint file encodes value by value
at every write; now: the default 0.02 and ``RunRecorder.state()``), each round a
real round's entries (26 train metrics, the timing, the central evaluation;
about 1 KB a round, as in ``benchmarks/scale.py``'s results) and a 0.8 MB model
in the checkpoint (the scale runs' MLP), written to real files, on a clock that
adds ``--round-s`` of simulated round to the real time the recorder spends; a
checkpoint every round (what stateful strategies need to resume). Printed per
run length and way: the ``results.json`` writes, their total seconds, their
share of the run, the last write's milliseconds and the most rounds the file
was behind; the checkpoints' total seconds and the last one's milliseconds.

Run: ``python benchmarks/results_writing.py [--rounds 200 1000 2000]
[--round-s 0.25]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from flwr_prox_strategies.experiment.results import RunRecorder
from flwr_prox_strategies.experiment.store.checkpoint_file import write_checkpoint


class SimulatedRounds:
    """A run's clock: real time, plus ``round_s`` for every round that passed."""

    def __init__(self, round_s: float) -> None:
        self.round_s = round_s
        self.rounds = 0

    def __call__(self) -> float:
        return time.monotonic() + self.rounds * self.round_s


def round_entries(rnd: int) -> dict[str, dict[str, float]]:
    """A round's sections as the pack's app records them (values vary by round)."""
    return {
        "train": {f"train-metric-{i:02d}": 0.1234567 * i / rnd for i in range(26)},
        "central": {"accuracy": 0.5 + 0.4 * rnd / (rnd + 10), "loss": 1.0 / rnd},
        "timing": {
            "round-s": 0.25,
            "grid-s": 0.238,
            "strategy-s": 0.005,
            "central-s": 0.0,
            "write-s": 0.005,
        },
    }


def measure(rounds: int, round_s: float, before: bool) -> dict[str, float]:
    """Record ``rounds`` rounds the ``before`` way or now; time the writes."""
    clock = SimulatedRounds(round_s)
    model = np.random.default_rng(0).standard_normal(199_210).astype(np.float32)
    with tempfile.TemporaryDirectory() as folder:
        recorder = RunRecorder(
            Path(folder),
            meta={"strategy": "FedDC", "num-rounds": rounds},
            target=0.9,
            write_share=1.0 if before else 0.02,
            clock=clock,
        )
        write_s = last_ms = checkpoint_s = checkpoint_ms = 0.0
        behind = last_written = 0
        for rnd in range(1, rounds + 1):
            clock.rounds += 1
            for section, metrics in round_entries(rnd).items():
                recorder.record(rnd, section, metrics)
            started = time.perf_counter()
            wrote = recorder.end_round(rnd)
            spent = time.perf_counter() - started
            if wrote:
                write_s += spent
                last_ms = spent * 1e3
                last_written = rnd
            behind = max(behind, rnd - last_written)
            started = time.perf_counter()
            results = (
                {
                    "meta": dict(recorder.meta),
                    "rounds": [recorder.rounds[r] for r in sorted(recorder.rounds)],
                    "elapsed-s": recorder.elapsed(),
                }
                if before
                else recorder.state()
            )
            write_checkpoint(Path(folder), {"model": model, "results": results})
            checkpoint_ms = (time.perf_counter() - started) * 1e3
            checkpoint_s += checkpoint_ms / 1e3
        run_s = clock() - recorder.start
    return {
        "writes": recorder.writes,
        "write-s": write_s,
        "share": write_s / run_s,
        "last-ms": last_ms,
        "behind": behind,
        "checkpoint-s": checkpoint_s,
        "checkpoint-ms": checkpoint_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, nargs="+", default=[200, 1000, 2000])
    parser.add_argument("--round-s", type=float, default=0.25)
    args = parser.parse_args()
    print(
        f"{'rounds':>7} {'way':>7} {'writes':>7} {'write s':>8} {'share':>6} "
        f"{'last ms':>8} {'behind':>7} {'ckpt s':>7} {'ckpt ms':>8}"
    )
    for rounds in args.rounds:
        for name, before in (("before", True), ("now", False)):
            m = measure(rounds, args.round_s, before)
            print(
                f"{rounds:>7} {name:>7} {m['writes']:>7.0f} {m['write-s']:>8.2f} "
                f"{m['share']:>6.1%} {m['last-ms']:>8.1f} {m['behind']:>7.0f} "
                f"{m['checkpoint-s']:>7.2f} {m['checkpoint-ms']:>8.1f}"
            )


if __name__ == "__main__":
    main()

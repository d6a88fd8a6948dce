"""Fault run on a real loopback deployment: a SuperNode dies and restarts.

One SuperLink and 4 SuperNodes on 127.0.0.1 (tests/system/engine.py starts and
stops them by process group). `flwr run` of the pack's app runs a stateful
strategy for ROUNDS rounds; after round 2 SuperNode 1 is SIGKILLed, and a new
SuperNode for the same partition is started (new node id, empty context.state,
no state_dir: its client state is lost); after round 5 a fifth SuperNode joins.
The script prints what the run logged about each event, how long Flower took to
answer for the dead node, the rounds and their valid/failed replies, and the
run's final status. Nothing else should run beside it.

    python benchmarks/faults.py --strategy scaffold
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flwr_prox_strategies.experiment.checkpoint import read_checkpoint
from tests.system.engine import deployment, rounds_done, run_log

ROUNDS = 9


def wait_for_round(output: Path, target: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while rounds_done(output) < target:
        if time.monotonic() > deadline:
            raise TimeoutError(f"round {target} not reached")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="scaffold")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="faults", dir="/tmp"))
    output = home / "out"
    results = output / "results.json"
    with deployment(home / "flwr", num_nodes=4) as dep:
        overrides = (
            f"strategy={args.strategy} num_clients=4 num_rounds={ROUNDS} "
            "model=logreg train.local_epochs=1 quorum=2"
        )
        run_id = dep.submit(
            f"overrides='{overrides}' output-dir='{output}'", timeout=120
        )
        start = time.monotonic()
        wait_for_round(output, 2)
        victim = dep.procs[2]  # procs[0] is the SuperLink; procs[2] holds partition 1
        os.killpg(os.getpgid(victim.pid), signal.SIGKILL)
        killed_at = time.monotonic() - start
        dep.start_supernode(1, 4, folder="supernode1-restarted")
        status = dep.wait_finished(run_id)
        total = time.monotonic() - start
        log = run_log(run_id, dep.env, dep.connection)
    data = json.loads(results.read_text())
    print(f"strategy {args.strategy}: status {status}, {total:.1f} s in all")
    if status != "finished:completed":  # a failed run must not look like success
        print(log[-3000:])
        raise SystemExit(f"the run ended {status}")
    print(f"SuperNode of partition 1 SIGKILLed at {killed_at:.1f} s (after round 2)")
    for row in data["rounds"][1:]:
        train = row.get("train", {})
        print(
            f"  round {row['round']:2d}: valid {train.get('replies-valid')}, "
            f"failed {train.get('replies-failed')}, rejected "
            f"{train.get('replies-rejected')}, elapsed {row.get('elapsed-s', 0):.1f} s,"
            f" accuracy {row.get('central', {}).get('accuracy', float('nan')):.4f}"
        )
    checkpoint = read_checkpoint(output)["strategy"]
    print(
        f"  strategy state: K={checkpoint['num-clients']} "
        f"({checkpoint['num-clients-source']}), retired states "
        f"{checkpoint['retired-states']}, client keys seen "
        f"{checkpoint['client-keys-seen']}"
    )
    (home / "run.log").write_text(log)
    print(f"  run log: {home / 'run.log'}")
    for pattern in (
        r"node \d+ .*(?:unavailable|dead|stands for).*",
        r"client \d+ \(node \d+\) holds .*",
        r"K grows .*",
    ):
        for line in re.findall(pattern, log)[:3]:
            print("  log:", line[:220])


if __name__ == "__main__":
    main()

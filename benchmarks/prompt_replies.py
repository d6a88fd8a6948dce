"""Seconds a round on a real loopback deployment, replies pulled promptly or not.

The pack's app pulls replies as they arrive in simulation
(``prompt_replies=auto``, the default), where Flower's grid pulls every 0.1 s.
In a deployment, the ServerApp's ``HttpGrid`` sleeps 3 s between pulls, and
``auto`` leaves it so; ``true`` pulls promptly there too. This measures what
that would gain. Side by side in one run: the same SCAFFOLD run
(2 SuperNodes, logistic regression on the digits, one local epoch, federated
evaluation on every node, 5 rounds) on a fresh insecure loopback deployment
(SuperLink and SuperNodes as separate processes), once with each setting.
Printed per setting: each round's seconds (``timing.round-s`` in
``results.json``), the mean of rounds 2-5, and the final central accuracy.

Run: ``python benchmarks/prompt_replies.py`` (about 3 min; nothing else
running). Figures: ``benchmarks/README.md``, "Thousands of clients".
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.system.engine import deployment

ROUNDS = 5
OVERRIDES = (
    f"strategy=scaffold num_clients=2 num_rounds={ROUNDS} model=logreg "
    "train.local_epochs=1 evaluate.fraction_clients=1.0"
)


def seconds_a_round(prompt: bool) -> tuple[list[float], float]:
    """Each round's seconds and the final accuracy of one deployed run."""
    home = Path(tempfile.mkdtemp(prefix="prompt-replies-"))
    out = home / "out"
    setting = str(prompt).lower()
    with deployment(home / "flwr", 2) as running:
        run_id = running.submit(
            f"overrides='{OVERRIDES} prompt_replies={setting}' output-dir='{out}'"
        )
        running.wait_finished(run_id, time.monotonic() + 600, out)
    rounds = json.loads((out / "results.json").read_text())["rounds"]
    seconds = [r["timing"]["round-s"] for r in rounds if r.get("timing")]
    if len(seconds) != ROUNDS:
        raise RuntimeError(f"prompt_replies={setting}: {len(seconds)} rounds timed")
    return seconds, float(rounds[-1]["central"]["accuracy"])


def main() -> None:
    print(f"{'prompt_replies':<16}{'mean s (2-5)':>13}  rounds (s)  final accuracy")
    for prompt in (False, True):
        seconds, accuracy = seconds_a_round(prompt)
        mean = sum(seconds[1:]) / (len(seconds) - 1)
        rounds = " ".join(f"{s:.2f}" for s in seconds)
        print(f"{str(prompt).lower():<16}{mean:>13.2f}  {rounds}  {accuracy:.4f}")


if __name__ == "__main__":
    main()

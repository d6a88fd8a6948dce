"""Seconds per round of secure aggregation on a real deployment, against plain rounds.

The deployment of the secure-aggregation system test: one SuperLink and 5
SuperNodes on 127.0.0.1 (``flower-superlink``, ``flower-supernode``, each
message handled by a new ClientApp process), the pack's app (``flwr run .``),
SCAFFOLD on logistic regression over the digits, 5 clients, 8 local epochs.
Three runs, one after the other:

* ``plain``: no secure aggregation;
* ``secaggplus``: ``secure_aggregation=secaggplus`` (four stages a round:
  setup, share_keys, collect_masked_vectors, unmask);
* ``active-adversary``: the same with ``secure_aggregation.active_adversary=true``
  (signed keys and a signed survivor set: a fifth stage).

The first two share one deployment; the third has its own, every SuperNode
given a signing key and the key directory in its node config (a SuperNode
holding a signing key refuses rounds without the consistency check, so the
two settings cannot share SuperNodes).

A round's time is the difference of the ``elapsed-s`` stamps of consecutive
rounds in the run's ``results.json`` (round 1 is timed from the run's start,
so it also holds the ServerApp's start-up: it is reported apart). Reported per
run: each round's seconds, the median of rounds 2.., and its ratio to the
plain run's.

``--repo`` runs the app of another checkout (its ``flwr run .`` and its
package first on ``PYTHONPATH``): how the figures before a change were taken.

Run: ``python benchmarks/secagg_deployment.py [--rounds 4] [--repo PATH]``;
writes ``benchmarks/results/secagg/deployment.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.system import engine  # noqa: E402

NODES = 5
BASE = (
    f"strategy=scaffold num_clients={NODES} model=logreg train.local_epochs=8 "
    "quorum=5 node_wait_timeout=30"
)
RUNS = {
    "plain": "",
    "secaggplus": "secure_aggregation=secaggplus",
    "active-adversary": (
        "secure_aggregation=secaggplus secure_aggregation.active_adversary=true"
    ),
}


def round_seconds(results: dict) -> list[float]:
    stamps = [r["elapsed-s"] for r in results["rounds"]]
    return [b - a for a, b in itertools.pairwise(stamps)]


def _run(dep: engine.Deployment, name: str, output: Path, rounds: int) -> dict:
    overrides = f"{BASE} num_rounds={rounds} {RUNS[name]}".strip()
    started = time.monotonic()
    run_id = dep.submit(f"overrides='{overrides}' output-dir='{output}'")
    status = dep.wait_finished(run_id, started + 1800, output)
    results = json.loads((output / "results.json").read_text())
    seconds = round_seconds(results)
    figures = {
        "status": status,
        "complete": results["summary"]["complete"],
        "round-s": [round(s, 2) for s in seconds],
        "median-after-round-1-s": statistics.median(seconds[1:]),
        "accuracy": results["rounds"][-1]["central"]["accuracy"],
    }
    print(f"{name}: {status}, rounds {figures['round-s']} s", flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repo", type=Path, default=ROOT)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "secagg" / "deployment.json",
    )
    args = parser.parse_args()
    repo = args.repo.resolve()
    engine.REPO = repo  # flwr run . in that checkout
    if repo != ROOT:
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(repo), os.environ.get("PYTHONPATH", "")]
        )
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="secagg-deploy") as tmp:
        folder = Path(tmp)
        keys, trusted = engine.make_signing_keys(folder / "keys", NODES)

        def signed(i: int) -> str:
            return f'secagg-signing-key="{keys[i]}" secagg-key-directory="{trusted}"'

        keyless = [n for n in args.runs if n != "active-adversary"]
        keyed = [n for n in args.runs if n == "active-adversary"]
        for names, node_config in ((keyless, None), (keyed, signed)):
            if not names:
                continue
            with engine.deployment(
                folder / f"flwr-{names[0]}", num_nodes=NODES, node_config=node_config
            ) as dep:
                for name in names:
                    figures[name] = _run(dep, name, folder / name, args.rounds)
    plain = figures.get("plain", {}).get("median-after-round-1-s")
    print(
        f"\n{NODES} SuperNodes on loopback, SCAFFOLD, {args.rounds} rounds; repo {repo}"
    )
    print(
        f"{'run':<18} {'round 1 s':>10} {'median 2.. s':>13} {'x plain':>8} {'accuracy':>9}"
    )
    for name, f in figures.items():
        ratio = f["median-after-round-1-s"] / plain if plain else float("nan")
        f["x-plain"] = ratio
        print(
            f"{name:<18} {f['round-s'][0]:>10.1f} {f['median-after-round-1-s']:>13.1f} "
            f"{ratio:>8.2f} {f['accuracy']:>9.4f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"repo": str(repo), "rounds": args.rounds, "runs": figures}, indent=2
        )
    )


if __name__ == "__main__":
    main()

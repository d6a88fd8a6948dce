"""Import time of the pack against the floor: torch + Flower's app modules.

``import flwr_prox_strategies`` needs torch and Flower's ServerApp/ClientApp
modules anyway; what the pack adds on top is its own code. Each import runs in
a fresh interpreter (``python -c``), timed from the parent process (interpreter
start-up included, the same for both), several repeats interleaved, median
reported; the modules loaded are counted too, and the optional heavy ones
(opacus, cvxpy, Hydra, ...) listed when present.

Run: ``python benchmarks/import_time.py [--repeats 7]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

STATEMENTS = {
    "torch + flwr.serverapp + flwr.clientapp": "import torch, flwr.serverapp, flwr.clientapp",
    "flwr_prox_strategies": "import flwr_prox_strategies",
}
OPTIONAL = (
    "opacus",
    "cvxpy",
    "hydra",
    "matplotlib",
    "sklearn",
    "datasets",
    "pandas",
    "ray",
)
PROBE = (
    "import json, logging, sys; handlers = len(logging.getLogger().handlers); {stmt}; "
    "print(json.dumps({{'modules': len(sys.modules), 'root-handlers-added': "
    "len(logging.getLogger().handlers) - handlers, 'optional': [m for m in {optional!r} "
    "if m in sys.modules]}}))"
)


def time_once(statement: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True)
    return time.perf_counter() - start


def probe(statement: str) -> dict:
    code = PROBE.format(stmt=statement, optional=OPTIONAL)
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    empty = [time_once("pass") for _ in range(3)]
    for statement in STATEMENTS.values():  # warm the file cache
        time_once(statement)
    times: dict[str, list[float]] = {name: [] for name in STATEMENTS}
    for _ in range(args.repeats):
        for name, statement in STATEMENTS.items():
            times[name].append(time_once(statement))

    print(
        f"python {sys.version.split()[0]}; {args.repeats} fresh interpreters each, median"
    )
    print(f"empty interpreter: {statistics.median(empty):.3f} s (included below)")
    print(
        f"{'import':42s} {'median s':>9s} {'min s':>7s} {'max s':>7s} {'modules':>8s}  optional loaded"
    )
    for name, statement in STATEMENTS.items():
        info = probe(statement)
        values = times[name]
        print(
            f"{name:42s} {statistics.median(values):9.3f} {min(values):7.3f} "
            f"{max(values):7.3f} {info['modules']:8d}  {info['optional'] or '-'}"
            + (
                f"  (+{info['root-handlers-added']} root log handlers)"
                if info["root-handlers-added"]
                else ""
            )
        )
    floor, pack = (statistics.median(times[name]) for name in STATEMENTS)
    print(f"the pack adds {pack - floor:+.3f} s ({pack / floor:.2f}x the floor)")
    # Other work on the machine shows here: compare figures taken near load 0.
    print(
        f"1-min load average: {load_before:.2f} before, {os.getloadavg()[0]:.2f} after"
    )


if __name__ == "__main__":
    main()

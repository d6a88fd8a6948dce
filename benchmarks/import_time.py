"""Import time of the pack against the floor: torch + Flower's app modules.

``import flwr_prox_strategies`` needs torch and Flower's ServerApp/ClientApp
modules anyway; what the pack adds on top is its own code. Each import runs in
a fresh interpreter (``python -c``), timed from the parent process (interpreter
start-up included, the same for both), several repeats interleaved, median
reported; the modules loaded are counted too, and the optional heavy ones
(opacus, cvxpy, Hydra, ...) listed when present.

Also a ServerApp's start (its modules, the configuration, the initial model),
with the model built in a child process as the pack's ServerApp does, against
torch loaded in its own process: the time and the process's own peak memory.

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

FLOOR = "torch + flwr.serverapp + flwr.clientapp"
PACK = "FedProx + FedProxClient"  # a strategy and its client (torch)
# A ServerApp's start: its modules, the configuration and the initial model, built
# in a child process (its own process never loads torch) or in process.
_START = (
    "from flwr_prox_strategies.experiment.build import initial_arrays; "
    "from flwr_prox_strategies.experiment.config import compose_config; "
    "initial_arrays(compose_config(['model=mlp'], locate=False))"
)
SERVER_CHILD = "ServerApp start, initial model in a child"
SERVER_HERE = "ServerApp start, torch in its process"
STATEMENTS = {
    FLOOR: "import torch, flwr.serverapp, flwr.clientapp",
    PACK: "from flwr_prox_strategies import FedProx, FedProxClient",
    SERVER_CHILD: _START,
    SERVER_HERE: f"import torch; {_START}",
}
OPTIONAL = (
    "torch",
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
    "import json, logging, resource, sys; handlers = len(logging.getLogger().handlers); "
    "{stmt}; print(json.dumps({{'modules': len(sys.modules), 'peak-mb': "
    "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 'root-handlers-added': "
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
        f"{'import':42s} {'median s':>9s} {'min s':>7s} {'max s':>7s} {'modules':>8s} "
        f"{'peak MB':>8s}  optional loaded"
    )
    for name, statement in STATEMENTS.items():
        info = probe(statement)
        values = times[name]
        print(
            f"{name:42s} {statistics.median(values):9.3f} {min(values):7.3f} "
            f"{max(values):7.3f} {info['modules']:8d} {info['peak-mb']:8.0f}  "
            f"{info['optional'] or '-'}"
            + (
                f"  (+{info['root-handlers-added']} root log handlers)"
                if info["root-handlers-added"]
                else ""
            )
        )
    floor, pack = (statistics.median(times[name]) for name in (FLOOR, PACK))
    print(f"the pack adds {pack - floor:+.3f} s ({pack / floor:.2f}x the floor)")
    child, here = (statistics.median(times[n]) for n in (SERVER_CHILD, SERVER_HERE))
    print(f"a ServerApp without torch starts {child - here:+.3f} s later")
    # Other work on the machine shows here: compare figures taken near load 0.
    print(
        f"1-min load average: {load_before:.2f} before, {os.getloadavg()[0]:.2f} after"
    )


if __name__ == "__main__":
    main()

"""One hash per run of what a tree computes: models, metrics, checkpoints.

A refactoring that claims "bit-identical behaviour" runs this on the code before
and after and compares the lines: each run of the pack's experiment (in this
process's engine, a few rounds, every strategy and the options that change a
round: stragglers, the dissimilarity monitor, the learning-rate decay, Bernoulli
participation, federated evaluation, DP-SGD) is reduced to the SHA-256 of its
``results.json`` without wall-clock times, and of its checkpoint (the model, the
server state, the clients' state and commit bookkeeping, the privacy ledger; not
the process's unseeded global generators, the save time, the run's random tag or the
folder it was written to).

Run: ``python benchmarks/behaviour_fingerprint.py [--only fedprox]``; to compare two
trees, run it with ``PYTHONPATH=<other tree>`` as well and ``diff`` the outputs.

A change that adds keys to results.json or the config on purpose changes both hashes
while computing the same models. ``--compare A B`` then compares two output folders
(``--out`` of each tree) array by array: every array of every checkpoint (model,
server state, clients' state; not the generators' state) and the central evaluation
of every round.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

SMALL = ["num_clients=6", "num_rounds=3", "train.local_epochs=2"]
RUNS: dict[str, list[str]] = {
    **{
        name: [f"strategy={name}"]
        for name in (
            "fedavg",
            "fedprox",
            "feddyn",
            "feddc",
            "scaffold",
            "apfl",
            "fedepm",
            "sfedavg",
            "sfedprox",
            "pfedavg",
        )
    },
    "fedprox-stragglers-monitor-decay": [
        "strategy=fedprox",
        "strategy.drop_percent=0.5",
        "strategy.monitor_dissimilarity=true",
        "train.lr_decay=0.9",
    ],
    "fedavg-stragglers-dropped": ["strategy=fedavg", "strategy.drop_percent=0.5"],
    "feddyn-bernoulli-evaluate": [
        "strategy=feddyn",
        "+strategy.participation=bernoulli",
        "strategy.fraction_train=0.5",
        "evaluate.fraction_clients=0.5",
    ],
    "fedavg-dp-sgd": ["strategy=fedavg", "privacy=dp-sgd"],
    # The same FedProx run through `flwr run` (Ray simulation, SuperNodes).
    "fedprox-flwr-run": ["strategy=fedprox", "engine=flwr"],
}
# The checkpoint's rounds: one JSON text (a uint8 array) holding their timings too.
ROUNDS_JSON = "rounds-json"
# Keys whose values are wall-clock readings, not computed results.
CLOCK = ("timing", "elapsed-s", "wall-time-s", "round-s", "seconds", "time-s")


def without_clock(value: object) -> object:
    if isinstance(value, dict):
        return {
            k: without_clock(v)
            for k, v in value.items()
            if not any(k.endswith(c) for c in CLOCK)
        }
    if isinstance(value, list):
        return [without_clock(v) for v in value]
    return value


def clock_free(array: np.ndarray) -> np.ndarray:
    """The checkpoint's rounds (one JSON text) without their wall-clock readings."""
    rounds = without_clock(json.loads(array.tobytes().decode()))
    return np.frombuffer(json.dumps(rounds, sort_keys=True).encode(), dtype=np.uint8)


def digest(folder: Path) -> tuple[str, str]:
    results = json.loads((folder / "results.json").read_text())
    results.pop("config", None)  # the composed config: same overrides, same config
    text = json.dumps(without_clock(results), sort_keys=True)
    with np.load(folder / "checkpoint.npz", allow_pickle=False) as saved:
        arrays = {name: saved[name] for name in saved.files}
    document = json.loads(arrays["__meta__"].tobytes())["document"]
    # The process's unseeded global generators, the save time and the run's
    # random tag differ from one invocation to the next on any tree.
    for volatile in ("rng", "saved-at"):
        document.pop(volatile)
    document.pop("config", None)

    def resolve(value: object, key: str = "") -> object:
        if isinstance(value, dict) and set(value) == {"$array"}:
            array = arrays[value["$array"]]
            if key == ROUNDS_JSON:
                array = clock_free(array)
            return [
                str(array.dtype),
                list(array.shape),
                hashlib.sha256(array).hexdigest(),
            ]
        if isinstance(value, dict):  # a run's random tag (P-FedAvg: one per server)
            return {k: resolve(v, k) for k, v in value.items() if k != "run-tag"}
        if isinstance(value, list):
            return [resolve(v) for v in value]
        if isinstance(value, str):  # the client-state folder: where --out put it
            return value.replace(str(folder), "<run folder>")
        return value

    state = json.dumps(resolve(without_clock(document)), sort_keys=True)
    return (
        hashlib.sha256(text.encode()).hexdigest()[:16],
        hashlib.sha256(state.encode()).hexdigest()[:16],
    )


def arrays_of(folder: Path) -> dict[str, np.ndarray]:
    """The checkpoint's arrays by their place in its document (no generator state)."""
    with np.load(folder / "checkpoint.npz", allow_pickle=False) as saved:
        arrays = {name: saved[name] for name in saved.files}
    document = json.loads(arrays["__meta__"].tobytes())["document"]
    found: dict[str, np.ndarray] = {}

    def walk(value: object, path: str) -> None:
        if isinstance(value, dict) and set(value) == {"$array"}:
            array = arrays[value["$array"]]
            found[path] = clock_free(array) if path.endswith(ROUNDS_JSON) else array
        elif isinstance(value, dict):
            for key, item in value.items():
                if key not in ("rng", "saved-at"):
                    walk(item, f"{path}/{key}")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]")

    walk(document, "")
    return found


def compare(first: Path, second: Path) -> bool:
    """Print, per run, whether two trees' outputs hold the same arrays and metrics."""
    same = True
    for folder in sorted(p for p in first.iterdir() if (p / "job").is_dir()):
        a, b = folder / "job", second / folder.name / "job"
        left, right = arrays_of(a), arrays_of(b)
        differ = sorted(
            k
            for k in left.keys() | right.keys()
            if k not in left or k not in right or not np.array_equal(left[k], right[k])
        )
        central = [
            [
                r.get("central")
                for r in json.loads((f / "results.json").read_text())["rounds"]
            ]
            for f in (a, b)
        ]
        ok = not differ and central[0] == central[1]
        same &= ok
        print(
            f"{folder.name:36s} {len(left):3d} arrays, {len(differ)} differ"
            f"{' ' + str(differ[:3]) if differ else ''}; central evaluation "
            f"{'identical' if central[0] == central[1] else 'DIFFERS'}"
        )
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="run names to run")
    # Results name their folder: two trees must write to the same one.
    parser.add_argument("--out", type=Path, default=Path("/tmp/behaviour-fingerprint"))
    parser.add_argument(
        "--compare", nargs=2, type=Path, metavar=("A", "B"), help="two --out folders"
    )
    args = parser.parse_args()
    if args.compare:
        sys.exit(0 if compare(*args.compare) else 1)
    shutil.rmtree(args.out, ignore_errors=True)
    if True:
        tmp = args.out
        for name, overrides in RUNS.items():
            if args.only and name not in args.only:
                continue
            folder = Path(tmp) / name
            if "engine=flwr" in overrides:  # a single run goes through `flwr run`
                where = [f"hydra.run.dir={folder / 'job'}"]
            else:  # a one-job sweep runs in this process's engine
                where = ["-m", "engine=inprocess", f"hydra.sweep.dir={folder}"]
                where.append("hydra.sweep.subdir=job")
            command = [
                sys.executable,
                "-m",
                "flwr_prox_strategies.experiment",
                *where,
                *SMALL,
                *(o for o in overrides if o != "engine=flwr"),
            ]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"{name:36s} FAILED: {done.stderr.strip().splitlines()[-1:]}")
                continue
            results, checkpoint = digest(folder / "job")
            print(f"{name:36s} results {results}  checkpoint {checkpoint}", flush=True)


if __name__ == "__main__":
    main()

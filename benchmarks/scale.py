"""Thousands of simulated SuperNodes, 10 sampled a round: the pack against Flower's FedAvg.

Every case is one ``flwr run`` simulation on a private managed SuperLink (its own
``FLWR_HOME``, ports and Ray folder), ``client-resources-num-cpus=1`` (two Ray
actors on 2 cores), side by side in one run:

``flower``
    Flower's own ``FedAvg`` (``benchmarks/scale_app``) with a trivial client that
    keeps two model-sized arrays in ``context.state`` (a FedDC-sized client
    state), on the MLP 784-200-200-10 (0.8 MB).
``flower+payload``
    The same app carrying SCAFFOLD's and FedDC's extra records: a model-sized
    ``control`` record sent with the model and one back in every reply,
    averaged by Flower's own ``aggregate_arrayrecords``. The pack's SCAFFOLD
    and FedDC are priced against it (``x payload``): what moving their
    payload costs on Flower's engine, apart from the pack's own work.
``flower+payload+train``
    The same, with each client training the MLP as Flower's PyTorch
    quickstart does: the same local epoch, batch size and learning rate as the
    pack's cases, on the node's iid share of the same Fashion-MNIST. The pack's
    SCAFFOLD and FedDC are priced against it too (``x trained``): the payload
    and the computation any real client pays, so that what is left is the
    pack's own machinery (its rule, its state, its checks).
``pack:<strategy>``
    The pack's app (``flwr run .``) on Fashion-MNIST (iid), the same MLP, each
    client one local epoch in batches of 64 (``train.local_epochs=1
    train.batch_size=64``: one SGD step on its 60 samples at 1,000 nodes, on its
    6 at 10,000; SCAFFOLD, FedDyn and FedDC count epochs, not steps): almost no
    computation, the pack's real client and
    client-state handling. No central evaluation and no checkpoint unless the
    case says ``+central`` / ``+checkpoint``, so that the differences between
    cases split the pack's round into its parts.
``pack:<strategy>+disk``
    The same with ``client_state=disk``: the clients keep their state in
    ``<output-dir>/client-state`` only, not in Flower's ``context.state``, so
    the simulation process holds no node's state (a file read and written per
    call instead).
``pack:<strategy>...+fixed-poll``
    The same with ``prompt_replies=false``: replies pulled at the simulation
    grid's fixed 0.1 s cadence, as Flower's cases are, not as they arrive.

Printed per case: seconds per round (mean over rounds 2..R, from the time each
round ended: ``elapsed-s`` in the pack's ``results.json``, the evaluate
callback's clock in Flower's app) and its standard error (``se``: a round lasts
a whole number of the grid's 0.1 s polls, so 30 rounds know their mean to about
4%; ``--rounds 200`` to about 1.5%), the first round, the peak memory (RSS) of the
simulation process (ServerApp, Ray driver and Flower's node contexts) and of all
the run's processes (sampled every 0.5 s), and the size of ``results.json``.

With ``--breakdown``, each round is also split into its parts: the pack's
``results.json`` records ``timing`` per round (waiting for replies, strategy,
central evaluation, writing); one ClientApp call of each case is timed in this
process, which splits the wait into client work and engine; and the MB of
``context.state`` a trained node holds is printed.

Run: ``python benchmarks/scale.py [--nodes 1000 10000] [--rounds 30]
[--cases ...] [--repeats N] [--breakdown]`` (nothing else running: it times rounds). Figures:
``benchmarks/README.md``, "Thousands of clients".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from math import nan
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flwr_prox_strategies._executables import flower_env, flower_executable
from flwr_prox_strategies.pfedavg_deploy.deployment import free_port
from tests.system.engine import run_captured

ROOT = Path(__file__).resolve().parents[1]
FLOWER_APP = ROOT / "benchmarks" / "scale_app"
OUT = ROOT / "benchmarks" / "results" / "scale"
PER_ROUND = 10
# FedEPM's dense table (the official code's) at 1,000 nodes: 7 GB for the ServerApp.
DENSE_FEDEPM_NODES = 2_000
ACTORS = 2  # client-resources-num-cpus=1 on 2 cores
# The parts of a round the pack's results.json records (``timing``).
PARTS = ("grid-s", "strategy-s", "central-s", "write-s")

FEDEPM = "strategy.k0=1 strategy.eta=10 strategy.noise=0"
# case -> pack overrides (None: Flower's app)
# Flower's app cases -> its extra run config
FLOWER_CASES: dict[str, dict[str, int]] = {
    "flower": {"extra-records": 0, "train": 0},
    "flower+payload": {"extra-records": 1, "train": 0},
    "flower+payload+train": {"extra-records": 1, "train": 1},
}
CASES: dict[str, str | None] = {
    **dict.fromkeys(FLOWER_CASES),
    "pack:fedavg": "strategy=fedavg",
    "pack:fedavg+checkpoint": "strategy=fedavg checkpoint_every=1",
    "pack:fedavg+central": "strategy=fedavg evaluate.central=true",
    "pack:scaffold": "strategy=scaffold",
    "pack:feddyn": "strategy=feddyn",
    "pack:feddyn+track": "strategy=feddyn strategy.track_all_clients=true",
    "pack:feddc": "strategy=feddc",
    # The clients' state in <output-dir>/client-state only, not in context.state.
    "pack:scaffold+disk": "strategy=scaffold client_state=disk",
    "pack:feddc+disk": "strategy=feddc client_state=disk",
    # Replies pulled at Flower's fixed cadence (the app pulls them as they arrive).
    "pack:scaffold+fixed-poll": "strategy=scaffold prompt_replies=false",
    "pack:feddc+disk+fixed-poll": "strategy=feddc client_state=disk prompt_replies=false",
    # APFL and FedEPM count local steps in their own keys (tau, k0): one step.
    # FedEPM's paper eta, r0 and noise (tuned for logistic regression) make
    # the MLP's loss 1e12 by round 2 and NaN after, every reply then refused:
    # eta=10 bounds its step by 0.1, noise off.
    "pack:apfl": "strategy=apfl strategy.sync_gap=1",
    "pack:fedepm": f"strategy=fedepm {FEDEPM}",
    "pack:fedepm+seen": f"strategy=fedepm {FEDEPM} strategy.table=seen",
}
# the pack's cases priced against the payload cases (two model-sized records each
# way): every SCAFFOLD and FedDC case
PAYLOAD_CASES = tuple(
    case
    for case, overrides in CASES.items()
    if overrides and overrides.split()[0] in ("strategy=scaffold", "strategy=feddc")
)


def fashion_dir() -> Path:
    """The Fashion-MNIST folder the pack reads (Flower's trained client reads it too)."""
    from flwr_prox_strategies.task.datasets import candidate_dirs

    for folder in candidate_dirs("fashion-mnist"):
        if (folder / "train-images-idx3-ubyte.gz").is_file():
            return folder
    raise FileNotFoundError("Fashion-MNIST not found (see shared/data/README.md)")


def flower_config(case: str, nodes: int, rounds: int, times: Path | str) -> dict:
    """Flower's app's run config for ``case``."""
    return {
        "num-rounds": rounds,
        "per-round": PER_ROUND,
        "num-nodes": nodes,
        "times-file": str(times),
        "data-dir": str(fashion_dir()),
        **FLOWER_CASES[case],
    }


def processes_of(home: str) -> dict[int, str]:
    """PID -> command line of every process whose environment has FLWR_HOME=home."""
    found = {}
    marker = f"FLWR_HOME={home}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
                found[int(entry.name)] = cmd.decode(errors="replace")
    return found


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A process's resident size (``VmRSS``) or its peak so far (``VmHWM``), MB."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Memory(threading.Thread):
    """Peak RSS of the simulation process (its high-water mark) and of all the run's."""

    def __init__(self, home: str) -> None:
        super().__init__(daemon=True)
        self.home, self.running = home, True
        self.peak_all = self.peak_server = 0.0

    def run(self) -> None:
        while self.running:
            procs = processes_of(self.home)
            sizes = {pid: rss_mb(pid) for pid in procs}
            self.peak_all = max(self.peak_all, sum(sizes.values()))
            # The kernel's high-water mark: a spike between two samples counts.
            server = [
                rss_mb(p, "VmHWM") for p in procs if "flwr-simulation" in procs[p]
            ]
            self.peak_server = max(self.peak_server, max(server, default=0.0))
            time.sleep(0.5)


def stop_processes(home: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in processes_of(home):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        time.sleep(2)


def round_seconds(ended: dict[int, float]) -> tuple[float, float, float]:
    """(mean seconds per round over rounds 2..R, its standard error, round 1's).

    The mean, not the median: Flower's simulation grid polls for replies every
    0.1 s, so a round lasts about a whole number of polls; a median jumps a
    poll when half the rounds cross one, the mean moves with the share of
    rounds that do. That share is what the standard error measures.
    """
    rounds = sorted(r for r in ended if r >= 1)
    gaps = [ended[r] - ended[r - 1] for r in rounds if r >= 2 and r - 1 in ended]
    first = ended[1] - ended.get(0, 0.0) if 1 in ended else float("nan")
    mean = statistics.mean(gaps) if gaps else float("nan")
    error = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else nan
    return mean, error, first


def pack_overrides(overrides: str, nodes: int, rounds: int) -> str:
    """The pack's Hydra overrides of a case at ``nodes`` SuperNodes."""
    fraction = f"strategy.rho={PER_ROUND / nodes}"
    if "fedepm" not in overrides:
        fraction = f"strategy.fraction_train={PER_ROUND / nodes}"
    everything = (
        f"{overrides} dataset=fashion-mnist partition=iid model=mlp "
        f"num_clients={nodes} num_rounds={rounds} {fraction} "
        "train.local_epochs=1 train.batch_size=64"
    )
    if "evaluate.central" not in overrides:
        everything += " evaluate.central=false"
    if "checkpoint_every" not in overrides:
        everything += " checkpoint_every=0"
    return everything


def client_call_ms(case: str, nodes: int, rounds: int) -> tuple[float, float]:
    """Median ms of one ClientApp call in this process (no engine); state MB a node.

    The state is what ``context.state`` holds for each node that has trained
    (Flower's simulation keeps every node's context in its own process).

    The same ServerApp and ClientApp as the case, on
    :class:`~flwr_prox_strategies.core.transport.inprocess.InProcessGrid`, every call
    timed; the first round's calls (imports, first optimiser) are left out,
    as each Ray actor pays them once. Torch runs on one thread, as in the
    actors (``client-resources-num-cpus=1``: Ray sets ``OMP_NUM_THREADS=1``
    in them). With this process's default, a thread a core, the calls timed
    here while other torch work ran on the machine took 0.43 s each, while
    the run's own rounds (its actors' calls) were not slowed.
    """
    import sys

    import torch
    from flwr.app import Context, RecordDict

    from flwr_prox_strategies.core.transport.inprocess import InProcessGrid

    torch.set_num_threads(1)  # as the Ray actors run it
    overrides = CASES[case]
    times: list[float] = []
    if overrides is None:
        sys.path.insert(0, str(FLOWER_APP))
        from flowerscale.client_app import app as client_app
        from flowerscale.server_app import main as server_main

        run_config: dict[str, Any] = flower_config(case, nodes, rounds, os.devnull)
    else:
        from flwr_prox_strategies.experiment.appdir import make_client_app
        from flwr_prox_strategies.experiment.server import run_experiment

        client_app = make_client_app()
        folder = Path(tempfile.mkdtemp(prefix="scale-inprocess-"))
        run_config = {
            "overrides": pack_overrides(overrides, nodes, rounds),
            "output-dir": str(folder),
        }

    def timed(message: Any, context: Any) -> Any:
        started = time.perf_counter()
        reply = client_app(message, context)
        times.append(time.perf_counter() - started)
        return reply

    grid = InProcessGrid(timed, num_nodes=nodes, run_config=run_config)
    if overrides is None:
        server_main(grid, Context(1, 0, {}, RecordDict(), run_config))  # run 1, node 0
    else:
        run_experiment(grid, run_config)
        shutil.rmtree(folder, ignore_errors=True)
    states = [state_bytes(c.state) for c in grid.contexts.values()]
    kept = [b for b in states if b]
    return (
        1000 * statistics.median(times[PER_ROUND:]),  # after round 1
        statistics.mean(kept) / 2**20 if kept else 0.0,
    )


def state_bytes(state: Any) -> int:
    """Bytes of the arrays a node's ``context.state`` holds."""
    return sum(
        array.numpy().nbytes
        for record in state.array_records.values()
        for array in record.values()
    )


def run_case(case: str, nodes: int, rounds: int) -> dict[str, Any]:
    folder = OUT / f"{nodes}" / case.replace(":", "-").replace("+", "-")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    home = tempfile.mkdtemp(prefix="flwr-scale-")
    env = flower_env()
    env.update(
        FLWR_HOME=home,
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(free_port()),
        FLWR_LOCAL_CONTROL_API_PORT=str(free_port()),
        RAY_TMPDIR=tempfile.mkdtemp(prefix="ray", dir="/tmp"),
    )
    overrides = CASES[case]
    federation = f"num-supernodes={nodes} client-resources-num-cpus=1"
    if overrides is None:
        times = folder / "times.json"
        config = flower_config(case, nodes, rounds, times)
        command = [
            *(flower_executable("flwr"), "run", str(FLOWER_APP), "--stream"),
            *("--federation-config", federation),
            "--run-config",
            " ".join(
                f"{k}='{v}'" if isinstance(v, str) else f"{k}={v}"
                for k, v in config.items()
            ),
        ]
    else:
        everything = pack_overrides(overrides, nodes, rounds)
        command = [
            *(flower_executable("flwr"), "run", str(ROOT), "--stream"),
            *("--federation-config", federation),
            "--run-config",
            f"overrides='{everything}' output-dir='{folder}'",
        ]
    memory = Memory(home)
    memory.start()
    start = time.monotonic()
    try:
        out = run_captured(command, env=env, cwd=ROOT, timeout=3600)
    finally:
        memory.running = False
        stop_processes(home)
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
    (folder / "flwr-run.log").write_text(out.stdout + out.stderr)
    wall = time.monotonic() - start
    parts: dict[str, float] = {}
    if overrides is None:
        ended = {int(k): v for k, v in json.loads(times.read_text()).items()}
        size = 0
    else:
        results = folder / "results.json"
        data = json.loads(results.read_text())
        if not data["summary"].get("complete"):
            raise RuntimeError(f"{case} at {nodes}: run not complete, see {folder}")
        idle = data.get("rounds-without-valid-reply") or []
        if idle:  # a round that aggregated nothing is fast and meaningless
            raise RuntimeError(
                f"{case} at {nodes}: rounds {idle} aggregated no valid reply "
                f"(rejections {data.get('rejections')}), see {folder}"
            )
        ended = {int(r["round"]): r["elapsed-s"] for r in data["rounds"]}
        size = results.stat().st_size
        for part in PARTS:
            values = [
                r["timing"][part]
                for r in data["rounds"]
                if int(r["round"]) >= 2 and part in r.get("timing", {})
            ]
            parts[part] = statistics.mean(values) if values else float("nan")
    if max(ended, default=0) < rounds:
        raise RuntimeError(f"{case} at {nodes}: {max(ended, default=0)} rounds")
    per_round, error, first = round_seconds(ended)
    return {
        "case": case,
        "nodes": nodes,
        "s-per-round": per_round,
        "s-per-round-se": error,
        "first-round-s": first,
        "wall-s": wall,
        "server-peak-mb": memory.peak_server,
        "all-peak-mb": memory.peak_all,
        "results-kb": size / 1024,
        **parts,
    }


def add_ratios(row: dict[str, Any], ran: Mapping[str, dict[str, Any]]) -> None:
    """Add a case's ratios to the Flower cases run beside it (NaN: none, not priced)."""
    flower = ran.get("flower")
    row["ratio"] = row["s-per-round"] / flower["s-per-round"] if flower else nan
    for key, reference in (
        ("payload", "flower+payload"),
        ("trained", "flower+payload+train"),
    ):
        payload = ran.get(reference) if row["case"] in PAYLOAD_CASES else None
        row[f"x-{key}"] = (
            row["s-per-round"] / payload["s-per-round"] if payload else nan
        )
        row[f"server-mb-x-{key}"] = (
            row["server-peak-mb"] / payload["server-peak-mb"] if payload else nan
        )


def print_repeats(rows: list[dict[str, Any]]) -> None:
    """Each case's mean seconds a round over the repeats, and its paired ratios.

    A ratio is taken within a repeat (the pack's case over the payload case
    run beside it), then averaged, with the lowest and highest of the
    repeats: on a machine whose speed drifts, a case run ten minutes later
    can be a fifth faster or slower, more than any difference measured.
    """
    print(
        f"\n{'case':28}{'nodes':>7}{'repeats':>8}{'s/round':>9}{'x payload':>10}"
        f"{'min-max':>12}{'x trained':>10}{'min-max':>12}",
        flush=True,
    )
    cases = dict.fromkeys((row["case"], row["nodes"]) for row in rows)
    for case, nodes in cases:
        runs = [r for r in rows if r["case"] == case and r["nodes"] == nodes]
        seconds = statistics.mean(r["s-per-round"] for r in runs)
        line = f"{case:28}{nodes:>7}{len(runs):>8}{seconds:9.3f}"
        for key in ("x-payload", "x-trained"):
            ratios = [r[key] for r in runs if r[key] == r[key]]  # not NaN
            if ratios:
                spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
                line += f"{statistics.mean(ratios):10.2f}{spread:>12}"
            else:
                line += f"{'':10}{'':12}"
        print(line, flush=True)


def print_breakdown(rows: list[dict[str, Any]], rounds: int) -> None:
    """Split each case's round: engine, client work, strategy, central, writing.

    The pack records ``grid-s`` (waiting for replies), ``strategy-s``,
    ``central-s`` and ``write-s`` of every round in ``results.json``. Client
    work is a ClientApp call timed in this process (:func:`client_call_ms`)
    times the clients a round, over the two Ray actors that run them; the
    engine is the rest of ``grid-s``. Flower's app records only its round, all
    of it engine and client work.
    """
    print(
        f"\n{'case':28}{'nodes':>7}{'s/round':>9}{'call ms':>9}{'clients':>9}"
        f"{'engine':>8}{'strategy':>9}{'central':>8}{'write':>7}{'state MB':>9}",
        flush=True,
    )
    for row in rows:
        ms, state_mb = client_call_ms(row["case"], row["nodes"], min(rounds, 4))
        clients = ms / 1000 * PER_ROUND / ACTORS
        grid = row.get("grid-s", row["s-per-round"])
        row.update(
            {
                "client-call-ms": ms,
                "clients-s": clients,
                "engine-s": grid - clients,
                "state-mb-per-client": state_mb,
            }
        )
        print(
            f"{row['case']:28}{row['nodes']:>7}{row['s-per-round']:9.3f}{ms:9.1f}"
            f"{clients:9.3f}{grid - clients:8.3f}{row.get('strategy-s', 0):9.3f}"
            f"{row.get('central-s', 0):8.3f}{row.get('write-s', 0):7.3f}"
            f"{state_mb:9.2f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the list of cases this many times, every other time in "
        "reverse, and print each case's mean over the repeats and its ratios "
        "to the payload cases of the same repeat (the machine drifts between runs)",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time one ClientApp call of each case in this process and "
        "split every round into engine, client work, strategy, central "
        "evaluation and writing",
    )
    args = parser.parse_args()
    rows = []
    header = (
        f"{'case':28}{'nodes':>7}{'s/round':>9}{'se':>7}{'x flower':>9}"
        f"{'round 1 s':>10}{'server MB':>10}{'all MB':>9}{'results KB':>11}"
        f"{'x payload':>10}{'MB x payload':>13}{'x trained':>10}{'MB x trained':>13}"
    )
    print(header, flush=True)
    for nodes, repeat in [(n, r) for n in args.nodes for r in range(args.repeats)]:
        ran: dict[str, dict[str, Any]] = {}
        # Every other repeat in reverse: a machine that drifts during the run
        # weighs on both ends of the list alike.
        for case in args.cases if repeat % 2 == 0 else args.cases[::-1]:
            if case == "pack:fedepm" and nodes > DENSE_FEDEPM_NODES:
                print(
                    f"{case:28}{nodes:>7}  not run: the dense table is one model a "
                    "client (10,000 x 0.8 MB = 8 GB, and its round sorts float64 "
                    "copies of it); use strategy.table=seen (next line)",
                    flush=True,
                )
                continue
            try:
                row = run_case(case, nodes, args.rounds)
            except (RuntimeError, OSError, ValueError, KeyError) as err:
                print(f"{case:28}{nodes:>7}  FAILED: {err}", flush=True)
                continue
            row["repeat"] = repeat
            ran[case] = row
            # The table waits for the last case (the ratios); progress meanwhile.
            done = f"{row['s-per-round']:.3f} s a round"
            print(f"  {case} at {nodes} (repeat {repeat + 1}): {done}", flush=True)
        for case in (c for c in args.cases if c in ran):
            row = ran[case]
            add_ratios(row, ran)
            rows.append(row)
            print(
                f"{case:28}{nodes:>7}{row['s-per-round']:9.3f}"
                f"{row['s-per-round-se']:7.3f}{row['ratio']:9.2f}"
                f"{row['first-round-s']:10.1f}{row['server-peak-mb']:10.0f}"
                f"{row['all-peak-mb']:9.0f}{row['results-kb']:11.1f}"
                f"{row['x-payload']:10.2f}{row['server-mb-x-payload']:13.2f}"
                f"{row['x-trained']:10.2f}{row['server-mb-x-trained']:13.2f}",
                flush=True,
            )
    if args.repeats > 1:
        print_repeats(rows)
    if args.breakdown:
        print_breakdown(rows, args.rounds)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scale.json").write_text(json.dumps(rows, indent=1))
    print(f"\nwritten: {OUT / 'scale.json'}")


if __name__ == "__main__":
    main()

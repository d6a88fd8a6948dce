"""P-FedAvg's server-to-server exchange on two engines: gRPC (ours) and torch.distributed.

``torch.distributed`` with the gloo backend (point-to-point
``isend``/``irecv`` to neighbours, rendezvous through a TCP store) is the obvious
engine for the exchange between parameter servers. This script runs the same
exchange on both, side by side in one run, one process per server:

* **grpc**: :class:`flwr_prox_strategies.pfedavg_deploy.exchange.PeerExchange` (grpcio,
  Flower's own transport; the models travel as Flower's ``RecordDict`` protobuf);
* **gloo**: ``torch.distributed`` with the gloo backend, one process group of the
  M servers, each round ``isend`` of the model to both ring neighbours and
  ``irecv`` of theirs, ``Work.wait(timeout)`` as the round's deadline.

Each server exchanges an MLP 784-200-200-10 (0.8 MB, float32) with its two ring
neighbours every round. Two scenarios:

``steady``
    R rounds with every server up: seconds per round (the exchange alone).
``fault``
    every round first "trains" for 2 s (a sleep); server M-1 dies (``os._exit``)
    after round 3; the others go on for rounds 4..8 with a 5 s deadline; a new process for server M-1 starts 2 s after the
    death and tries to rejoin (gRPC: a new exchange at the same address; gloo:
    ``init_process_group`` with the same rank against the same store, 15 s
    timeout). Printed: what each survivor got in rounds 4..8 and whether the
    restarted server exchanged anything.

Run: ``python benchmarks/exchange_engines.py [--servers 3 --rounds 20]``
(nothing else running: it times rounds).
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing as mp
import os
import statistics
import time
import traceback
from typing import Any

import numpy as np

from flwr_prox_strategies.pfedavg_deploy.deployment import free_port

SHAPES = {"w1": (784, 200), "b1": (200,), "w2": (200, 200), "b2": (200,)}
SHAPES |= {"w3": (200, 10), "b3": (10,)}
DIE_AFTER, LAST_FAULT_ROUND, DEADLINE, RESTART_DELAY = 3, 8, 5.0, 2.0
TRAIN_SECONDS = (
    2.0  # a fault round's local training, so the survivors outlive the restart
)


def ring(i: int, m: int) -> list[int]:
    return sorted({(i - 1) % m, (i + 1) % m} - {i})


def arrays(value: float) -> dict[str, np.ndarray]:
    return {k: np.full(s, value, np.float32) for k, s in SHAPES.items()}


# ------------------------------------------------------------------ gRPC (ours)
def grpc_server(i: int, m: int, addresses: list[str], plan: dict, out: Any) -> None:
    from flwr_prox_strategies.core.transport.records import dict_to_record
    from flwr_prox_strategies.pfedavg_deploy.exchange import PeerExchange

    exchange = PeerExchange(
        index=i,
        addresses=addresses,
        neighbours=ring(i, m),
        timeout=plan["timeout"],
        rejoin_grace=plan["timeout"],
    )
    exchange.start(4 << 20)
    try:
        first = plan.get("first", 1)
        exchange.begin_round(first)
        if first > 1:  # a restarted server: ask the neighbours where they are
            status = exchange.wait_for_neighbours(timeout=10)
            first = max((r for r, _ in status.values()), default=first - 1) + 1
            out.put((i, "rejoin-at", first))
        for rnd in range(first, plan["rounds"] + 1):
            start = time.monotonic()
            got = exchange.exchange(rnd, dict_to_record(arrays(float(i))))
            exchange.publish(rnd, dict_to_record(arrays(float(i))))
            out.put((i, rnd, time.monotonic() - start, sorted(got.models)))
            if plan.get("die_after") == rnd:
                os._exit(0)
    finally:
        exchange.stop()


# ------------------------------------------------------- torch.distributed gloo
def gloo_server(i: int, m: int, port: int, plan: dict, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # gloo prints C++ stack traces on every failed call; what it raises is reported.
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    first = plan.get("first", 1)
    start = time.monotonic()
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=i,
            world_size=m,
            timeout=dt.timedelta(seconds=plan["init_timeout"]),
        )
    except Exception as err:
        out.put((i, "init-failed", time.monotonic() - start, type(err).__name__))
        return
    if first > 1:
        out.put((i, "rejoin-at", first))
    flat = torch.from_numpy(
        np.concatenate([a.ravel() for a in arrays(float(i)).values()])
    )
    for rnd in range(first, plan["rounds"] + 1):
        time.sleep(plan["train_seconds"])
        start = time.monotonic()
        inbox = {j: torch.empty_like(flat) for j in ring(i, m)}
        works, received = [], {}
        for j in ring(i, m):  # per neighbour: one dead peer must not stop the others
            try:
                works.append(dist.isend(flat, dst=j, tag=rnd))
                received[j] = dist.irecv(inbox[j], src=j, tag=rnd)
            except Exception as err:
                out.put((i, "error", rnd, f"post to {j}: {str(err)[:90]}"))
        got = []
        for j, work in received.items():
            try:
                if work.wait(timeout=dt.timedelta(seconds=plan["timeout"])):
                    got.append(j)
            except Exception as err:
                out.put((i, "error", rnd, f"recv from {j}: {str(err)[:90]}"))
        for work in works:
            try:
                work.wait(timeout=dt.timedelta(seconds=plan["timeout"]))
            except Exception as err:
                out.put((i, "error", rnd, f"send: {str(err)[:90]}"))
        out.put((i, rnd, time.monotonic() - start, got))
        if plan.get("die_after") == rnd:
            os._exit(0)


def guarded(target: Any, *args: Any) -> None:
    try:
        target(*args)
    except Exception:
        args[-1].put((args[0], "crashed", traceback.format_exc()[-300:]))


def run(engine: str, m: int, plan: dict, restart: dict | None, limit: float) -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    if engine == "grpc":
        endpoint: Any = [f"127.0.0.1:{free_port()}" for _ in range(m)]
        target: Any = grpc_server
    else:
        endpoint = free_port()
        target = gloo_server
    plans = [dict(plan) for _ in range(m)]
    if restart is not None:
        plans[m - 1]["die_after"] = DIE_AFTER
    procs = [
        ctx.Process(target=guarded, args=(target, i, m, endpoint, plans[i], out))
        for i in range(m)
    ]
    for p in procs:
        p.start()
    if restart is not None:
        procs[m - 1].join(timeout=limit)
        time.sleep(RESTART_DELAY)
        again = ctx.Process(
            target=guarded, args=(target, m - 1, m, endpoint, plan | restart, out)
        )
        again.start()
        procs.append(again)
    deadline = time.monotonic() + limit
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    events = []
    while not out.empty():
        events.append(out.get())
    if hung:
        events.append(("-", "hung", len(hung), f"killed after {limit:.0f} s"))
    return events


def steady(engine: str, m: int, rounds: int) -> float:
    plan = {"rounds": rounds, "timeout": 60.0, "init_timeout": 60, "train_seconds": 0}
    events = run(engine, m, plan, None, limit=120)
    times = [e[2] for e in events if isinstance(e[1], int) and e[1] > 1]
    bad = [e for e in events if not isinstance(e[1], int)]
    assert not bad and len(times) == m * (rounds - 1), bad
    return statistics.median(times)


def fault(engine: str, m: int) -> list:
    plan = {"rounds": LAST_FAULT_ROUND, "timeout": DEADLINE, "init_timeout": 15}
    plan["train_seconds"] = TRAIN_SECONDS
    restart = {"first": DIE_AFTER + 2, "die_after": None}
    return run(engine, m, plan, restart, limit=90)


def describe(events: list, m: int) -> list[str]:
    lines = []
    for i in range(m):
        mine = [e for e in events if e[0] == i]
        rounds = {e[1]: e for e in mine if isinstance(e[1], int)}
        got = [
            f"r{r}: {rounds[r][3]} {rounds[r][2]:.1f}s" if r in rounds else f"r{r}: -"
            for r in range(DIE_AFTER + 1, LAST_FAULT_ROUND + 1)
        ]
        lines.append(f"  server {i}: " + ", ".join(got))
        lines += [f"    {e[1]}: {e[2:]}" for e in mine if not isinstance(e[1], int)]
    lines += [f"  {e[1]}: {e[2:]}" for e in events if e[0] == "-"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    m = args.servers
    size = sum(int(np.prod(s)) for s in SHAPES.values()) * 4
    print(f"{m} servers on a ring, model {size / 1e6:.2f} MB, one process each")
    for engine in ("grpc", "gloo"):
        print(
            f"{engine}: steady, median s per round over rounds 2..{args.rounds}: "
            f"{steady(engine, m, args.rounds):.4f}",
            flush=True,
        )
    for engine in ("grpc", "gloo"):
        print(
            f"{engine}: fault, server {m - 1} dies after round {DIE_AFTER}, restarted "
            f"{RESTART_DELAY:.0f} s later; neighbours received in rounds "
            f"{DIE_AFTER + 1}..{LAST_FAULT_ROUND} (deadline {DEADLINE:.0f} s):",
            flush=True,
        )
        for line in describe(fault(engine, m), m):
            print(line, flush=True)


if __name__ == "__main__":
    main()

"""Secure aggregation's cost: seconds per round and bytes per client, with and without.

The pack's ``SecAggPlus`` around its ``FedAvg`` and ``Scaffold``, against
Flower's own legacy ``SecAggPlusWorkflow`` around Flower's legacy ``FedAvg``
(clients with Flower's ``secaggplus_mod``), each also without secure
aggregation, on the same model size, node count and protocol parameters, all
over the pack's ``InProcessGrid`` (one process, one thread: a round's time is
the server's work plus every client's, one after the other).

Clients do not really train: each loads the received model into a
``torch.nn.Linear(d, d, bias=False)`` (``d*d`` = ``--params``), takes ONE SGD
step on a batch drawn from a seed of (node, round) and replies. The pack's
clients are Message-API ClientApps with the client rules (``ClientRule``,
FedAvg's, and ``ScaffoldRule``, so the SCAFFOLD reply carries ``control-delta``)
and ``SecAggPlusMod`` (which lets plain messages pass, as ``to_client_app``'s
apps do); Flower's is a ``NumPyClient`` doing the same step. ``num-examples``
differs per client (100..597), so FedAvg's mean is weighted.

Reported per configuration: the median wall-clock and CPU seconds of the timed
rounds (``--warmup`` untimed rounds first; from ``--large`` clients on, the
SecAgg+ configurations run ``--large-warmup`` + ``--large-rounds``: by default
one round, timed, since a 50-client round over 1M parameters takes minutes; the
benchmark's own work inside a round, byte counting and the plain sums, is
subtracted); bytes per client per round, as Flower's protobuf
serialises each message's content, by stage, uploaded (client to server) and
downloaded (server to client); where the time went (mask expansion, key
agreement, Shamir, quantisation, the client's step; wrappers around those
functions); and the largest difference between the round-1 aggregate and the
plain aggregate of the same replies (the clients' plain replies are summed
aside in float64 before the mod masks them), beside the pack's bound.

Neighbourhoods: by default (``--shares auto``) the pack runs
``num_shares="auto"`` (each client masks with a neighbourhood that grows as
``log n``) and Flower's workflow gets the same neighbourhood and threshold as
counts, so both do the same protocol work; ``--shares everyone`` runs SecAgg
(everyone with everyone, threshold 0.6) on both sides. Flower's legacy workflow
runs only up to ``--flower-max`` clients (its server is O(n^2)); ``--no-flower``
leaves it out. The report gives, per client count, the neighbourhood chosen and
the per-client secure cost, ``(secure round - plain round) / n`` seconds,
and ``secagg-cost.png`` plots it against ``n`` (log axis): flat if each
client's work grows as ``log n``.

Run: ``python benchmarks/secagg.py [--clients 10 50 100 200] [--params 1000000]
[--rounds 3] [--warmup 1] [--large 50] [--shares auto] [--no-flower]
[--flower-max 50] [--quick]``; writes ``benchmarks/results/secagg/secagg.txt``,
``secagg.json`` and ``secagg-cost.png`` (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.client import NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.logger import FLOWER_LOGGER
from flwr.common.serde import recorddict_to_proto
from flwr.server import ServerConfig
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import FedAvg as LegacyFedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

import flwr_prox_strategies
from flwr_prox_strategies import (
    ClientRule,
    FedAvg,
    Scaffold,
    ScaffoldRule,
    SecAggPlus,
    SecAggPlusMod,
)
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
from flwr_prox_strategies.ops.privacy.neighbourhoods import neighbourhood_size

# The protocol parameters, the same on both sides; the neighbourhood and the
# threshold per client count (:func:`neighbourhoods`, ``--shares``).
PROTOCOL: dict[str, Any] = {
    "max_weight": 1000.0,
    "clipping_range": 8.0,
    "quantization_range": 2**22,
    "modulus_range": 2**32,
}
#: ``--shares``: "auto" (the pack's default, log n) or "everyone" (SecAgg).
SHARES = {"mode": "auto"}
LR = 0.5
BATCH = 8
PACK_STAGE_RECORD = "secagg-plus"
FLOWER_STAGE_RECORD = "secaggplus_configs"

CONFIGS = (
    # name, family, secure
    ("pack FedAvg", "pack-fedavg", False),
    ("pack FedAvg+SecAgg+", "pack-fedavg", True),
    ("pack SCAFFOLD", "pack-scaffold", False),
    ("pack SCAFFOLD+SecAgg+", "pack-scaffold", True),
    ("Flower FedAvg (legacy)", "flower-fedavg", False),
    ("Flower FedAvg+SecAgg+ (legacy)", "flower-fedavg", True),
)


def neighbourhoods(n: int) -> dict[str, Any]:
    """Return each side's neighbourhood settings at ``n`` clients, and the (k, t)."""
    if SHARES["mode"] == "everyone":
        k, t = n, max(2, math.ceil(round(0.6 * n, 9)))
        pack: dict[str, Any] = {"num_shares": 1.0, "reconstruction_threshold": 0.6}
        flower: dict[str, Any] = {"num_shares": 1.0, "reconstruction_threshold": 0.6}
    else:
        k, t = neighbourhood_size(n)
        k = min(k, n)
        pack = {"num_shares": "auto", "reconstruction_threshold": None}
        # Flower's workflow takes counts: the same ring, the same threshold.
        flower = {
            "num_shares": k if k < n else 1.0,
            "reconstruction_threshold": t,
        }
    return {"k": k, "t": t, "pack": pack, "flower": flower}


# --------------------------------------------------------------------- timing
class Clock:
    """Seconds spent in named functions, per round (the benchmark's own wrappers)."""

    def __init__(self) -> None:
        self.round = 0
        self.spent: dict[int, dict[str, float]] = defaultdict(
            lambda: defaultdict(float)
        )
        self.calls: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def add(self, label: str, seconds: float) -> None:
        self.spent[self.round][label] += seconds
        self.calls[self.round][label] += 1

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(label, time.perf_counter() - start)

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed


CLOCK = Clock()
#: The benchmark's own work inside a round (byte counting, the plain sums):
#: subtracted from the round's seconds.
OVERHEAD = "benchmark overhead"


@contextlib.contextmanager
def instrumented() -> Iterator[None]:
    """Time the protocol's expensive functions where each module calls them."""
    # (the packages export functions of the modules' names: import the modules)
    flower_mod = importlib.import_module(
        "flwr.client.mod.secure_aggregation.secaggplus_mod"
    )
    flower_workflow = importlib.import_module(
        "flwr.server.workflow.secure_aggregation.secaggplus_workflow"
    )

    from flwr_prox_strategies.core.transport import agreement as pack_agreement
    from flwr_prox_strategies.core.transport import secagg as pack_protocol
    from flwr_prox_strategies.core.transport import secagg_node as pack_client
    from flwr_prox_strategies.core.transport import shamir as pack_shamir

    targets = [
        # module, attribute, label
        (pack_client, "add_masks", "client: mask expansion"),
        (pack_agreement, "shared_keys", "client: key agreement (X25519+HKDF)"),
        (pack_client, "pairwise_seeds", "client: key agreement (X25519+HKDF)"),
        (pack_agreement, "generate_key_pair", "client: key generation"),
        (pack_shamir, "split", "client: Shamir split"),
        (pack_client, "encrypt", "client: share encryption"),
        (pack_client, "decrypt", "client: share decryption"),
        (pack_protocol.Quantizer, "encode", "client: quantisation"),
        (pack_protocol, "add_masks", "server: mask expansion"),
        (pack_shamir, "recover_many", "server: Shamir combine"),
        (pack_protocol, "pairwise_seeds", "server: key agreement (X25519+HKDF)"),
        (flower_mod, "pseudo_rand_gen", "client: mask expansion"),
        (flower_mod, "generate_shared_key", "client: key agreement (P-384 ECDH+HKDF)"),
        (flower_mod, "generate_key_pairs", "client: key generation"),
        (flower_mod, "create_shares", "client: Shamir split"),
        (flower_mod, "encrypt", "client: share encryption"),
        (flower_mod, "decrypt", "client: share decryption"),
        (flower_mod, "quantize", "client: quantisation"),
        (flower_workflow, "pseudo_rand_gen", "server: mask expansion"),
        (flower_workflow, "combine_shares", "server: Shamir combine"),
        (
            flower_workflow,
            "generate_shared_key",
            "server: key agreement (P-384 ECDH+HKDF)",
        ),
    ]
    saved = []
    for owner, name, label in targets:
        original = getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, CLOCK.wrap(label, original))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


# ---------------------------------------------------------------------- grid
def content_bytes(message: Message) -> int:
    """Bytes of a message's content as Flower's protobuf serialises it."""
    if not message.has_content():
        return 0
    return recorddict_to_proto(message.content).ByteSize()


def stage_of(message: Message) -> str:
    records = message.content.config_records
    for name in (PACK_STAGE_RECORD, FLOWER_STAGE_RECORD):
        if name in records and "stage" in records[name]:
            return str(records[name]["stage"])
    return message.metadata.message_type


class MeteredGrid(InProcessGrid):
    """The pack's InProcessGrid, counting bytes per stage (while ``metering``)
    and the seconds spent inside the ClientApp."""

    def __init__(self, client_app: Any, *, num_nodes: int) -> None:
        super().__init__(client_app, num_nodes=num_nodes)
        self.metering = True
        # stage -> [messages, bytes down, bytes up]
        self.traffic: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])

    def _deliver(self, message: Message) -> Message:
        if self.metering:
            start = time.perf_counter()
            stage = stage_of(message)
            down = content_bytes(message)  # before a mod mutates it
            CLOCK.add(OVERHEAD, time.perf_counter() - start)
        # A transport copies each message: Flower's setup stage sends one
        # RecordDict to every node and its mod pops a key from it. Copy the
        # (small) ConfigRecords; ArrayRecords are only read.
        message.content = RecordDict(
            {
                name: ConfigRecord(dict(record))
                if isinstance(record, ConfigRecord)
                else record
                for name, record in message.content.items()
            }
        )
        start = time.perf_counter()
        reply = super()._deliver(message)
        CLOCK.add("client app, all told", time.perf_counter() - start)
        if reply.has_error():
            raise RuntimeError(
                f"node {message.metadata.dst_node_id} failed: {reply.error.reason}"
            )
        if self.metering:
            start = time.perf_counter()
            entry = self.traffic[stage]
            entry[0] += 1
            entry[1] += down
            entry[2] += content_bytes(reply)
            CLOCK.add(OVERHEAD, time.perf_counter() - start)
        return reply


# ------------------------------------------------------------------- clients
def side(params: int) -> int:
    d = round(math.sqrt(params))
    if d < 2:
        raise SystemExit(f"--params {params}: too small")
    return d


def num_examples(partition: int) -> int:
    return 100 + (37 * partition) % 500


class PlainSums:
    """Round-1 plain aggregate of what the clients replied (before any masking)."""

    def __init__(self) -> None:
        self.weighted: Any = None  # float64 arrays once a reply came
        self.plain: Any = None
        self.weight = 0.0
        self.count = 0
        self.control: Any = None

    def add(self, model: np.ndarray, weight: float, control: np.ndarray | None) -> None:
        start = time.perf_counter()
        self._add(model, weight, control)
        CLOCK.add(OVERHEAD, time.perf_counter() - start)

    def _add(
        self, model: np.ndarray, weight: float, control: np.ndarray | None
    ) -> None:
        model = model.astype(np.float64)
        if self.weighted is None:
            self.weighted = np.zeros_like(model)
            self.plain = np.zeros_like(model)
        self.weighted += weight * model
        self.plain += model
        self.weight += weight
        self.count += 1
        if control is not None:
            if self.control is None:
                self.control = np.zeros_like(model)
            self.control += control.astype(np.float64)


class Clients:
    """What every node runs: one SGD step on a seeded batch, in the pack's or
    Flower's client; the round-1 plain replies are summed in ``sums``."""

    def __init__(self, d: int) -> None:
        self.d = d
        self.models: dict[int, torch.nn.Linear] = {}
        self.sums = PlainSums()
        self.round = 0  # set by the server-side hooks

    def model(self, node: int) -> torch.nn.Linear:
        if node not in self.models:
            self.models[node] = torch.nn.Linear(self.d, self.d, bias=False)
        return self.models[node]

    def step(self, model: torch.nn.Module, optimizer: Any, node: int) -> None:
        g = torch.Generator().manual_seed(node * 100_003 + self.round)
        x = torch.randn(BATCH, self.d, generator=g)
        y = torch.randn(BATCH, self.d, generator=g)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    def pack_app(self, scaffold: bool) -> ClientApp:
        app = ClientApp(mods=[SecAggPlusMod()])  # plain messages pass through
        rule_cls = ScaffoldRule if scaffold else ClientRule

        @app.train()
        def train(msg: Message, context: Context) -> Message:
            start = time.perf_counter()
            node = context.node_id
            model = self.model(node)
            rule = rule_cls.from_message(msg, context, model)
            optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=LR))
            self.step(model, optimizer, node)
            n = num_examples(int(context.node_config["partition-id"]))
            reply = rule.reply(num_examples=n)
            if self.round == 1:
                records = reply.content.array_records
                control = (
                    records["control-delta"]["weight"].numpy() if scaffold else None
                )
                self.sums.add(records["arrays"]["weight"].numpy(), n, control)
            CLOCK.add("client: the step (rule, SGD)", time.perf_counter() - start)
            return reply

        return app

    def flower_app(self, secure: bool) -> ClientApp:
        clients = self

        class LegacyClient(NumPyClient):
            def __init__(self, node: int, partition: int) -> None:
                self.node, self.partition = node, partition

            def fit(self, parameters, config):  # type: ignore[no-untyped-def]
                start = time.perf_counter()
                model = clients.model(self.node)
                with torch.no_grad():
                    model.weight.copy_(torch.from_numpy(parameters[0]))
                optimizer = torch.optim.SGD(model.parameters(), lr=LR)
                clients.step(model, optimizer, self.node)
                out = model.weight.detach().numpy().copy()
                n = num_examples(self.partition)
                if clients.round == 1:
                    clients.sums.add(out, n, None)
                CLOCK.add("client: the step (rule, SGD)", time.perf_counter() - start)
                return [out], n, {}

        def client_fn(context: Context):  # type: ignore[no-untyped-def]
            partition = int(context.node_config["partition-id"])
            return LegacyClient(context.node_id, partition).to_client()

        return ClientApp(client_fn=client_fn, mods=[secaggplus_mod] if secure else [])


# -------------------------------------------------------------------- running
class Marks:
    """Round start times, from the strategy's configure call."""

    def __init__(self, clients: Clients, grid: MeteredGrid) -> None:
        self.starts: list[float] = []
        self.cpu_starts: list[float] = []
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []
        self.clients, self.grid = clients, grid

    def begin(self, server_round: int) -> None:
        if server_round >= 2:
            self.grid.metering = False  # bytes are counted in the warm-up round
        if self.starts:  # the previous round ended
            self.ends.append(time.perf_counter())
            self.cpu_ends.append(time.process_time())
        gc.collect()  # between the rounds, in neither
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())
        self.clients.round = server_round
        CLOCK.round = server_round

    def stop(self) -> None:
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())

    def seconds(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.ends, strict=True)]

    def cpu_seconds(self) -> list[float]:
        return [b - a for a, b in zip(self.cpu_starts, self.cpu_ends, strict=True)]


def run_pack(family: str, secure: bool, n: int, d: int, total: int) -> dict[str, Any]:
    scaffold = family == "pack-scaffold"
    clients = Clients(d)
    grid = MeteredGrid(clients.pack_app(scaffold), num_nodes=n)
    marks = Marks(clients, grid)
    common: dict[str, Any] = {
        "min_train_nodes": n,
        "min_available_nodes": n,
        "fraction_evaluate": 0.0,
    }
    inner: Any = Scaffold(num_clients=n, **common) if scaffold else FedAvg(**common)
    settings = {**PROTOCOL, **neighbourhoods(n)["pack"]}
    strategy: Any = SecAggPlus(inner, **settings) if secure else inner
    captured: dict[str, Any] = {}
    configure, aggregate = strategy.configure_train, strategy.aggregate_train

    def configure_train(server_round, arrays, config, grid_):  # type: ignore[no-untyped-def]
        marks.begin(server_round)
        return configure(server_round, arrays, config, grid_)

    def aggregate_train(server_round, replies):  # type: ignore[no-untyped-def]
        arrays, metrics = aggregate(server_round, replies)
        if server_round == 1:
            captured["model"] = arrays["weight"].numpy().astype(np.float64)
            captured["metrics"] = dict(metrics or {})
            if scaffold:
                captured["control"] = np.asarray(inner.control["weight"], np.float64)
        return arrays, metrics

    strategy.configure_train = configure_train
    strategy.aggregate_train = aggregate_train
    torch.manual_seed(0)
    initial = ArrayRecord(torch.nn.Linear(d, d, bias=False).state_dict())
    strategy.start(grid=grid, initial_arrays=initial, num_rounds=total)
    marks.stop()
    sums = clients.sums
    if scaffold:  # uniform weights; c = 0 + sum(delta c) / N
        plain_model = sums.plain / sums.count
        plain_control = sums.control / n
    else:
        plain_model, plain_control = sums.weighted / sums.weight, None
    out = {
        "seconds": marks.seconds(),
        "cpu_seconds": marks.cpu_seconds(),
        "traffic": dict(grid.traffic),
        "diff_model": float(np.abs(captured["model"] - plain_model).max()),
        "bound": captured["metrics"].get("secagg-error-bound"),
        "clipped": captured["metrics"].get("secagg-clipped"),
        "contributors": captured["metrics"].get("secagg-contributors"),
    }
    if scaffold:
        out["diff_control"] = float(np.abs(captured["control"] - plain_control).max())
    return out


def run_flower(secure: bool, n: int, d: int, total: int) -> dict[str, Any]:
    clients = Clients(d)
    grid = MeteredGrid(clients.flower_app(secure), num_nodes=n)
    marks = Marks(clients, grid)
    torch.manual_seed(0)
    w0 = torch.nn.Linear(d, d, bias=False).weight.detach().numpy().copy()
    strategy = LegacyFedAvg(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=n,
        min_available_clients=n,
        initial_parameters=ndarrays_to_parameters([w0]),
    )
    captured: dict[str, Any] = {}
    configure, aggregate = strategy.configure_fit, strategy.aggregate_fit

    def configure_fit(server_round, parameters, client_manager):  # type: ignore[no-untyped-def]
        marks.begin(server_round)
        return configure(server_round, parameters, client_manager)

    def aggregate_fit(server_round, results, failures):  # type: ignore[no-untyped-def]
        if failures:
            raise RuntimeError(f"Flower's round {server_round}: failures {failures}")
        parameters, metrics = aggregate(server_round, results, failures)
        if server_round == 1:
            assert parameters is not None
            captured["model"] = parameters_to_ndarrays(parameters)[0].astype(np.float64)
        return parameters, metrics

    strategy.configure_fit = configure_fit  # type: ignore[method-assign]
    strategy.aggregate_fit = aggregate_fit  # type: ignore[method-assign]
    shares = neighbourhoods(n)["flower"]
    fit_workflow = (
        SecAggPlusWorkflow(
            shares["num_shares"],
            shares["reconstruction_threshold"],
            max_weight=PROTOCOL["max_weight"],
            clipping_range=PROTOCOL["clipping_range"],
            quantization_range=PROTOCOL["quantization_range"],
            modulus_range=PROTOCOL["modulus_range"],
        )
        if secure
        else None
    )
    context = LegacyContext(
        Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
        config=ServerConfig(num_rounds=total),
        strategy=strategy,
    )
    DefaultWorkflow(fit_workflow=fit_workflow)(grid, context)
    marks.stop()
    if len(marks.starts) != total:
        raise RuntimeError(f"Flower ran {len(marks.starts)} rounds, not {total}")
    sums = clients.sums
    return {
        "seconds": marks.seconds(),
        "cpu_seconds": marks.cpu_seconds(),
        "traffic": dict(grid.traffic),
        "diff_model": float(
            np.abs(captured["model"] - sums.weighted / sums.weight).max()
        ),
        "bound": None,
        "clipped": None,
        "contributors": None,
    }


def run(
    family: str, secure: bool, n: int, d: int, warmup: int, rounds: int
) -> dict[str, Any]:
    """Run ``warmup + rounds`` rounds of one configuration; time the last ``rounds``."""
    CLOCK.spent.clear()
    CLOCK.calls.clear()
    wall = time.perf_counter()
    if family == "flower-fedavg":
        out = run_flower(secure, n, d, warmup + rounds)
    else:
        out = run_pack(family, secure, n, d, warmup + rounds)
    out["wall"] = time.perf_counter() - wall
    out["warmup"], out["timed_rounds"] = warmup, rounds
    overhead = [
        CLOCK.spent[r + 1].get(OVERHEAD, 0.0) for r in range(len(out["seconds"]))
    ]
    out["overhead"] = overhead
    out["timed"] = [s - o for s, o in zip(out["seconds"], overhead, strict=True)][
        warmup:
    ]
    out["timed_cpu"] = [
        s - o for s, o in zip(out["cpu_seconds"], overhead, strict=True)
    ][warmup:]
    out["median"] = statistics.median(out["timed"])
    out["median_cpu"] = statistics.median(out["timed_cpu"])
    # Where the time went, averaged over the timed rounds.
    timed = range(warmup + 1, warmup + rounds + 1)
    labels = sorted(
        {label for r in timed for label in CLOCK.spent[r] if label != OVERHEAD}
    )
    out["breakdown"] = {
        label: statistics.fmean(CLOCK.spent[r].get(label, 0.0) for r in timed)
        for label in labels
    }
    out["calls"] = {
        label: statistics.fmean(CLOCK.calls[r].get(label, 0) for r in timed)
        for label in labels
    }
    gc.collect()
    return out


# ------------------------------------------------------------------- report
def megabytes(count: float) -> str:
    return f"{count / 1e6:.3f} MB"


def per_client(traffic: dict[str, list[int]], n: int) -> dict[str, dict[str, float]]:
    return {
        stage: {"messages": m / n, "down": down / n, "up": up / n}
        for stage, (m, down, up) in traffic.items()
    }


def schedule(args: argparse.Namespace, n: int, secure: bool = True) -> tuple[int, int]:
    """Return (warm-up rounds, timed rounds) of a configuration at ``n`` clients."""
    if secure and args.large is not None and n >= args.large:
        return args.large_warmup, args.large_rounds
    return args.warmup, args.rounds


def ratio_line(configs: dict[str, Any], key: str) -> str:
    pack = configs["pack FedAvg+SecAgg+"][key]
    flower = configs["Flower FedAvg+SecAgg+ (legacy)"][key]
    scaffold = configs["pack SCAFFOLD+SecAgg+"][key]
    goal1 = "met" if pack <= flower else "NOT met"
    goal2 = "met" if scaffold <= 2 * pack else "NOT met"
    return (
        f"(1) pack FedAvg+SecAgg+ / Flower legacy SecAgg+ = {pack / flower:.3f} "
        f"(goal <= 1: {goal1}); (2) pack SCAFFOLD+SecAgg+ / pack FedAvg+SecAgg+ = "
        f"{scaffold / pack:.3f} (goal <= 2: {goal2})"
    )


#: (family, plain configuration, secure configuration) of each cost curve.
COST_PAIRS = (
    ("pack FedAvg", "pack FedAvg", "pack FedAvg+SecAgg+"),
    ("pack SCAFFOLD", "pack SCAFFOLD", "pack SCAFFOLD+SecAgg+"),
    (
        "Flower FedAvg (legacy)",
        "Flower FedAvg (legacy)",
        "Flower FedAvg+SecAgg+ (legacy)",
    ),
)


def per_client_costs(
    results: dict[str, Any], key: str = "median"
) -> dict[str, dict[str, float]]:
    """Return family -> clients -> ``(secure round - plain round) / n`` seconds."""
    costs: dict[str, dict[str, float]] = {}
    for n, configs in results.items():
        for family, plain, secure in COST_PAIRS:
            if plain in configs and secure in configs:
                extra = configs[secure][key] - configs[plain][key]
                costs.setdefault(family, {})[n] = extra / int(n)
    return costs


def plot_costs(
    costs: dict[str, dict[str, float]], hoods: dict[str, Any], path: Path
) -> None:
    """Write the per-client secure cost against n (log axis), k beside each point."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for family, points in costs.items():
        ns = sorted(points, key=int)
        ax.plot([int(n) for n in ns], [points[n] for n in ns], "o-", label=family)
        if family.startswith("pack FedAvg"):
            for n in ns:
                ax.annotate(
                    f"k={hoods[n]['k']}",
                    (int(n), points[n]),
                    textcoords="offset points",
                    xytext=(0, 6),
                    ha="center",
                    fontsize=8,
                )
    ax.set_xscale("log")
    sizes = sorted({int(n) for points in costs.values() for n in points})
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.minorticks_off()
    ax.set_xlabel("clients per round n (log scale)")
    ax.set_ylabel("secure cost per client per round (s)")
    ax.set_title(
        "SecAgg+: (secure round - plain round) / n, neighbourhood k "
        f"({SHARES['mode']})",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(results: dict[str, Any], args: argparse.Namespace, d: int) -> str:
    lines: list[str] = []
    say = lines.append

    def section(title: str) -> None:
        say("")
        say(title)

    def runs():
        for n, configs in results.items():
            for name, out in configs.items():
                yield n, name, out

    plans = {n: schedule(args, int(n)) for n in results}
    say(
        f"SecAgg+ benchmark: model Linear({d}, {d}, bias=False) = {d * d:,} float32 "
        "parameters; InProcessGrid (one process, one thread: a round is the "
        "server's work plus every client's, one after the other); torch threads "
        f"{torch.get_num_threads()}"
    )
    say(
        "rounds: "
        + "; ".join(
            f"{n} clients: {w} warm-up + {r} timed"
            + (
                ""
                if (w, r) == schedule(args, int(n), False)
                else " (SecAgg+), {} + {} (plain)".format(
                    *schedule(args, int(n), False)
                )
            )
            for n, (w, r) in plans.items()
        )
        + "; the benchmark's own work in a round (byte counting, the plain sums) "
        "is subtracted"
    )
    say(
        "protocol (both sides): "
        + ", ".join(f"{k}={v}" for k, v in PROTOCOL.items())
        + f"; clients: 1 SGD step (batch {BATCH}, lr {LR}), num-examples 100..597"
    )
    say(
        f"neighbourhoods ({SHARES['mode']}; k = a client's neighbourhood, itself "
        "included, t = the threshold): "
        + "; ".join(
            f"{n} clients: k={neighbourhoods(int(n))['k']}, "
            f"t={neighbourhoods(int(n))['t']}"
            for n in results
        )
    )
    say(
        f"python {platform.python_version()}, torch {torch.__version__}, numpy "
        f"{np.__version__}, flwr {__import__('flwr').__version__}, "
        f"flwr_prox_strategies {flwr_prox_strategies.__version__}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs"
    )
    say("")
    header = (
        f"{'clients':>7}  {'configuration':<31}{'s/round':>9}{'cpu s':>8}"
        f"{'timed rounds (s)':>20}{'up/client':>12}{'down/client':>13}"
        f"{'max|sec-plain|':>16}{'bound':>9}"
    )
    say(header)
    say("-" * len(header))
    for n, configs in results.items():
        for name, out in configs.items():
            stages = per_client(out["traffic"], int(n))
            up = sum(s["up"] for s in stages.values())
            down = sum(s["down"] for s in stages.values())
            rounds = " ".join(f"{s:.2f}" for s in out["timed"])
            diff = out["diff_model"]
            if "diff_control" in out:
                diff = max(diff, out["diff_control"])
            bound = "" if out["bound"] is None else f"{out['bound']:.1e}"
            say(
                f"{n:>7}  {name:<31}{out['median']:>9.3f}{out['median_cpu']:>8.3f}"
                f"{rounds:>20}{megabytes(up):>12}{megabytes(down):>13}"
                f"{diff:>16.2e}{bound:>9}"
            )
        say("")
    say(
        "s/round: median wall-clock seconds of the timed rounds; cpu s: the same "
        "rounds' median CPU seconds of this process (steadier on a busy machine); "
        "up/client, down/client: MB (1e6 bytes) per client per round, all stages, "
        "message contents as Flower's protobuf serialises them (counted in round "
        "1); max|sec-plain|: round 1's aggregate (the model; SCAFFOLD: and c) "
        "against the plain aggregate of the same clients' replies (float64); "
        "bound: the pack's secagg-error-bound metric"
    )
    section("Goals")
    for n, configs in results.items():
        if not {
            "pack FedAvg+SecAgg+",
            "Flower FedAvg+SecAgg+ (legacy)",
            "pack SCAFFOLD+SecAgg+",
        } <= set(configs):
            continue
        say(f"  {n:>3} clients, wall: {ratio_line(configs, 'median')}")
        say(f"  {n:>3} clients, cpu:  {ratio_line(configs, 'median_cpu')}")
        for family, plain_name, secure_name in (
            ("pack FedAvg", "pack FedAvg", "pack FedAvg+SecAgg+"),
            ("pack SCAFFOLD", "pack SCAFFOLD", "pack SCAFFOLD+SecAgg+"),
            (
                "Flower FedAvg",
                "Flower FedAvg (legacy)",
                "Flower FedAvg+SecAgg+ (legacy)",
            ),
        ):
            if plain_name in configs and secure_name in configs:
                a, b = configs[plain_name]["median"], configs[secure_name]["median"]
                say(
                    f"        {family}: the SecAgg+ round takes {b / a:.1f}x the plain one"
                )
    section(
        "Per-client secure cost: (secure round - plain round) / n, seconds per "
        "client per round (median wall-clock; cpu in brackets), against the "
        "neighbourhood k: with k ~ log n it should grow no faster than log n"
    )
    costs, cpu_costs = (
        per_client_costs(results),
        per_client_costs(results, "median_cpu"),
    )
    for n in results:
        hood = neighbourhoods(int(n))
        parts = ", ".join(
            f"{family} {points[n]:.4f} ({cpu_costs[family][n]:.4f})"
            for family, points in costs.items()
            if n in points
        )
        say(f"  {n:>4} clients (k={hood['k']}, t={hood['t']}): {parts or '-'}")
    section(
        "Bytes per client per round, by stage (down = server to client, up = "
        "client to server; collect_masked_vectors' down holds the model and the "
        "forwarded key shares)"
    )
    for n, name, out in runs():
        stages = per_client(out["traffic"], int(n))
        parts = ", ".join(
            f"{stage} {s['down']:,.0f} / {s['up']:,.0f}" for stage, s in stages.items()
        )
        say(f"  {n:>3} {name:<31} {parts}")
    section(
        "Where a timed round's seconds went (mean over the timed rounds; the "
        "client apps' total includes the client parts listed; server = round - "
        "client apps)"
    )
    for n, name, out in runs():
        if "SecAgg" not in name:
            continue
        spent = dict(out["breakdown"])
        client_total = spent.pop("client app, all told", 0.0)
        round_s = statistics.fmean(out["timed"])
        say(
            f"  {n:>3} {name}: round {round_s:.2f} s = client apps "
            f"{client_total:.2f} + server {round_s - client_total:.2f}"
        )
        for label, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
            calls = out["calls"][label]
            say(f"        {label:<36}{seconds:>8.3f} s  ({calls:.0f} calls)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50, 100, 200])
    parser.add_argument(
        "--shares",
        choices=("auto", "everyone"),
        default="auto",
        help="neighbourhoods: auto (the pack's num_shares='auto', the same counts "
        "for Flower) or everyone (SecAgg, threshold 0.6, on both sides)",
    )
    parser.add_argument(
        "--no-flower",
        action="store_true",
        help="leave out Flower's legacy configurations",
    )
    parser.add_argument(
        "--flower-max",
        type=int,
        default=50,
        help="run Flower's legacy configurations only up to this many clients "
        "(its server is O(n^2))",
    )
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument(
        "--large",
        type=int,
        default=50,
        help="from this many clients on, the SecAgg+ configurations run "
        "--large-warmup + --large-rounds rounds instead (0 disables; a "
        "50-client SecAgg+ round over 1M parameters takes minutes)",
    )
    parser.add_argument("--large-warmup", type=int, default=0)
    parser.add_argument("--large-rounds", type=int, default=1)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 5 clients, 10,000 parameters, 1 warm-up + 1 timed round",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="configuration names to run (default: all)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch.set_num_threads (the clients' step)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/secagg"))
    args = parser.parse_args()
    if args.quick:
        args.clients, args.params, args.rounds, args.warmup = [5], 10_000, 1, 1
    if args.large == 0:
        args.large = None
    SHARES["mode"] = args.shares
    torch.set_num_threads(args.torch_threads)
    FLOWER_LOGGER.setLevel(logging.ERROR)
    logging.getLogger("flwr").setLevel(logging.ERROR)
    d = side(args.params)
    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    with instrumented():
        for n in args.clients:
            results[str(n)] = {}
            for name, family, secure in CONFIGS:
                if args.only and name not in args.only:
                    continue
                if family.startswith("flower") and (
                    args.no_flower or n > args.flower_max
                ):
                    continue
                warmup, rounds = schedule(args, n, secure)
                out = run(family, secure, n, d, warmup, rounds)
                results[str(n)][name] = out
                print(
                    f"[{n} clients] {name}: median {out['median']:.3f} s/round "
                    f"({out['median_cpu']:.3f} cpu s), wall {out['wall']:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
    elapsed = time.perf_counter() - started
    text = report(results, args, d)
    text += (
        f"\n\nbenchmark run time: {elapsed:.0f} s; "
        f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"command: python {' '.join(sys.argv)}"
    )
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "secagg.txt").write_text(text + "\n")
    hoods = {n: neighbourhoods(int(n)) for n in results}
    costs = per_client_costs(results)
    if costs:
        plot_costs(costs, hoods, args.out / "secagg-cost.png")
    payload = {
        "command": "python " + " ".join(sys.argv),
        "params": d * d,
        "side": d,
        "schedule": {
            n: {
                "secure": dict(
                    zip(("warmup", "timed"), schedule(args, int(n)), strict=True)
                ),
                "plain": dict(
                    zip(("warmup", "timed"), schedule(args, int(n), False), strict=True)
                ),
            }
            for n in results
        },
        "protocol": PROTOCOL,
        "shares": args.shares,
        "neighbourhoods": {n: {"k": h["k"], "t": h["t"]} for n, h in hoods.items()},
        "per_client_cost_s": costs,
        "per_client_cost_cpu_s": per_client_costs(results, "median_cpu"),
        "torch_threads": torch.get_num_threads(),
        "run_time_s": elapsed,
        "load_average_end": os.getloadavg(),
        "results": {
            n: {
                name: {
                    **{k: v for k, v in out.items() if k != "traffic"},
                    "bytes_per_client": per_client(out["traffic"], int(n)),
                }
                for name, out in configs.items()
            }
            for n, configs in results.items()
        },
    }
    (args.out / "secagg.json").write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()

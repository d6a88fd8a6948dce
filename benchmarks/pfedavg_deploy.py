"""Traffic through each SuperLink: P-FedAvg on M deployments against one SuperLink.

Two runs of the same federation (K clients as real SuperNodes on loopback):

* one SuperLink carrying all K clients (P-FedAvg with M = 1, which is FedAvg:
  no neighbour, x = y);
* M SuperLinks, K/M clients each, the servers mixing over gRPC on a ring.

For every SuperLink the TCP bytes of its port are read from the kernel (``ss``:
``bytes_acked`` sent and ``bytes_received`` of every connection, sampled twice a
second, so a connection that closes between two samples loses its last half
second), and the model payload the ServerApps counted (``bytes-sent`` and
``bytes-received`` of the ArrayRecords, ``exchange-bytes-*`` between servers).
Rounds 2..R are compared (round 1 also carries the start-up: registration, the
app bundle sent to every SuperNode). The communication model is
``ops.communication.volumes``: a server carries ``2 K_i s + d_i s``, a single
FedAvg server ``2 K s``. Then the logical P-FedAvg (one in-process grid) is run
for the same configuration, and each server's accuracy per round is compared.

Run: ``python benchmarks/pfedavg_deploy.py [--servers 4 --clients 8 --rounds 3]``
(nothing else running). Every round a deployment starts one ClientApp process
per client (Flower's process isolation), all at once: with 40 clients on one
machine (the issue's M = 4, K = 40) the 40 processes (each importing torch,
about 0.45 GB) filled the 24 GB and the load reached 480 before the first round
ended, so the default is 8 clients, 2 per server. A server's share of the
clients' traffic, 2 K_i s of 2 K s, is K_i / K = 1/M at any K.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np

from flwr_prox_strategies.ops.communication import volumes
from flwr_prox_strategies.ops.graphs import adjacency
from flwr_prox_strategies.pfedavg_deploy import launcher as pfedavg_deploy

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "pfedavg-deploy"


class PortBytes(threading.Thread):
    """Sample the TCP byte counters of the connections on some local ports."""

    def __init__(self, ports: list[int]) -> None:
        super().__init__(daemon=True)
        self.ports = ports
        self.seen: dict[int, dict[tuple[str, str], tuple[int, int]]] = {
            p: {} for p in ports
        }
        self.running = True
        self.lock = threading.Lock()

    def sample(self) -> None:
        out = subprocess.run(
            ["ss", "-tinH", "state", "all"], capture_output=True, text=True, check=False
        ).stdout
        lines = out.splitlines()
        for head, info in zip(lines[::2], lines[1::2], strict=False):
            parts = head.split()
            if len(parts) < 4:
                continue
            local, peer = parts[-2], parts[-1]
            port = int(local.rsplit(":", 1)[1])
            if port not in self.seen:
                continue
            sent = re.search(r"bytes_acked:(\d+)", info)
            received = re.search(r"bytes_received:(\d+)", info)
            value = (
                int(sent.group(1)) if sent else 0,
                int(received.group(1)) if received else 0,
            )
            with self.lock:
                old = self.seen[port].get((local, peer), (0, 0))
                self.seen[port][(local, peer)] = (
                    max(old[0], value[0]),
                    max(old[1], value[1]),
                )

    def totals(self) -> dict[int, int]:
        """Bytes sent plus received so far, by port."""
        with self.lock:
            return {
                p: sum(a + b for a, b in conns.values())
                for p, conns in self.seen.items()
            }

    def run(self) -> None:
        while self.running:
            self.sample()
            time.sleep(0.5)


class MeasuredLauncher(pfedavg_deploy.Launcher):
    """The launcher, with each SuperLink's bytes noted when a round is recorded."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.meter = PortBytes([s.link_port for s in self.servers])
        self.at_round: dict[int, dict[int, int]] = {}

    def run(self) -> int:
        self.meter.start()
        try:
            return super().run()
        finally:
            self.meter.running = False

    def watch_round(self, rnd, per_server) -> None:
        self.meter.sample()
        self.at_round[rnd] = self.meter.totals()
        super().watch_round(rnd, per_server)


def deploy(servers: int, clients: int, rounds: int, overrides: str) -> dict:
    folder = OUT / f"m{servers}"
    args = pfedavg_deploy.parse_args(
        [
            *(
                "--servers",
                str(servers),
                "--clients-per-server",
                str(clients // servers),
            ),
            *(
                "--rounds",
                str(rounds),
                "--overrides",
                overrides,
                "--output",
                str(folder),
            ),
            *("--app", str(ROOT)),
        ]
    )
    launcher = MeasuredLauncher(args)
    try:
        code = launcher.run()
    finally:
        launcher.stop_all()
    assert code == 0, f"the run with {servers} servers failed: see {folder}"
    links = [s.link_port for s in launcher.servers]
    per_round = {
        i: float(
            np.mean(
                [
                    launcher.at_round[r][p] - launcher.at_round[r - 1][p]
                    for r in range(2, rounds + 1)
                ]
            )
        )
        for i, p in enumerate(links)
    }
    payload, exchanged, accuracy = {}, {}, {}
    for i in range(servers):
        results = json.loads((folder / f"server-{i}" / "results.json").read_text())
        rows = {r["round"]: r for r in results["rounds"]}
        payload[i] = float(
            np.mean(
                [
                    rows[r]["train"]["bytes-sent"] + rows[r]["train"]["bytes-received"]
                    for r in range(2, rounds + 1)
                ]
            )
        )
        exchanged[i] = float(
            np.mean(
                [
                    rows[r]["train"].get("exchange-bytes-sent", 0)
                    + rows[r]["train"].get("exchange-bytes-received", 0)
                    for r in range(2, rounds + 1)
                ]
            )
        )
        accuracy[i] = [rows[r]["central"]["accuracy"] for r in range(1, rounds + 1)]
    return {
        "wire": per_round,
        "payload": payload,
        "exchange": exchanged,
        "accuracy": accuracy,
    }


def logical(
    servers: int, clients: int, rounds: int, overrides: str
) -> dict[int, list[float]]:
    """Each server's accuracy per round in the logical P-FedAvg (one in-process grid)."""
    from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
    from flwr_prox_strategies.experiment.appdir import make_client_app
    from flwr_prox_strategies.experiment.server import run_experiment

    folder = OUT / "logical"
    run_config = {
        "overrides": f"strategy=pfedavg topology=ring topology.servers={servers} "
        f"num_clients={clients} num_partitions={clients} num_rounds={rounds} {overrides}",
        "output-dir": str(folder),
    }
    shutil.rmtree(folder, ignore_errors=True)
    grid = InProcessGrid(make_client_app(), num_nodes=clients, run_config=run_config)
    run_experiment(grid, run_config)
    rows = {
        r["round"]: r
        for r in json.loads((folder / "results.json").read_text())["rounds"]
    }
    return {
        i: [rows[r][f"server-{i}"]["accuracy"] for r in range(1, rounds + 1)]
        for i in range(servers)
    }


def interrupt(signum: int, frame: object) -> None:
    """SIGTERM (a timeout, kill) must still run the launchers' clean-up."""
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    signal.signal(signal.SIGTERM, interrupt)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--overrides", default="model=mlp train.local_epochs=1")
    args = parser.parse_args()
    m, k, r = args.servers, args.clients, args.rounds
    print(
        f"{k} clients, {r} rounds, {args.overrides}: one SuperLink, then {m} on a ring",
        flush=True,
    )
    single = deploy(1, k, r, args.overrides)
    spread = deploy(m, k, r, args.overrides)
    model_bytes = single["payload"][0] / (2 * k)  # s: one model, as counted
    degrees = adjacency("ring", m).sum(axis=1)
    expected = volumes(model_bytes, [k // m] * m, degrees)
    print(
        "\nper round (rounds 2..R), bytes through each SuperLink's port (kernel TCP counters):"
    )
    print(
        f"{'':24}{'wire MB':>10}{'payload MB':>12}{'exchange MB':>13}{'model MB':>10}"
    )
    print(
        f"{'single SuperLink':24}{single['wire'][0] / 1e6:10.2f}{single['payload'][0] / 1e6:12.2f}{0:13.2f}{expected['fedavg-peak'] / 1e6:10.2f}"
    )
    for i in range(m):
        model = (2 * (k // m) + degrees[i]) * model_bytes
        print(
            f"{f'server {i} of {m}':24}{spread['wire'][i] / 1e6:10.2f}{spread['payload'][i] / 1e6:12.2f}{spread['exchange'][i] / 1e6:13.2f}{model / 1e6:10.2f}"
        )
    busiest = max(spread["wire"].values())
    ratio = busiest / single["wire"][0]
    print(
        f"\nbusiest SuperLink / single SuperLink (wire): {ratio:.3f} (target <= 1/3; model {expected['pfedavg-peak'] / expected['fedavg-peak']:.3f} with the exchange, which does not cross a SuperLink)"
    )
    OUT.mkdir(parents=True, exist_ok=True)
    measured = {
        "single": single,
        "spread": spread,
        "ratio": ratio,
        "model-bytes": model_bytes,
    }
    (OUT / "traffic.json").write_text(json.dumps(measured, indent=1, default=str))
    reference = logical(m, k, r, args.overrides)
    worst = max(
        abs(a - b)
        for i in range(m)
        for a, b in zip(spread["accuracy"][i], reference[i], strict=True)
    )
    print(
        "accuracy per round, deployed vs logical P-FedAvg, largest difference over "
        f"servers and rounds: {worst:.4f}"
    )
    for i in range(m):
        print(
            f"  server {i}: deployed {[round(a, 4) for a in spread['accuracy'][i]]}, "
            f"logical {[round(a, 4) for a in reference[i]]}"
        )
    measured["logical"] = reference
    (OUT / "traffic.json").write_text(json.dumps(measured, indent=1, default=str))


if __name__ == "__main__":
    main()

r"""P-FedAvg as M real Flower deployments on this machine: one command, on loopback.

For each parameter server a SuperLink, its SuperNodes and its ServerApp
(``deploy=peers``: :class:`~flwr_prox_strategies.PFedAvgServer`), exchanging
models with their graph neighbours over gRPC; one line per round, one output
folder, every process stopped by process group on exit, Ctrl-C and SIGTERM.
The command, its options (``--kill-server``, ``--restart-after``...) and its
folder: the documentation's page "Deploy P-FedAvg across SuperLinks".
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .._executables import flower_executable
from ..core.transport.records import record_to_dict
from ..experiment.checkpoint import CheckpointError, read_checkpoint
from ..ops.mixing import consensus_average, consensus_distance
from .deployment import Deployments, Server
from .exchange import read_status

REPO_MARKER = "pyproject.toml"
#: Seconds between two reads of the runs' statuses (`flwr ls`), while every
#: server's results say it is still running / once one's say it is ending.
STATUS_EVERY, STATUS_EVERY_ENDING = 15.0, 2.0


class Launcher:
    """Start, watch and stop M deployments of the pack's app on loopback."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        self.output = Path(
            args.output or Path("outputs") / f"{stamp}-pfedavg-deploy"
        ).resolve()
        self.deployments = Deployments(
            Path(args.app).resolve(),
            self.output / "engine",
            args.servers,
            args.clients_per_server,
        )
        self.servers = self.deployments.servers
        self.env = self.deployments.env
        self.rows: dict[int, dict[str, Any]] = {}
        self.started = time.monotonic()

    def overrides(self, server: Server) -> str:
        """Return the Hydra overrides that make server's ServerApp server i."""
        a = self.args
        addresses = "[" + ",".join(s.exchange for s in self.servers) + "]"
        return " ".join(
            [
                "strategy=pfedavg",
                f"topology={a.topology}",
                f"topology.servers={a.servers}",
                f"topology.mixing={a.mixing}",
                f"num_clients={len(server.partitions)}",
                f"num_partitions={self.deployments.num_partitions}",
                f"num_rounds={a.rounds}",
                f"seed={a.seed}",
                "deploy=peers",
                f"deploy.index={server.index}",
                f"deploy.addresses={addresses}",
                f"deploy.timeout={a.exchange_timeout}",
                f"deploy.rejoin_grace={a.rejoin_grace}",
                a.overrides,
            ]
        ).strip()

    def submit(self, server: Server, resume: bool = False) -> None:
        """``flwr run`` the app on server's SuperLink (resumed from its folder)."""
        folder = self.output / f"server-{server.index}"
        run_config = f"overrides='{self.overrides(server)}' output-dir='{folder}'"
        if resume:
            run_config += f" resume='{folder}'"
        reply = self.deployments.flwr(
            server,
            "run",
            str(self.deployments.app),
            server.connection,
            "--format",
            "json",
            "--run-config",
            run_config,
        )
        if not reply.get("success"):
            raise RuntimeError(f"server {server.index}: flwr run failed: {reply}")
        server.run_id = str(reply["run-id"])
        server.status = "running"

    def stop_all(self) -> None:
        """Stop every deployment still running."""
        self.deployments.stop_all()

    # --------------------------------------------------------------- watching
    def reached_its_end(self, server: Server, rounds: dict[int, Any]) -> bool:
        """Server's results hold its last round or a failure (its run is ending)."""
        if max(rounds, default=0) >= self.args.rounds:
            return True
        path = self.output / f"server-{server.index}" / "results.json"
        try:
            return "failure" in json.loads(path.read_text())
        except (OSError, ValueError):
            return False

    def rounds_of(self, server: Server) -> dict[int, dict[str, Any]]:
        """Return server's rounds recorded so far in its ``results.json``."""
        path = self.output / f"server-{server.index}" / "results.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return {int(r["round"]): r for r in data.get("rounds", [])}

    def model_of(self, server: Server, rnd: int) -> dict[str, np.ndarray] | None:
        """Return server's mixed model of round ``rnd`` (None: not found).

        Asked of the running server (it keeps its last rounds), else read from
        its checkpoint (a server that has ended).
        """
        status = read_status(server.exchange, server_round=rnd, timeout=10.0)
        if status is not None and status[0] == rnd and status[1] is not None:
            return record_to_dict(status[1])
        with contextlib.suppress(CheckpointError):
            checkpoint = read_checkpoint(self.output / f"server-{server.index}")
            if int(checkpoint["round"]) == rnd:
                model = checkpoint["model"]
                return dict(zip(model["names"], model["arrays"], strict=True))
        return None

    def watch_round(
        self, rnd: int, per_server: list[dict[int, dict[str, Any]]]
    ) -> None:
        """Record (and print) round ``rnd`` once every running server has it."""
        accuracy, sent = [], 0
        for rounds in per_server:
            row = rounds.get(rnd, {})
            accuracy.append(row.get("central", {}).get("accuracy"))
            sent += int(row.get("train", {}).get("exchange-bytes-sent", 0))
        models = [m for s in self.servers if (m := self.model_of(s, rnd)) is not None]
        distance = (
            consensus_distance(models, consensus_average(models))
            if len(models) == len(self.servers)
            else None
        )
        self.rows[rnd] = {
            "round": rnd,
            "accuracy": accuracy,
            "consensus-distance": distance,
            "exchange-bytes-sent": sent,
            "elapsed-s": round(time.monotonic() - self.started, 2),
        }
        known = [a for a in accuracy if a is not None]
        print(
            f"[pfedavg-deploy] round {rnd}/{self.args.rounds}: accuracy "
            + " ".join("  -   " if a is None else f"{a:.4f}" for a in accuracy)
            + (f" (mean {np.mean(known):.4f})" if known else "")
            + (
                f", consensus distance {distance:.3g}"
                if distance is not None
                else ", consensus distance n/a"
            )
            + f", exchanged {sent / 1e6:.2f} MB, {self.rows[rnd]['elapsed-s']:.0f} s",
            flush=True,
        )

    def run(self) -> int:
        """Start everything, watch the rounds, kill/restart as asked; exit code."""
        a = self.args
        self.output.mkdir(parents=True, exist_ok=True)
        print(f"[pfedavg-deploy] output: {self.output}", flush=True)
        for server in self.servers:
            self.deployments.start(server)
            print(
                f"[pfedavg-deploy] server {server.index}: SuperLink 127.0.0.1:"
                f"{server.link_port}, clients {server.partitions}, exchange "
                f"{server.exchange}",
                flush=True,
            )
        for server in self.servers:
            self.submit(server)
        killed_at: float | None = None
        deadline = time.monotonic() + a.max_seconds
        last_status = 0.0
        while time.monotonic() < deadline:
            per_server = [self.rounds_of(s) for s in self.servers]
            live = [
                rounds
                for server, rounds in zip(self.servers, per_server, strict=True)
                if server.active
            ]
            done_rounds = [max(r, default=0) for r in live] or [0]
            for rnd in range(1, min(done_rounds) + 1):
                if rnd not in self.rows:
                    self.watch_round(rnd, per_server)
            victim = a.kill_server
            if (
                victim is not None
                and killed_at is None
                and a.kill_after is not None
                and max(per_server[victim], default=0) >= a.kill_after
            ):
                print(f"[pfedavg-deploy] killing server {victim}", flush=True)
                self.deployments.stop(self.servers[victim])
                killed_at = time.monotonic()
            if (
                killed_at is not None
                and a.restart_after is not None
                and self.servers[victim].status == "killed"
                and time.monotonic() - killed_at >= a.restart_after
            ):
                server = self.servers[victim]
                server.restarts += 1
                print(f"[pfedavg-deploy] restarting server {victim}", flush=True)
                self.deployments.start(server)
                self.submit(server, resume=True)
            # Each `flwr ls` is a Python start (about 2 s of CPU): asked often
            # only once a server's results say it reached its end, else now
            # and then to catch a run that died without writing.
            ending = any(
                s.active and self.reached_its_end(s, rounds)
                for s, rounds in zip(self.servers, per_server, strict=True)
            )
            every = STATUS_EVERY_ENDING if ending else STATUS_EVERY
            if time.monotonic() - last_status > every:
                last_status = time.monotonic()
                for server in self.servers:
                    if server.active:  # flwr ls: pending, starting, running, finished:*
                        self.deployments.refresh_status(server)
                if not any(s.active for s in self.servers):
                    break
            time.sleep(0.5)
        return self.finish()

    def finish(self) -> int:
        """Write the combined results and plot; say how each server ended."""
        per_server = [self.rounds_of(s) for s in self.servers]
        for rnd in range(1, self.args.rounds + 1):
            if rnd not in self.rows and any(rnd in r for r in per_server):
                self.watch_round(rnd, per_server)
        final = [
            (r.get(self.args.rounds) or {}).get("central", {}).get("accuracy")
            for r in per_server
        ]
        statuses = [s.status for s in self.servers]
        ok = all(s == "finished:completed" for s in statuses) and all(
            f is not None for f in final
        )
        results = {
            "servers": self.args.servers,
            "clients-per-server": self.args.clients_per_server,
            "topology": self.args.topology,
            "mixing": self.args.mixing,
            "num-rounds": self.args.rounds,
            "statuses": statuses,
            "rounds": [self.rows[r] for r in sorted(self.rows)],
            "summary": {
                "final-accuracy": final,
                "final-accuracy-mean": float(
                    np.mean([f for f in final if f is not None])
                )
                if any(f is not None for f in final)
                else None,
                "complete": ok,
                "wall-time-s": round(time.monotonic() - self.started, 1),
            },
        }
        (self.output / "results.json").write_text(json.dumps(results, indent=1))
        plot = self.plot(results)
        print(
            f"[pfedavg-deploy] {'finished' if ok else 'FAILED'}: statuses {statuses}, "
            f"final accuracy {final}",
            flush=True,
        )
        print(f"[pfedavg-deploy] results: {self.output / 'results.json'}", flush=True)
        if plot is not None:
            print(f"[pfedavg-deploy] plot: {plot}", flush=True)
        return 0 if ok else 1

    def plot(self, results: dict[str, Any]) -> Path | None:
        """Plot every server's accuracy and the consensus distance (None: no plot)."""
        try:
            return plot_deploy(results, self.output / "pfedavg-deploy.png")
        except ImportError:  # no matplotlib: the results file is enough
            return None


def plot_deploy(results: dict[str, Any], path: Path) -> Path | None:
    """Draw ``pfedavg-deploy.png``: accuracies and consensus distance per round.

    The consensus distance is drawn on a log axis; a round whose distance is
    exactly 0 (the servers hold one model: a complete graph, or uniform
    mixing) has no place there, so it is left out and the curve's label says
    "0 from round k" instead. Returns None when there is no round to draw.
    """
    from ..experiment.results import integer_rounds, plot_log, pyplot

    rows = results["rounds"]
    if not rows:
        return None
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    rounds = [r["round"] for r in rows]
    for i in range(results["servers"]):
        left.plot(
            rounds,
            [
                r["accuracy"][i] if r["accuracy"][i] is not None else np.nan
                for r in rows
            ],
            marker="o",
            label=f"server {i}",
        )
    left.set(xlabel="round", ylabel="central accuracy", title="every server's model")
    left.legend()
    plot_log(
        right,
        rounds,
        [r["consensus-distance"] for r in rows],
        "k.-",
        label="servers' models, after mixing",
    )
    right.set(
        xlabel="round",
        ylabel=r"$\sum_i \|x_i - \bar{x}\|^2$",
        title="consensus distance",
    )
    if right.get_legend_handles_labels()[0]:
        right.legend()
    for ax in (left, right):
        integer_rounds(ax)
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"P-FedAvg, {results['servers']} deployments ({results['topology']}, "
        f"{results['mixing']}), {results['clients-per-server']} client"
        f"{'s' if results['clients-per-server'] != 1 else ''} each"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Read the command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m flwr_prox_strategies.pfedavg_deploy",
        description="P-FedAvg as M Flower deployments (SuperLink + SuperNodes + "
        "ServerApp each) on 127.0.0.1, mixing over gRPC.",
    )
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--clients-per-server", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--topology", default="ring")
    parser.add_argument("--mixing", default="metropolis")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--overrides", default="", help="more Hydra overrides for every server"
    )
    parser.add_argument("--output", default=None, help="results folder")
    parser.add_argument("--app", default=".", help="the Flower app's folder")
    parser.add_argument("--exchange-timeout", type=float, default=60.0)
    parser.add_argument("--rejoin-grace", type=float, default=10.0)
    parser.add_argument("--max-seconds", type=float, default=3600.0)
    parser.add_argument("--kill-server", type=int, default=None)
    parser.add_argument("--kill-after", type=int, default=None, help="a round")
    parser.add_argument("--restart-after", type=float, default=None, help="seconds")
    args = parser.parse_args(argv)
    if args.servers < 1 or args.clients_per_server < 1 or args.rounds < 1:
        parser.error("--servers, --clients-per-server and --rounds must be >= 1")
    if not (Path(args.app) / REPO_MARKER).is_file():
        parser.error(f"--app {args.app!r} holds no {REPO_MARKER}: not a Flower app")
    if args.kill_server is not None and not 0 <= args.kill_server < args.servers:
        parser.error(f"--kill-server must be in 0..{args.servers - 1}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the launcher; every process it started is stopped however it ends."""
    args = parse_args(argv)
    for tool in ("flower-superlink", "flower-supernode", "flwr"):
        try:
            flower_executable(tool)
        except FileNotFoundError as err:
            print(err)
            return 2
    launcher = Launcher(args)

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    # Ray's sockets (if a server ever runs a simulation) need a short path.
    launcher.env.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    try:
        return launcher.run()
    except KeyboardInterrupt:
        print("[pfedavg-deploy] interrupted: stopping every process", flush=True)
        launcher.finish()
        return 130
    finally:
        launcher.stop_all()

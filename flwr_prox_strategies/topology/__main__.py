"""Inspect a P-FedAvg server overlay and its speed-up over FedAvg.

Examples
--------
Five servers on a ring, Metropolis weights, the worked example of the
communication model (100 clients, 50 Mb model, 10 Mb/s links)::

    python -m flwr_prox_strategies.topology --topology ring --servers 5 \
        --clients 100 --model-size 50 --bandwidth 10

The fastest non-negative mixing on a random 4-regular graph of 50 servers, with
exponential client delays, plotting the speed-up up to 2000 clients::

    python -m flwr_prox_strategies.topology --topology random-regular \
        --servers 50 --degree 4 --mixing sdp --delay exponential \
        --delay-mean 5 --max-clients 2000 --plot speedup.png
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from flwr_prox_strategies._optional import require
from flwr_prox_strategies.ops.communication import (
    DELAYS,
    expected_round_times,
    expected_speedup,
    volumes,
)
from flwr_prox_strategies.ops.graphs import TOPOLOGIES, adjacency
from flwr_prox_strategies.ops.mixing import MIXINGS, consensus_rate, mixing_matrix

# Points on the speed-up curve: enough for a smooth line, few enough that the
# Monte Carlo over delays stays quick.
_CURVE_POINTS = 60


def build_parser() -> argparse.ArgumentParser:
    """Return the command line parser."""
    parser = argparse.ArgumentParser(
        prog="python -m flwr_prox_strategies.topology",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    graph = parser.add_argument_group("server graph")
    graph.add_argument("--topology", choices=TOPOLOGIES, default="ring")
    graph.add_argument("--servers", type=int, default=5, help="M (default 5)")
    graph.add_argument("--degree", type=int, help="degree of random-regular")
    graph.add_argument("--probability", type=float, help="edge prob. of erdos-renyi")
    graph.add_argument("--rows", type=int, help="rows of grid/torus")
    graph.add_argument("--mixing", choices=MIXINGS, default="metropolis")
    model = parser.add_argument_group("communication model")
    model.add_argument(
        "--clients", type=int, default=100, help="clients per round (default 100)"
    )
    model.add_argument(
        "--model-size", type=float, default=50.0, help="s, e.g. Mb (default 50)"
    )
    model.add_argument(
        "--bandwidth", type=float, default=10.0, help="B, e.g. Mb/s (default 10)"
    )
    model.add_argument(
        "--beta", type=float, default=0.0, help="client compute time, s (default 0)"
    )
    model.add_argument("--delay", choices=DELAYS, default="none")
    model.add_argument(
        "--delay-mean", type=float, default=1.0, help="mean client delay, s"
    )
    model.add_argument(
        "--samples", type=int, default=10_000, help="Monte Carlo rounds per point"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="speedup.png", help="PNG of the curve")
    parser.add_argument(
        "--max-clients", type=int, default=500, help="end of the curve (default 500)"
    )
    return parser


def client_grid(servers: int, max_clients: int) -> NDArray[np.int_]:
    """Distinct client counts from ``servers`` to ``max_clients`` for the curve."""
    if max_clients < servers:
        raise ValueError(
            f"max_clients must be at least servers = {servers}, got {max_clients}"
        )
    points = np.linspace(servers, max_clients, _CURVE_POINTS)
    return np.unique(np.round(points).astype(int))


def plot_speedup(
    path: str,
    clients: NDArray[np.int_],
    speedups: NDArray[np.float64],
    servers: int,
    title: str,
) -> None:
    """Draw the speed-up against the number of clients into a PNG at ``path``."""
    require("matplotlib", "experiment", "the speed-up plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(6.0, 4.0))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot(clients, speedups, marker=".", label="expected speed-up")
    axes.axhline(servers, color="grey", linestyle="--", label=f"M = {servers}")
    axes.set_xlabel("clients per round")
    axes.set_ylabel("E[T FedAvg] / E[T P-FedAvg]")
    axes.set_title(title)
    axes.set_ylim(bottom=0.0)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # a count of clients
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)


def run(args: argparse.Namespace) -> None:
    """Build the graph and mixing, print the report, draw the curve."""
    adj = adjacency(
        args.topology,
        args.servers,
        degree=args.degree,
        probability=args.probability,
        rows=args.rows,
        seed=args.seed,
    )
    mixing = mixing_matrix(adj, args.mixing)
    degrees = adj.sum(axis=1)
    timing = {
        "bandwidth": args.bandwidth,
        "beta": args.beta,
        "delay": args.delay,
        "delay_mean": args.delay_mean,
        "samples": args.samples,
        "seed": args.seed,
    }
    traffic = volumes(args.model_size, args.clients, degrees)
    fedavg, pfedavg = expected_round_times(
        args.model_size, args.clients, degrees, **timing
    )
    curve_clients = client_grid(args.servers, args.max_clients)
    curve = np.array(
        [expected_speedup(args.model_size, k, degrees, **timing) for k in curve_clients]
    )

    rate = consensus_rate(mixing)
    print(
        f"topology: {args.topology}, M = {args.servers} servers, "
        f"{int(adj.sum()) // 2} edges, degrees {degrees.min()}-{degrees.max()}"
    )
    print(f"mixing: {args.mixing}")
    with np.printoptions(precision=3, suppress=True, linewidth=120):
        print(f"W =\n{mixing}")
    print(f"rho(W) = ||W - 11^T/M||_2 = {rate:.4f}")
    print(f"per-round volume (model-size units), {args.clients} clients a round:")
    for name, value in traffic.items():
        print(f"  {name:14s} {value:.6g}")
    print(f"expected round time: FedAvg {fedavg:.6g} s, P-FedAvg {pfedavg:.6g} s")
    print(f"expected speed-up: {fedavg / pfedavg:.3f}")
    title = f"{args.topology}, M = {args.servers}, {args.mixing} (rho = {rate:.3f})"
    plot_speedup(args.plot, curve_clients, curve, args.servers, title)
    print(
        f"speed-up curve ({curve_clients[0]}..{curve_clients[-1]} clients a round): "
        f"{args.plot}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line tool; bad parameters exit with status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        run(args)
    except ValueError as error:
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

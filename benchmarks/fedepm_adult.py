"""FedEPM against SFedAvg and SFedProx on Adult, the FedEPM paper's experiment.

Adult processed as the authors' code does (``adult_matrix``: their 45,222 x 14
matrix; every column scaled to unit norm, rows shuffled per split, in float64), split into
m = 100 contiguous blocks of random sizes (the official ``FedEPM.m`` draw: m - 1
distinct cut points, redrawn until every client holds more than 1% of d/m);
f_i is the mean logistic loss of client i plus 1e-3/(2 d_i) ||x||^2 (no
intercept), F = sum_i f_i. rho = 0.5, noise 0.1 (epsilon per upload), k0 in
{4, 10, 20}, three splits. Every run goes through Flower's strategy loop on an
in-process grid with the pack's clients.

The centralised optimum of the same objective, min_x F(x)/m, is computed in the
same script by Newton's method with a line search on the exact Hessian (and
cross-checked with cvxpy when ``--cvxpy``). Reports F/m of the server model per
communication round, rounds to within 1e-3 of the optimum, the round at which
the official stopping rules fire (F and grad F computed centrally, as the
official simulation does), accuracy, and epsilon spent.

Run (about 5 minutes on 2 cores)::

    python benchmarks/fedepm_adult.py
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import time
from pathlib import Path

import matplotlib
import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from flwr_prox_strategies import (
    FedEPM,
    FedEPMClient,
    SFedAvg,
    SFedAvgClient,
    SFedProx,
    to_client_app,
)
from flwr_prox_strategies.algorithms.fedepm import official_partition, official_stop
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
from flwr_prox_strategies.task.datasets import adult_matrix

RIDGE = 1e-3
METHODS = {
    "FedEPM": (FedEPM, FedEPMClient),
    "SFedAvg": (SFedAvg, SFedAvgClient),
    "SFedProx": (SFedProx, SFedAvgClient),
}


class Objective:
    """F(x) = sum_i f_i(x) and its derivatives, vectorised over clients."""

    def __init__(self, a: np.ndarray, b: np.ndarray, blocks: list[np.ndarray]) -> None:
        self.a, self.b, self.m = a, b, len(blocks)
        sizes = np.array([len(block) for block in blocks], dtype=np.float64)
        self.weight = np.empty(len(b))
        for block, size in zip(blocks, sizes, strict=True):
            self.weight[block] = 1.0 / size  # each sample weighs 1/d_i
        self.ridge = RIDGE * float(np.sum(1.0 / sizes))  # sum_i beta / d_i

    def value(self, x: np.ndarray) -> float:
        z = self.a @ x
        losses = np.logaddexp(0.0, z) - self.b * z
        return float(self.weight @ losses + 0.5 * self.ridge * x @ x)

    def gradient(self, x: np.ndarray) -> np.ndarray:
        p = 1.0 / (1.0 + np.exp(-(self.a @ x)))
        return self.a.T @ (self.weight * (p - self.b)) + self.ridge * x

    def hessian(self, x: np.ndarray) -> np.ndarray:
        p = 1.0 / (1.0 + np.exp(-(self.a @ x)))
        w = self.weight * p * (1 - p)
        return (self.a * w[:, None]).T @ self.a + self.ridge * np.eye(len(x))

    def minimise(self) -> np.ndarray:
        """Damped Newton to machine precision (the problem is strongly convex)."""
        x = np.zeros(self.a.shape[1])
        for _ in range(200):
            g = self.gradient(x)
            step = np.linalg.solve(self.hessian(x), g)
            t, f0 = 1.0, self.value(x)
            while self.value(x - t * step) > f0 - 0.25 * t * g @ step and t > 1e-12:
                t /= 2
            x = x - t * step
            if np.linalg.norm(g) < 1e-14:
                break
        return x


def cvxpy_optimum(objective: Objective) -> float:
    import cvxpy as cp

    x = cp.Variable(objective.a.shape[1])
    z = objective.a @ x
    expr = objective.weight @ (cp.logistic(z) - cp.multiply(objective.b, z))
    problem = cp.Problem(cp.Minimize(expr + 0.5 * objective.ridge * cp.sum_squares(x)))
    problem.solve()
    return float(problem.value) / objective.m


def run(
    method: str, k0: int, split: int, rounds: int, noise: float, m: int, rho: float
):
    raw, labels = adult_matrix()  # float64: F/m is compared to 1e-3 and below
    norms = np.linalg.norm(raw, axis=0)
    order = np.random.default_rng(split).permutation(len(labels))
    a = (raw / np.where(norms > 0, norms, 1.0))[order]
    b = labels[order].astype(np.float64)
    blocks = official_partition(b, num_partitions=m, seed=split)
    objective = Objective(a, b, blocks)
    strategy_cls, client_cls = METHODS[method]

    def client_fn(context):
        k = int(context.node_config["partition-id"])
        rows = blocks[k]
        # Full-batch methods: the client's data as one batch (no DataLoader cost).
        batches = [(torch.from_numpy(a[rows]), torch.from_numpy(b[rows]))]
        model = torch.nn.Linear(a.shape[1], 1, bias=False).double()
        return client_cls(
            model,
            batches,
            loss_fn=lambda out, y: torch.nn.functional.binary_cross_entropy_with_logits(
                out.squeeze(-1), y
            ),
            ridge=RIDGE,
            seed=1000 * split + k,
        )

    trace: list[dict] = []

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        x = arrays.to_numpy_ndarrays()[0].reshape(-1)
        value = objective.value(x)
        mean_gradient = objective.gradient(x) / m
        accuracy = float(np.mean((a @ x > 0) == (b > 0.5)))
        trace.append(
            {
                "round": server_round,
                "f/m": value / m,
                "err": float(mean_gradient @ mean_gradient),
                "F": value,
                "accuracy": accuracy,
            }
        )
        return MetricRecord({"f/m": value / m, "accuracy": accuracy})

    strategy = strategy_cls(
        num_clients=m,
        rho=rho,
        k0=k0,
        noise=noise,
        min_available_nodes=m,
        fraction_evaluate=0.0,
        seed=split,
    )
    grid = InProcessGrid(to_client_app(client_fn), num_nodes=m)
    start = time.monotonic()
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord([np.zeros((1, a.shape[1]))]),
        num_rounds=rounds,
        evaluate_fn=evaluate,
    )
    seconds = time.monotonic() - start
    epsilon = result.train_metrics_clientapp[rounds].get("dp-epsilon-total-max", 0.0)
    return trace, objective, float(epsilon), seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--k0", type=int, nargs="+", default=[4, 10, 20])
    parser.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--noise", type=float, default=0.1)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--rho", type=float, default=0.5)
    parser.add_argument("--cvxpy", action="store_true")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/fedepm_adult")
    )
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    # 14 features: torch's thread pool only adds contention on these tiny ops.
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    rows, traces, optima = [], {}, {}
    tol = 1e-9 * 14
    for split in args.splits:
        for k0 in args.k0:
            for method in args.methods:
                trace, objective, epsilon, seconds = run(
                    method, k0, split, args.rounds, args.noise, args.clients, args.rho
                )
                if split not in optima:
                    x_star = objective.minimise()
                    optima[split] = {
                        "f/m": objective.value(x_star) / objective.m,
                        "accuracy": float(
                            np.mean((objective.a @ x_star > 0) == (objective.b > 0.5))
                        ),
                        "norm": float(np.linalg.norm(x_star)),
                    }
                    if args.cvxpy:
                        optima[split]["cvxpy f/m"] = cvxpy_optimum(objective)
                    print(
                        json.dumps({"split": split, "optimum": optima[split]}),
                        flush=True,
                    )
                best = optima[split]["f/m"]
                stop_round, rule = None, 0
                for i in range(1, len(trace)):  # round 0 is the initial model
                    rule = official_stop(
                        [t["f/m"] * args.clients for t in trace[1 : i + 1]],
                        [t["err"] for t in trace[1 : i + 1]],
                        tol,
                    )
                    if rule:
                        stop_round = trace[i]["round"]
                        break
                within = [t["round"] for t in trace if t["f/m"] - best <= 1e-3]
                at_stop = trace[stop_round] if stop_round else trace[-1]
                rows.append(
                    {
                        "split": split,
                        "k0": k0,
                        "method": method,
                        "f/m final": trace[-1]["f/m"],
                        "gap final": trace[-1]["f/m"] - best,
                        "f/m at round 15": trace[min(15, len(trace) - 1)]["f/m"],
                        "rounds to 1e-3": within[0] if within else None,
                        "stop round": stop_round,
                        "stop rule": rule if stop_round else None,
                        "f/m at stop": at_stop["f/m"],
                        "accuracy at stop": at_stop["accuracy"],
                        "accuracy final": trace[-1]["accuracy"],
                        "epsilon total max": epsilon,
                        "seconds": seconds,
                    }
                )
                traces[(split, k0, method)] = [(t["round"], t["f/m"]) for t in trace]
                print(json.dumps(rows[-1]), flush=True)
    with open(args.out / "fedepm_adult.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (args.out / "optima.json").write_text(json.dumps(optima, indent=2))
    fig, axes = plt.subplots(
        1, len(args.k0), figsize=(5 * len(args.k0), 4), squeeze=False
    )
    for ax, k0 in zip(axes[0], args.k0, strict=True):
        for method in args.methods:
            curves = np.array(
                [[v for _, v in traces[(s, k0, method)]] for s in args.splits]
            )
            ax.plot(
                curves.mean(0), label=f"{method} (mean of {len(args.splits)} splits)"
            )
        ax.axhline(
            np.mean([optima[s]["f/m"] for s in args.splits]),
            color="k",
            linestyle="--",
            label="centralised optimum",
        )
        ax.set(
            title=f"Adult, m={args.clients}, rho={args.rho}, noise {args.noise}, k0={k0}",
            xlabel="communication round",
            ylabel="F(x)/m",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / "fedepm_adult.png", dpi=120)
    print(
        f"{'split':>5}{'k0':>4} {'method':<9}{'f/m@15':>9}{'gap':>10}{'to1e-3':>7}{'stop':>6}{'acc':>7}{'eps':>6}"
    )
    for row in rows:
        print(
            f"{row['split']:>5}{row['k0']:>4} {row['method']:<9}{row['f/m at round 15']:>9.4f}"
            f"{row['gap final']:>10.2e}{row['rounds to 1e-3'] or '-':>7}"
            f"{row['stop round'] or '-':>6}{row['accuracy at stop']:>7.4f}"
            f"{row['epsilon total max']:>6.1f}"
        )
    print("optima:", json.dumps(optima))
    print("time:", math.fsum(r["seconds"] for r in rows))


if __name__ == "__main__":
    main()

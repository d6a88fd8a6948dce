"""What measuring the rule's steps costs: time per optimiser step, side by side.

The rule counts every optimiser step over the model and checks that each
update held its term (torch's global step hooks, a hook per parameter on the
backward pass, a look at each gradient tensor at each step). This times, in
one process and alternating, the same local training three ways:

- ``plain``: the data gradient and SGD, no term (FedAvg's step, no rule);
- ``term``: the proximal term added straight to the gradients (what the
  pack's loop did before the steps were measured);
- ``rule``: the same term through ``FedProxRule.attach`` (added in the step's
  pre-hook and measured by the rule).

Models: the main job's MLP (64-200-200-10, 6 tensors) and a deeper MLP of
64 layers (128 tensors), where per-parameter hooks weigh most. Batches of 16
on one torch thread, as a simulated client gets it.

Run (about 1 min; nothing else running on the machine)::

    python benchmarks/step_overhead.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flwr_prox_strategies import FedProxRule
from flwr_prox_strategies.ops.proximal import ProximalTerm
from tests.helpers import context, train_message


def mlp(depth: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, 200), torch.nn.ReLU()]
    for _ in range(depth):
        layers += [torch.nn.Linear(200, 200), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(200, 10))


def run(way: str, depth: int, steps: int) -> float:
    """Seconds per optimiser step of ``steps`` steps done ``way``."""
    torch.manual_seed(0)
    model = mlp(depth)
    x, y = torch.randn(steps, 16, 64), torch.randint(0, 10, (steps, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    params = [p for p in model.parameters() if p.requires_grad]
    term = ProximalTerm(0.01, [p.detach().clone() for p in params])
    rule = None
    if way == "rule":
        arrays = [v.detach().numpy().copy() for v in model.state_dict().values()]
        message = train_message(arrays, {"proximal-mu": 0.01})
        rule = FedProxRule.from_message(message, context(), model)
        rule.attach(optimizer)
    loss_fn = torch.nn.functional.cross_entropy
    start = time.perf_counter()
    for i in range(steps):
        optimizer.zero_grad()
        loss_fn(model(x[i]), y[i]).backward()
        if way == "term":
            term.add_(params)
        optimizer.step()
    elapsed = time.perf_counter() - start
    if rule is not None:
        counts = rule.counts
        assert counts.applied == counts.steps == steps, counts
        rule.close()
    return elapsed / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        "| model | tensors | plain (µs/step) | term (µs/step) | rule, measured (µs/step) | rule / term |"
    )
    print("|---|---|---|---|---|---|")
    for depth, label in ((1, "main job's MLP"), (63, "64-layer MLP")):
        times: dict[str, list[float]] = {"plain": [], "term": [], "rule": []}
        run("rule", depth, 20)  # warm up
        for _ in range(args.repeats):
            for way in times:  # alternating: drift hits every way alike
                times[way].append(run(way, depth, args.steps))
        median = {way: statistics.median(t) * 1e6 for way, t in times.items()}
        tensors = len(list(mlp(depth).parameters()))
        print(
            f"| {label} | {tensors} | {median['plain']:.0f} | {median['term']:.0f} "
            f"| {median['rule']:.0f} | {median['rule'] / median['term']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""System test: examples/lora-finetune under `flwr run`.

A tiny GPT-2 (built from a config) with LoRA adapters on its attention; the
pack's FedProx and SCAFFOLD federate the adapters only, through
``federated_part``. Two runs side by side on one managed SuperLink, two
SuperNodes each: both must complete with every reply's term applied at every
step, every reply must carry the adapters alone (the bytes received are the
adapters' bytes, under 2 % of the model), and the two runs must end on
different adapters. That FedProx with a large mu ends elsewhere than with mu = 0
on the adapters is proven in process (``tests/test_federated_part.py``).
"""

from __future__ import annotations

import ast
import re

import pytest
import torch

from .engine import REPO, AppRun, managed_engine, run_apps

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "lora-finetune"
NUM_NODES = 2
RUNS = {
    "fedprox": "num-server-rounds=2 algorithm='fedprox' proximal-mu=1.0",
    "scaffold": "num-server-rounds=2 algorithm='scaffold'",
}
APPLIED = {"fedprox": "proximal-mu-applied", "scaffold": "scaffold-applied"}
ADAPTER_VALUES = 2048  # 2 layers x (A: 4 x 64 + B: 192 x 4)
RECORDS = {"fedprox": 1, "scaffold": 2}  # the adapters; SCAFFOLD's control change


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, AppRun]:
    tmp = tmp_path_factory.mktemp("lora")
    queue = [
        AppRun(name, f"{cfg} output-path='{tmp / name}.pt'", tmp / f"{name}.pt")
        for name, cfg in RUNS.items()
    ]
    with managed_engine(tmp / "home") as env:
        env = {**env, "OMP_NUM_THREADS": "1"}
        run_apps(
            EXAMPLE,
            env,
            queue,
            num_supernodes=NUM_NODES,
            parallel=len(queue),
            timeout=600,
        )
    return {run.name: run for run in queue}


def train_records(log: str) -> list[dict]:
    """Each round's aggregated train metrics, as the ServerApp logged them."""
    found = re.findall(r"Aggregated MetricRecord: (\{.*?\})\s*$", log, re.M)
    return [ast.literal_eval(text) for text in found]


@pytest.mark.parametrize("name", list(RUNS))
def test_the_adapters_alone_travel_and_the_term_is_applied(runs, name):
    run = runs[name]
    assert run.status == "finished:completed", run.log[-3000:]
    rounds = train_records(run.log)
    assert len(rounds) == 2, run.log[-3000:]
    for metrics in rounds:
        assert metrics["replies-valid"] == NUM_NODES
        assert metrics["replies-term-incomplete"] == 0
        assert metrics[APPLIED[name]] == metrics["local-steps"] == 10
        # Per reply: the float32 adapters (SCAFFOLD: and their control
        # change) with the records' framing; nothing of the frozen model.
        per_reply = metrics["bytes-received"] / NUM_NODES
        payload = RECORDS[name] * 4 * ADAPTER_VALUES
        assert payload <= per_reply < 1.1 * payload, per_reply
    assert f"({ADAPTER_VALUES} values) of a model of" in run.log
    saved = torch.load(run.output)
    assert len(saved) == 4
    assert sum(t.numel() for t in saved.values()) == ADAPTER_VALUES


def test_the_two_algorithms_end_on_different_adapters(runs):
    ours, theirs = (torch.load(runs[name].output) for name in RUNS)
    apart = max(float((ours[k] - theirs[k]).abs().max()) for k in ours)
    assert apart > 1e-3

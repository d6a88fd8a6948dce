"""System test: examples/quickstart-pytorch-lightning under `flwr run`.

The example is Flower's quickstart-pytorch-lightning (Lightning's
``Trainer.fit`` with automatic optimisation, Adam in ``configure_optimizers``)
with the pack's strategies and the Lightning callback. One managed SuperLink
runs, two at a time:

* FedProx and FedDyn (Flower's Adam) and SCAFFOLD (plain SGD, ``optimizer="auto"``)
  must complete with every reply saying its term reached every update
  (``<algorithm>-applied`` equal to ``local-steps``, no reply counted in
  ``replies-term-incomplete``), and each end on its own final model (that each
  algorithm's run differs from FedAvg's under the same optimiser is proven in
  process, with the real Lightning: ``tests/test_frameworks.py``);
* SCAFFOLD with the example's Adam (``optimizer='adam'``) must end
  ``finished:failed``, its last error naming the plain-SGD requirement.
"""

from __future__ import annotations

import ast
import re

import pytest
import torch

from .engine import REPO, AppRun, managed_engine, run_apps

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "quickstart-pytorch-lightning"
NUM_NODES = 4
PARALLEL = 2
BASE = "max-epochs=1 seed=0"
ROUNDS = "num-server-rounds=2"
RUNS = {
    "fedprox": f"{ROUNDS} algorithm='fedprox' proximal-mu=1.0",
    "feddyn": f"{ROUNDS} algorithm='feddyn' feddyn-alpha=0.1",
    "scaffold": f"{ROUNDS} algorithm='scaffold'",
    # 3 rounds: a pack strategy gives up after 3 in a row without a valid reply
    "scaffold-adam": "num-server-rounds=3 algorithm='scaffold' optimizer='adam'",
}
APPLIED = {
    "fedprox": "proximal-mu-applied",
    "feddyn": "feddyn-applied",
    "scaffold": "scaffold-applied",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, AppRun]:
    tmp = tmp_path_factory.mktemp("lightning")
    queue = [
        AppRun(name, f"{BASE} {cfg} output-path='{tmp / name}.pt'", tmp / f"{name}.pt")
        for name, cfg in RUNS.items()
    ]
    with managed_engine(tmp / "home") as env:
        env = {**env, "OMP_NUM_THREADS": "1"}
        run_apps(
            EXAMPLE,
            env,
            queue,
            num_supernodes=NUM_NODES,
            parallel=PARALLEL,
            timeout=900,
        )
    return {run.name: run for run in queue}


def train_records(log: str) -> list[dict]:
    """The aggregated train metrics of each round, as the ServerApp logged them."""
    found = re.findall(r"Aggregated MetricRecord: (\{'train_loss'.*?\})\s*$", log, re.M)
    return [ast.literal_eval(text) for text in found]


@pytest.mark.parametrize("name", list(APPLIED))
def test_each_algorithm_really_applies_its_term(runs: dict[str, AppRun], name: str):
    run = runs[name]
    assert run.status == "finished:completed", run.log[-3000:]
    rounds = train_records(run.log)
    assert len(rounds) == 2, run.log[-3000:]
    for metrics in rounds:
        assert metrics["replies-valid"] == NUM_NODES // 2
        assert metrics["replies-term-incomplete"] == 0
        assert metrics[APPLIED[name]] == metrics["local-steps"] > 0
    ours = torch.load(run.output)
    for other in APPLIED:
        if other != name and runs[other].output.exists():
            theirs = torch.load(runs[other].output)
            apart = max(float((ours[k] - theirs[k]).abs().max()) for k in ours)
            assert apart > 1e-4, f"{name} and {other} ended on one model"


def test_scaffold_with_adam_fails_and_says_why(runs: dict[str, AppRun]):
    run = runs["scaffold-adam"]
    assert run.status == "finished:failed", (run.status, run.log[-3000:])
    failure = [line for line in run.log.splitlines() if "no round aggregated" in line]
    assert failure, run.log[-3000:]
    assert "needs torch.optim.SGD without momentum" in failure[-1]
    assert "got Adam" in failure[-1]

"""System test: examples/advanced-pytorch under `flwr run`, good runs and mistakes.

The example is Flower's advanced-pytorch (a CustomFedAvg strategy whose own
``start()`` logs, writes results.json each round and checkpoints the best
model; clients with a personal head in ``context.state``) on the pack's
strategies and client rules. One managed SuperLink runs six runs side by side:

* FedProx, SCAFFOLD and FedDyn must complete, write the example's results.json
  and a best-model checkpoint, and end better than chance;
* three mistakes a user makes (SCAFFOLD with momentum kept, FedDyn with the
  example's own reply instead of ``rule.reply(...)``, a FedDyn server with
  FedProx's client rule) must fail the run, inside the user's own ``start()``,
  with a log that says why.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from flwr_prox_strategies._executables import flower_executable
from flwr_prox_strategies.task.datasets import candidate_dirs

from .engine import REPO, managed_engine, run_log, wait_finished

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "advanced-pytorch"
NUM_NODES = 3
# Small enough for CI: every node trains on its share of 2,000 images each round
# (fraction-train 1.0), the server evaluates on 1,000 test images.
SMALL = (
    "num-train-images=2000 num-test-images=1000 fraction-train=1.0 "
    "fraction-evaluate=0.5 local-epochs=1"
)
GOOD_ROUNDS = 3
GOOD = {
    "fedprox": "algorithm='fedprox'",
    "scaffold": "algorithm='scaffold'",
    "feddyn": "algorithm='feddyn'",
}
# Each mistake, and what the failed run's log must say about it.
MISTAKES = {
    "keep-momentum": ("algorithm='scaffold' keep-momentum=true", ["momentum"]),
    "own-reply": ("algorithm='feddyn' own-reply=true", ["rule.reply("]),
    "client-rule": (
        "algorithm='feddyn' client-rule='fedprox'",
        ["FedDynRule", "FedProxRule"],
    ),
}


@dataclass
class Run:
    """One submitted run: its id, output root, final status and log."""

    run_id: str
    output: Path
    status: str = ""
    log: str = ""

    def results(self) -> list[Path]:
        return sorted(self.output.glob("*/*/results.json"))

    def rounds_written(self) -> int:
        found = self.results()
        try:
            return len(json.loads(found[-1].read_text())) if found else 0
        except ValueError:  # being written
            return 0

    def ended(self, name: str) -> bool:
        """A cheap sign that the run ended (then its status is read every 2 s).

        The ServerApp writes the final model last; a mistake's run stops in
        round 3, after results.json's second round.
        """
        if any(self.output.glob("*/*/final_model.pt")):
            return True
        return name in MISTAKES and self.rounds_written() >= 2


def fashion_mnist_dir() -> Path:
    """The offline Fashion-MNIST folder the pack finds, or skip."""
    for folder in candidate_dirs("fashion-mnist"):
        if any(folder.glob("train-images-idx3-ubyte*")):
            return folder
    pytest.skip("Fashion-MNIST's idx files are not on this machine")


def submit(env: dict[str, str], run_config: str) -> str:
    """``flwr run`` the example (not streamed: runs go side by side); its run id."""
    out = subprocess.run(
        [
            flower_executable("flwr"),
            "run",
            str(EXAMPLE),
            "--format",
            "json",
            "--federation-config",
            f"num-supernodes={NUM_NODES} client-resources-num-cpus=1",
            "--run-config",
            run_config,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return str(json.loads(out.stdout)["run-id"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    """The six runs on one managed SuperLink, each waited for to its end."""
    tmp = tmp_path_factory.mktemp("advanced")
    data = fashion_mnist_dir()
    wanted = {
        name: f"{cfg} num-server-rounds={GOOD_ROUNDS}" for name, cfg in GOOD.items()
    }
    wanted.update(
        {name: f"{cfg} num-server-rounds=3" for name, (cfg, _) in MISTAKES.items()}
    )
    with managed_engine(tmp / "home") as env:
        # One torch thread per process: six runs share two cores.
        env = {**env, "OMP_NUM_THREADS": "1"}
        submitted = {}
        for name, config in wanted.items():
            output = tmp / name
            run_config = f"{SMALL} {config} data-dir='{data}' output-root='{output}'"
            submitted[name] = Run(submit(env, run_config), output)
        deadline = time.monotonic() + 900
        for name, run in submitted.items():
            run.status = wait_finished(
                run.run_id, env, None, deadline, lambda r=run, n=name: r.ended(n)
            )
            if run.status != "finished:completed" or name in MISTAKES:
                run.log = run_log(run.run_id, env)
        yield submitted


@pytest.mark.parametrize("name", list(GOOD))
def test_algorithm_completes_with_results_and_checkpoint(
    runs: dict[str, Run], name: str
) -> None:
    run = runs[name]
    assert run.status == "finished:completed", run.log[-3000:]
    [results_file] = run.results()
    folder = results_file.parent
    results = json.loads(results_file.read_text())
    # results.json: one entry per round, written by the example's own start()
    assert [r["round"] for r in results] == list(range(1, GOOD_ROUNDS + 1))
    last = results[-1]
    assert last["train_metrics"]["replies-valid"] == NUM_NODES
    # Better than chance (10 classes) after the rounds
    assert last["evaluate_metrics_serverapp"]["accuracy"] > 0.2, results
    assert last["evaluate_metrics_clientapp"]["eval_acc"] > 0.2, results
    # The best model's checkpoint, the final model and the run config
    assert list(folder.glob("model_state_acc_*_round_*.pth"))
    assert (folder / "final_model.pt").stat().st_size > 10_000
    config = json.loads((folder / "run_config.json").read_text())
    assert config["algorithm"] == name


@pytest.mark.parametrize("name", list(MISTAKES))
def test_mistake_fails_the_run_and_says_why(runs: dict[str, Run], name: str) -> None:
    run = runs[name]
    log = run.log
    assert run.status == "finished:failed", (run.status, log[-3000:])
    assert "no round aggregated" in log, log[-3000:]
    for needle in MISTAKES[name][1]:
        assert needle in log, (needle, log[-3000:])

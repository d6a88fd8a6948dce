"""System test: examples/quickstart-pytorch under `flwr run`, against the pack's clients.

The example is Flower's quickstart-pytorch (a Message-API ClientApp with the
user's own ``train()`` loop) with the pack's client rules added. For FedProx,
FedDyn, SCAFFOLD and FedDC this test runs it with ``flwr run`` on 4 simulated
SuperNodes, then runs the example's own ServerApp ``main`` in-process, on the
same data loaders, model and seed, but with the pack's ``XxxClient``
NumPyClients (mounted by ``to_client_app``) as the clients. The final models
must agree to float rounding: the rules inside the user's loop and inside the
pack's loop are one rule.
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.common.config import get_fused_config_from_dir, parse_config_args

from flwr_prox_strategies import (
    FedDCClient,
    FedDynClient,
    FedProxClient,
    ScaffoldClient,
    to_client_app,
)
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid

from .engine import REPO, flwr_submit, managed_engine, run_log, wait_finished

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "quickstart-pytorch"
NUM_NODES = 4
# One torch thread on both sides: the simulation gives each ClientApp one CPU,
# and with another thread count conv's reductions round differently (1e-3
# apart after two rounds here, where one thread on both sides gives 1e-6).
THREADS = 1
CLIENTS = {
    "fedprox": FedProxClient,
    "feddyn": FedDynClient,
    "scaffold": ScaffoldClient,
    "feddc": FedDCClient,
}
# Small enough for CI: 2 rounds of 1 epoch, batches of 32, 4 nodes.
SMALL = "num-server-rounds=2 local-epochs=1 batch-size=32 seed=7"


@pytest.fixture(scope="module")
def example() -> Iterator[dict[str, ModuleType]]:
    """The example's package, imported from its folder."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        yield {
            name: importlib.import_module(f"pytorchexample.{name}")
            for name in ("task", "server_app")
        }
    finally:
        sys.path.remove(str(EXAMPLE))


def run_config(algorithm: str, output: Path) -> str:
    return f"{SMALL} algorithm='{algorithm}' output-path='{output}'"


def submit_example(env: dict[str, str], overrides: str) -> str:
    """``flwr run`` the example (not streamed: runs go side by side); its run id."""
    return flwr_submit(
        EXAMPLE,
        env,
        overrides,
        f"num-supernodes={NUM_NODES} client-resources-num-cpus={THREADS}",
    )


def pack_clients(task: ModuleType, algorithm: str, config: dict):
    """The pack's NumPyClient on the example's model and loaders, as a ClientApp."""
    client_cls = CLIENTS[algorithm]

    def client_fn(context: Context):
        trainloader, testloader = task.load_data(
            context.node_config["partition-id"],
            context.node_config["num-partitions"],
            config["batch-size"],
            config["seed"],
        )
        return client_cls(
            task.Net(),
            trainloader,
            testloader,
            local_epochs=config["local-epochs"],
            learning_rate=config["learning-rate"],
            # As the example's train(): plain SGD for SCAFFOLD and FedDC.
            momentum=0.0 if client_cls.rule_class.plain_sgd else 0.9,
            loss_fn=torch.nn.CrossEntropyLoss(),
        )

    return to_client_app(client_fn)


def run_in_process(example: dict[str, ModuleType], algorithm: str, output: Path):
    """The example's ServerApp main, in-process, with the pack's clients."""
    config = get_fused_config_from_dir(
        EXAMPLE, parse_config_args([run_config(algorithm, output)])
    )
    grid = InProcessGrid(
        pack_clients(example["task"], algorithm, config),
        num_nodes=NUM_NODES,
        run_config=config,
    )
    context = Context(
        run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        example["server_app"].main(grid, context)
    finally:
        torch.set_num_threads(threads)


def initial_model(example: dict[str, ModuleType]) -> dict[str, torch.Tensor]:
    torch.manual_seed(int(parse_config_args([SMALL])["seed"]))
    return example["task"].Net().state_dict()


def test_example_equals_pack_clients(
    tmp_path: Path, example: dict[str, ModuleType]
) -> None:
    algorithms = list(CLIENTS)
    # One managed SuperLink runs the four algorithms' runs side by side.
    with managed_engine(tmp_path / "home") as env:
        env = {**env, "OMP_NUM_THREADS": str(THREADS)}
        runs = {
            algorithm: submit_example(
                env, run_config(algorithm, tmp_path / f"{algorithm}.pt")
            )
            for algorithm in algorithms
        }
        for algorithm, run_id in runs.items():
            saved = tmp_path / f"{algorithm}.pt"  # the example writes it last
            deadline = time.monotonic() + 900
            status = wait_finished(run_id, env, None, deadline, saved.exists)
            assert status == "finished:completed", run_log(run_id, env)[-3000:]
    initial = initial_model(example)
    for algorithm in algorithms:
        ours = tmp_path / f"{algorithm}-pack.pt"
        run_in_process(example, algorithm, ours)
        engine = torch.load(tmp_path / f"{algorithm}.pt")
        pack = torch.load(ours)
        assert list(engine) == list(pack) == list(initial)
        for key in engine:
            np.testing.assert_allclose(
                engine[key].numpy(),
                pack[key].numpy(),
                rtol=1e-4,
                atol=1e-5,
                err_msg=f"{algorithm}: {key}",
            )
        moved = sum(float((engine[k] - initial[k]).norm()) for k in engine)
        assert moved > 0.1, f"{algorithm}: the model did not move ({moved})"

"""The ServerApp's process holds no torch: strategies, rule texts, initial model.

Torch takes about 180 MB of a process; at thousands of simulated SuperNodes
that is a fifth of the simulation's. The server's half of the pack never
imports it: the strategies live apart from their clients, the server knows the
client rules by what the strategies declare, and the initial model is built in
a child process, to the same bits as in a process that has torch.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from flwr_prox_strategies.experiment import build
from flwr_prox_strategies.experiment.config import compose_config

SMALL = "num_clients=4 num_rounds=1 train.local_epochs=1 evaluate.central=false"


def run_python(code: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, check=False
    )


def test_the_server_s_modules_and_every_strategy_load_without_torch() -> None:
    out = run_python(
        """
        import sys
        import flwr_prox_strategies.experiment.server
        from flwr_prox_strategies.algorithms import ALGORITHMS
        from flwr_prox_strategies.core.server.rule_report import declared_rules
        from flwr_prox_strategies.core.server.metrics import rule_bookkeeping
        assert len(ALGORITHMS) == 10 and all(a.strategy for a in ALGORITHMS.values())
        assert len(declared_rules()) == 7, declared_rules()
        assert "scaffold-applied" in rule_bookkeeping()
        print(sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
        """
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().strip() == "[]"


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize(
    ("folder", "package", "name"),
    [
        ("plugin-fednova", "flwr_fednova", "FEDNOVA"),
        ("plugin-fedadmm", "flwr_fedadmm", "FEDADMM"),
    ],
)
def test_a_plugin_s_server_half_loads_without_torch_its_client_on_first_read(
    folder: str, package: str, name: str
) -> None:
    """The example plugins, written on ``extend``, keep the ServerApp torch-free."""
    out = run_python(
        f"""
        import sys
        sys.path.insert(0, {str(EXAMPLES / folder)!r})
        from flwr_prox_strategies.extend import ValidatedFedAvg, RoundUpdate, check_int
        from {package} import {name} as algorithm
        strategy = algorithm.cases["default"](4)
        assert isinstance(strategy, ValidatedFedAvg)
        print(sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
        client = algorithm.client  # the client half: torch, now
        assert client.__module__ == "{package}.client", client.__module__
        assert algorithm.rule.__module__ == "{package}.client"
        print("torch" in sys.modules)
        """
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().split("\n")[:2] == ["[]", "True"]


@pytest.mark.parametrize(
    "overrides",
    [
        f"{SMALL} strategy=scaffold model=mlp",
        f"{SMALL} strategy=feddc model=logreg seed=7 checkpoint_every=1",
    ],
)
def test_a_server_builds_its_run_without_torch_to_the_same_initial_model(
    overrides: str, tmp_path: Path
) -> None:
    """``build_experiment`` in a fresh process: no torch, the same bits as here."""
    out = run_python(
        f"""
        import pickle, sys
        from flwr_prox_strategies.experiment.build import build_experiment
        from flwr_prox_strategies.experiment.config import compose_config

        class Grid:  # four connected nodes; building sends no message
            def get_node_ids(self):
                return [1, 2, 3, 4]

        cfg = compose_config({overrides!r}.split(), locate=False)  # as a ServerApp
        run = build_experiment(Grid(), cfg, {{"output-dir": {str(tmp_path)!r}}})
        assert "torch" not in sys.modules, "the server loaded torch"
        assert run.client_states is not None or cfg.checkpoint_every == 0
        arrays = [(k, v.dtype, v.shape, v.data) for k, v in run.initial.items()]
        sys.stdout.buffer.write(pickle.dumps(arrays))
        """
    )
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    served = pickle.loads(out.stdout)
    here = build.built_here(compose_config(overrides.split()))  # torch loaded here
    assert [(k, v.dtype, v.shape, v.data) for k, v in here.items()] == served
    assert any(np.abs(v.numpy()).sum() > 0 for v in here.values())  # not all zeros


def test_the_child_s_failure_is_the_server_s_error_with_its_reason() -> None:
    cfg = compose_config([*SMALL.split(), "model=mlp", "model.hidden=[-3]"])
    with pytest.raises(RuntimeError, match="child process failed") as caught:
        build.built_in_child(cfg)
    assert "hidden" in str(caught.value)


def test_the_child_builds_what_this_process_builds() -> None:
    cfg = compose_config(f"{SMALL} model=cnn seed=3".split())
    child, here = build.built_in_child(cfg), build.built_here(cfg)
    assert list(child.keys()) == list(here.keys())
    for name in here:
        assert child[name].data == here[name].data, name


def test_a_wrong_client_target_fails_the_server_s_start_not_its_round() -> None:
    """The server checks names only; the child locates every target."""
    cfg = compose_config(
        [*SMALL.split(), "client._target_=flwr_prox_strategies.NoSuchClient"],
        locate=False,
    )
    with pytest.raises(RuntimeError, match="NoSuchClient"):
        build.built_in_child(cfg)


def test_torch_s_rng_state_is_kept_as_an_array_and_a_tensor_still_restores(
    tmp_path: Path,
) -> None:
    import torch

    from flwr_prox_strategies.experiment.checkpoint import restore_rng, rng_state
    from flwr_prox_strategies.experiment.store.checkpoint_file import (
        read_checkpoint,
        write_checkpoint,
    )

    torch.manual_seed(5)
    state = rng_state()
    assert isinstance(state["torch"], np.ndarray)  # no tensor: readable without torch
    expected = torch.rand(3)
    older = {**state, "torch": torch.from_numpy(state["torch"].copy())}  # as before
    write_checkpoint(tmp_path, {"rng": older})
    saved = read_checkpoint(tmp_path)["rng"]
    assert isinstance(saved["torch"], torch.Tensor)
    for kept in (saved, state):
        torch.rand(7)  # move on, then come back
        restore_rng(kept)
        assert torch.equal(torch.rand(3), expected)


def test_a_target_in_disguise_passes_the_server_s_name_check_but_never_runs() -> None:
    """``os.system`` behind a pack module's name: the child locates it and refuses."""
    disguised = "flwr_prox_strategies.task.datasets.os.system"
    cfg = compose_config([*SMALL.split(), f"model._target_={disguised}"], locate=False)
    with pytest.raises(RuntimeError, match="which is not allowed"):
        build.built_in_child(cfg)
    with pytest.raises(Exception, match="which is not allowed"):
        compose_config([*SMALL.split(), f"model._target_={disguised}"])

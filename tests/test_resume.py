"""Crash and resume of the pack's app, in-process: 4 rounds == 2 + crash + resume.

A "crash" is the Grid raising in the middle of round 3's train messages (half of
the clients have trained and written their round-3 state, the server never sees
a reply), as a SuperLink that dies mid-round. The resumed run is a new Flower
run: a new Grid, new node contexts with empty ``context.state``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Message, MessageType

from flwr_prox_strategies.algorithms import ALGORITHMS
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
from flwr_prox_strategies.core.transport.keys import SERVER_ROUND_KEY
from flwr_prox_strategies.experiment.checkpoint import (
    CHECKPOINT_FILE,
    CheckpointError,
    read_checkpoint,
    write_checkpoint,
)
from flwr_prox_strategies.experiment.server import run_experiment

SMALL = "num_clients=4 num_rounds=4 model=logreg train.local_epochs=1"


class SimulatedCrash(Exception):
    """The engine died (raised from inside ``send_and_receive``)."""


class CrashingGrid(InProcessGrid):
    """Delivers round ``crash_round``'s train messages to half the nodes, then dies."""

    def __init__(self, *args: Any, crash_round: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.crash_round = crash_round

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        messages = list(messages)
        rounds = {
            int(m.content.config_records["config"][SERVER_ROUND_KEY])
            for m in messages
            if m.metadata.message_type == MessageType.TRAIN
        }
        if self.crash_round in rounds:
            for message in messages[: max(1, len(messages) // 2)]:
                self._deliver(message)  # these clients train and save state
            raise SimulatedCrash(f"engine died in round {self.crash_round}")
        return super().send_and_receive(messages, timeout=timeout)


def app_run(
    out: Path, overrides: str, *, crash_round: int | None = None, **extra: Any
) -> Any:
    from apps.client_app import app as client_app

    run_config = {"overrides": overrides, "output-dir": str(out), **extra}
    num_nodes = int(overrides.split("num_clients=")[1].split()[0])
    if crash_round is None:
        grid = InProcessGrid(client_app, num_nodes=num_nodes, run_config=run_config)
    else:
        grid = CrashingGrid(
            client_app,
            num_nodes=num_nodes,
            run_config=run_config,
            crash_round=crash_round,
        )
    return run_experiment(grid, run_config)


def rounds_of(out: Path) -> list[dict]:
    rounds = json.loads((out / "results.json").read_text())["rounds"]
    for entry in rounds:
        entry.pop("elapsed-s", None)
        entry.pop("timing", None)
    return rounds


#: Overrides beside ``strategy=<name>`` that make a resume exercise the state.
EXTRA = {
    "fedavg": "evaluate.fraction_clients=0.5",
    # partial participation: the accepted table matters for unsampled clients
    "scaffold": "strategy.fraction_train=0.5",
    "pfedavg": "topology=ring topology.servers=2",
}
#: Algorithms a run does not resume, each with the test that shows it.
NOT_RESUMED = {"apfl": "test_apfl_is_not_resumed"}
#: Algorithms whose clients spend privacy at release (a Laplace-noised upload):
#: a client that uploaded in the round the engine died in has spent that budget,
#: and spends it again when the round is re-run, so its ledger ends one release
#: above the uninterrupted run's. Everything else must still match bit for bit.
RELEASE_LEDGERS = {"fedepm", "sfedavg", "sfedprox"}
#: Every algorithm of the table, and central DP around FedProx.
CASES = {
    **{
        name: f"strategy={name} {EXTRA.get(name, '')}".strip()
        for name in ALGORITHMS
        if name not in NOT_RESUMED
    },
    "central-dp": "strategy=fedprox privacy=central privacy.central.noise_multiplier=0.1",
    # The clients' state in <output-dir>/client-state only (not in context.state).
    "scaffold+disk": f"strategy=scaffold {EXTRA['scaffold']} client_state=disk",
    "feddc+disk": "strategy=feddc client_state=disk",
}


def test_every_algorithm_is_resumed_or_says_why_not() -> None:
    assert set(ALGORITHMS) <= set(CASES) | set(NOT_RESUMED)


@pytest.mark.parametrize("name", list(CASES))
def test_four_rounds_equal_two_plus_crash_plus_resume(tmp_path: Path, name) -> None:
    overrides = f"{SMALL} {CASES[name]}"
    np.random.seed(7)  # central DP draws its noise from numpy's global generator
    straight, _ = app_run(tmp_path / "straight", overrides)

    np.random.seed(7)
    crashed = tmp_path / "crashed"
    with pytest.raises(SimulatedCrash):
        app_run(crashed, overrides, crash_round=3)
    assert read_checkpoint(crashed)["round"] == 2
    partial = json.loads((crashed / "results.json").read_text())
    assert partial["summary"]["complete"] is False
    assert "SimulatedCrash" in partial["failure"]
    # each round's client metrics were written as the round ended
    assert [r["round"] for r in partial["rounds"] if "train" in r] == [1, 2]
    if name.split("+")[0] in ("scaffold", "feddyn", "feddc"):
        assert sorted(p.name for p in (crashed / "client-state").iterdir())

    np.random.seed(12345)  # the checkpoint's RNG state must win over this
    resumed, out = app_run(crashed, overrides, resume=str(crashed))
    assert out == crashed
    assert sorted(resumed.train_metrics_clientapp) == [3, 4]  # the run's numbers
    a = straight.arrays.to_numpy_ndarrays()
    b = resumed.arrays.to_numpy_ndarrays()
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)  # bit for bit
    if name in RELEASE_LEDGERS:
        assert_spent_again_only_by_the_crashed_rounds_uploaders(
            rounds_of(crashed), rounds_of(tmp_path / "straight")
        )
    else:
        assert rounds_of(crashed) == rounds_of(tmp_path / "straight")
    final = json.loads((crashed / "results.json").read_text())
    assert final["summary"]["complete"] is True
    assert "failure" not in final
    assert final["resumed"][0]["from-round"] == 2
    assert read_checkpoint(crashed)["round"] == 4
    saved = read_checkpoint(crashed)["model"]["arrays"]
    assert all(np.array_equal(x, y) for x, y in zip(a, saved, strict=True))
    assert (crashed / "metrics.png").stat().st_size > 10_000


def assert_spent_again_only_by_the_crashed_rounds_uploaders(
    resumed: list[dict], straight: list[dict]
) -> None:
    """Equal rounds but the ledger; the ledger one release higher for some clients.

    The clients that uploaded in round 3 before the engine died released a noisy
    model: their budget is spent, and the re-run round spends it again.
    """

    def without_ledger(rounds: list[dict]) -> list[dict]:
        return [
            {
                phase: (
                    {k: v for k, v in values.items() if not k.startswith("dp-epsilon")}
                    if isinstance(values, dict)
                    else values
                )
                for phase, values in entry.items()
            }
            for entry in rounds
        ]

    assert without_ledger(resumed) == without_ledger(straight)
    last_resumed, last_straight = resumed[-1]["train"], straight[-1]["train"]
    keys = last_straight["dp-epsilon-client-keys"]
    assert last_resumed["dp-epsilon-client-keys"] == keys
    release = last_straight["dp-epsilon"]  # one upload's epsilon
    extra = np.subtract(
        last_resumed["dp-epsilon-total-per-client"],
        last_straight["dp-epsilon-total-per-client"],
    )
    assert np.all(np.isclose(extra, 0.0) | np.isclose(extra, release)), extra
    assert np.isclose(extra, release).sum() >= 1  # the crashed round's uploads


def test_elapsed_is_when_each_round_ended(tmp_path: Path) -> None:
    app_run(tmp_path, f"{SMALL} strategy=fedavg")
    results = json.loads((tmp_path / "results.json").read_text())
    times = [r["elapsed-s"] for r in results["rounds"]]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert times[-1] <= results["summary"]["wall-time-s"]
    assert results["checkpoint-every"] == 1


def test_results_keep_one_size_a_client_only_up_to_the_limit(tmp_path: Path) -> None:
    """Beyond 100 clients the sizes go once to their own file, not every rewrite."""
    few = json.loads((app_run(tmp_path / "few", SMALL)[1] / "results.json").read_text())
    assert len(few["partition-sizes"]) == 4
    assert not (tmp_path / "few" / "partition-sizes.json").exists()
    many = "num_clients=150 num_rounds=1 model=logreg train.local_epochs=1 "
    many += "strategy=fedavg strategy.fraction_train=0.02 evaluate.central=false"
    out = app_run(tmp_path / "many", many)[1]
    results = json.loads((out / "results.json").read_text())
    sizes = json.loads((out / "partition-sizes.json").read_text())["partition-sizes"]
    assert "partition-sizes" not in results and len(sizes) == 150
    summary = results["partition-size"]
    assert summary["min"] == min(sizes) and summary["max"] == max(sizes)
    assert summary["mean"] == pytest.approx(sum(sizes) / 150)


def test_each_round_says_where_its_time_went(tmp_path: Path) -> None:
    """``timing``: the parts of the time between two round ends, summing to it."""
    app_run(tmp_path, f"{SMALL} strategy=scaffold")
    rounds = json.loads((tmp_path / "results.json").read_text())["rounds"]
    trained = [r for r in rounds if r["round"] >= 1]
    assert len(trained) == 4
    previous = next((r["elapsed-s"] for r in rounds if r["round"] == 0), None)
    for entry in trained:
        timing = entry["timing"]
        parts = ("grid-s", "strategy-s", "central-s", "write-s")
        assert all(timing[p] >= 0 for p in parts)
        assert sum(timing[p] for p in parts) == pytest.approx(timing["round-s"])
        # Every round trains and aggregates (strategy), evaluates centrally
        # (SMALL keeps evaluate.central) and waits for replies.
        assert timing["strategy-s"] > 0 and timing["central-s"] > 0
        assert timing["grid-s"] > 0
        if entry["round"] >= 2:  # the previous round end wrote the checkpoint
            assert timing["write-s"] > 0
        if previous is not None:
            assert timing["round-s"] <= entry["elapsed-s"] - previous + 1e-3
        previous = entry["elapsed-s"]


def test_resume_extends_a_finished_run(tmp_path: Path) -> None:
    straight, _ = app_run(tmp_path / "a", SMALL.replace("num_rounds=4", "num_rounds=3"))
    short = SMALL.replace("num_rounds=4", "num_rounds=2")
    app_run(tmp_path / "b", short)
    resumed, _ = app_run(
        tmp_path / "b",
        short.replace("num_rounds=2", "num_rounds=3"),
        resume=str(tmp_path / "b"),
    )
    for x, y in zip(
        straight.arrays.to_numpy_ndarrays(),
        resumed.arrays.to_numpy_ndarrays(),
        strict=True,
    ):
        assert np.array_equal(x, y)
    assert [r["round"] for r in rounds_of(tmp_path / "b")] == [0, 1, 2, 3]


def test_checkpoint_every_n_rounds_and_the_last(tmp_path: Path) -> None:
    overrides = f"{SMALL} strategy=fedavg checkpoint_every=3"
    with pytest.raises(SimulatedCrash):
        app_run(tmp_path, overrides, crash_round=3)
    with pytest.raises(CheckpointError, match=r"holds no checkpoint\.npz"):
        app_run(tmp_path, overrides, resume=str(tmp_path))
    app_run(tmp_path / "full", overrides.replace("num_rounds=4", "num_rounds=5"))
    assert read_checkpoint(tmp_path / "full")["round"] == 5  # 3, then the last


# ---------------------------------------------------------------- refusals
@pytest.fixture(scope="module")
def crashed_scaffold(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("scaffold")
    with pytest.raises(SimulatedCrash):
        app_run(out, f"{SMALL} strategy=scaffold", crash_round=2)
    return out


def test_resume_refuses_another_configuration(crashed_scaffold: Path) -> None:
    overrides = f"{SMALL} strategy=scaffold train.learning_rate=0.05 seed=3"
    with pytest.raises(CheckpointError) as err:
        app_run(crashed_scaffold, overrides, resume=str(crashed_scaffold))
    message = str(err.value)
    assert "train.learning_rate: 0.1 there, 0.05 here" in message
    assert "seed: 0 there, 3 here" in message
    assert "config.yaml" in message


def test_resume_refuses_a_missing_or_damaged_checkpoint(
    crashed_scaffold: Path, tmp_path: Path
) -> None:
    overrides = f"{SMALL} strategy=scaffold"
    with pytest.raises(CheckpointError, match="does not exist"):
        app_run(tmp_path / "nowhere", overrides, resume=str(tmp_path / "nowhere"))
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    raw = bytearray((crashed_scaffold / CHECKPOINT_FILE).read_bytes())
    (damaged / CHECKPOINT_FILE).write_bytes(raw[: len(raw) // 2])  # cut short
    with pytest.raises(CheckpointError, match="damaged"):
        app_run(damaged, overrides, resume=str(damaged))
    flipped = raw.copy()
    flipped[len(raw) // 3] ^= 0xFF
    (damaged / CHECKPOINT_FILE).write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="damaged"):
        app_run(damaged, overrides, resume=str(damaged))


def test_a_new_run_refuses_a_folder_holding_a_run(crashed_scaffold: Path) -> None:
    with pytest.raises(CheckpointError, match="resume="):
        app_run(crashed_scaffold, f"{SMALL} strategy=scaffold")


def test_resume_refuses_another_output_dir(crashed_scaffold: Path, tmp_path) -> None:
    from apps.client_app import app as client_app

    run_config = {
        "overrides": f"{SMALL} strategy=scaffold",
        "output-dir": str(tmp_path),
        "resume": str(crashed_scaffold),
    }
    grid = InProcessGrid(client_app, num_nodes=4, run_config=run_config)
    with pytest.raises(CheckpointError, match="names another folder"):
        run_experiment(grid, run_config)


def test_stateful_clients_need_a_checkpoint_every_round(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="checkpoint_every=1"):
        app_run(tmp_path, f"{SMALL} strategy=scaffold checkpoint_every=2")


def test_apfl_is_not_resumed(tmp_path: Path) -> None:
    overrides = f"{SMALL} strategy=apfl"
    with pytest.raises(SimulatedCrash):
        app_run(tmp_path, overrides, crash_round=2)
    with pytest.raises(CheckpointError, match="APFL's clients update"):
        app_run(tmp_path, overrides, resume=str(tmp_path))


def test_stateful_run_without_output_dir_is_not_resumed(tmp_path, monkeypatch) -> None:
    from apps.client_app import app as client_app

    monkeypatch.setenv("FLWR_PROX_OUTPUT_ROOT", str(tmp_path))
    run_config = {"overrides": f"{SMALL} strategy=feddyn num_rounds=1"}
    grid = InProcessGrid(client_app, num_nodes=4, run_config=run_config)
    _, out = run_experiment(grid, run_config)
    assert read_checkpoint(out)["client-state"] is None
    with pytest.raises(CheckpointError, match="in memory only"):
        app_run(out, f"{SMALL} strategy=feddyn", resume=str(out))


# ------------------------------------------------------------------ format
def test_checkpoint_format_keeps_types_and_refuses_objects(tmp_path: Path) -> None:
    document = {
        "ints": {3: 7, -1: 2},
        "tuple": (1, 2.5, "x"),
        "set": {4, 5},
        "floats": [float("nan"), float("inf"), -0.0, 0.1],
        "np": np.float32(1.5),
        "i64": np.int64(2**40),
        "array": np.arange(6, dtype=np.float16).reshape(2, 3),
        "tensor": torch.arange(3, dtype=torch.uint8),
        "$odd": {"$array": "not a reference"},
        "rng": np.random.default_rng(0).bit_generator.state,
    }
    write_checkpoint(tmp_path, document)
    back = read_checkpoint(tmp_path)
    assert back["ints"] == {3: 7, -1: 2} and back["tuple"] == (1, 2.5, "x")
    assert back["set"] == {4, 5}
    assert np.isnan(back["floats"][0]) and back["floats"][1:] == [np.inf, -0.0, 0.1]
    assert type(back["np"]) is np.float32 and back["np"] == 1.5
    assert type(back["i64"]) is np.int64
    assert back["array"].dtype == np.float16 and back["array"].shape == (2, 3)
    assert torch.equal(back["tensor"], torch.arange(3, dtype=torch.uint8))
    assert back["$odd"] == {"$array": "not a reference"}
    assert back["rng"] == document["rng"]
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(TypeError, match=r"checkpoint\.thing"):
        write_checkpoint(tmp_path, {"thing": object()})
    assert read_checkpoint(tmp_path)["ints"] == {3: 7, -1: 2}  # old one intact

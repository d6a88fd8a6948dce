"""Experiment tracking, read back with each library's own reader.

TensorBoard's event reader, MLflow's client on its local store and the records
of W&B's offline run file (parsed with W&B's own protobuf ``Record``): two jobs
of a sweep give two runs, named by their overrides, with the configuration as
parameters and every round's metrics equal to ``results.json``'s. The drop-in
wrapper logs a Flower ``FedAvg`` and a pack strategy run by a user's own loop.
"""

from __future__ import annotations

import glob
import json
import logging
import struct
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from flwr_prox_strategies import FedProx, NoRoundAggregatedError
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
from flwr_prox_strategies.experiment.appdir import make_client_app
from flwr_prox_strategies.experiment.config import compose_config
from flwr_prox_strategies.experiment.server import run_experiment
from flwr_prox_strategies.experiment.track import (
    run_name_of,
    sweep_name,
    sweep_overrides,
    swept_of,
)
from flwr_prox_strategies.tracking import (
    InBackground,
    MLflowTracker,
    Tracked,
    Tracker,
    flat_params,
    round_metrics,
)

JOBS = ("strategy=fedavg", "strategy=fedprox strategy.mu=0.5")
BASE = "num_clients=2 num_rounds=2 model=logreg train.local_epochs=1"


def run_sweep(backend: str, folder: Path) -> list[dict[str, Any]]:
    """Run two jobs as a sweep runs them (same folder and group); their results."""
    documents = []
    for number, job in enumerate(JOBS):
        overrides = (
            f"{BASE} {job} logger={backend} logger.folder={folder} logger.group=g1"
        )
        run_config = {"overrides": overrides, "output-dir": str(folder / str(number))}
        grid = InProcessGrid(make_client_app(), num_nodes=2, run_config=run_config)
        run_experiment(grid, run_config)
        documents.append(
            json.loads((folder / str(number) / "results.json").read_text())
        )
    return documents


def expected(results: Mapping[str, Any]) -> dict[int, dict[str, float]]:
    """Every round's metrics as the run logs them, from ``results.json``."""
    return {int(r["round"]): round_metrics(r) for r in results["rounds"]}


def run_name(job: str) -> str:
    return run_name_of(f"{BASE} {job}".split())


def assert_rounds_equal(
    logged: Mapping[int, Mapping[str, float]],
    results: Mapping[str, Any],
    rel: float = 1e-12,
) -> None:
    want = expected(results)
    assert sorted(logged) == sorted(want)
    for rnd, metrics in want.items():
        assert "central/accuracy" in metrics
        if rnd > 0:  # round 0: the initial model's central evaluation only
            assert "train/replies-valid" in metrics and "timing/round-s" in metrics
        got = {k: v for k, v in logged[rnd].items() if k in metrics}
        assert got.keys() == metrics.keys(), set(metrics) - set(got)
        for key, value in metrics.items():
            assert got[key] == pytest.approx(value, rel=rel, abs=1e-12), key


# --- TensorBoard ----------------------------------------------------------------


def test_tensorboard_sweep_reads_back_with_tensorboards_reader(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    documents = run_sweep("tensorboard", tmp_path)
    runs = sorted((tmp_path / "tensorboard").iterdir())
    assert [r.name for r in runs] == sorted(run_name(job) for job in JOBS)
    for job, results in zip(JOBS, documents, strict=True):
        reader = EventAccumulator(str(tmp_path / "tensorboard" / run_name(job)))
        reader.Reload()
        logged: dict[int, dict[str, float]] = {}
        for tag in reader.Tags()["scalars"]:
            for event in reader.Scalars(tag):
                logged.setdefault(event.step, {})[tag] = event.value
        summary = logged.pop(max(logged))  # the last round, with the summary
        last = max(int(r["round"]) for r in results["rounds"])
        logged[last] = summary
        assert_rounds_equal(logged, results, rel=1e-6)  # event files keep float32
        assert summary["summary/final-accuracy"] == pytest.approx(
            results["summary"]["final-accuracy"], rel=1e-6
        )
        assert "config/text_summary" in reader.Tags()["tensors"]  # the parameters
        assert reader.Tags()["images"]  # the plots


# --- MLflow -----------------------------------------------------------------------


def test_mlflow_sweep_is_one_experiment_with_a_run_per_job(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    documents = run_sweep("mlflow", tmp_path)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("g1")
    assert experiment is not None
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == sorted(run_name(job) for job in JOBS)
    for job, results in zip(JOBS, documents, strict=True):
        run = runs[run_name(job)]
        assert run.info.status == "FINISHED"
        config = flat_params(results["config"])
        assert run.data.params["strategy._target_"] == config["strategy._target_"]
        assert run.data.params["num_rounds"] == "2"
        logged: dict[int, dict[str, float]] = {}
        for key in expected(results)[1]:
            for point in client.get_metric_history(run.info.run_id, key):
                logged.setdefault(point.step, {})[key] = point.value
        assert_rounds_equal(logged, results)
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"results.json", "metrics.png", "checkpoint.npz"} <= artifacts
    assert runs[run_name(JOBS[1])].data.params["strategy.mu"] == "0.5"


# --- Weights & Biases ---------------------------------------------------------------


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of an offline run file (``run-<id>.wandb``).

    W&B keeps no Python reader of its run files; the framing is LevelDB's log
    format (32 KiB blocks; each chunk: CRC, length, kind; kinds 1 full, 2
    first, 3 middle, 4 last) after a 7-byte header, and every record is W&B's
    own protobuf ``Record``.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_wandb_run(folder: Path, timeout: float = 60.0) -> dict[str, Any]:
    """Read an offline run once W&B's service has written its exit record.

    ``run.finish()`` returns before W&B's service process has flushed the run
    file; reading it at once finds no exit record on a loaded machine.
    """
    deadline = time.monotonic() + timeout
    while True:
        run = _read_wandb_run(folder)
        if run["exit"] is not None or time.monotonic() > deadline:
            return run
        time.sleep(0.1)


def _read_wandb_run(folder: Path) -> dict[str, Any]:
    (path,) = glob.glob(str(folder / "run-*.wandb"))
    run: dict[str, Any] = {"config": {}, "history": {}, "exit": None}
    for record in wandb_records(Path(path)):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["name"], run["group"] = record.run.display_name, record.run.run_group
        elif kind == "config":
            for item in record.config.update:
                run["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            step = row.pop("_step", record.history.step.num)
            run["history"].setdefault(step, {}).update(row)
        elif kind == "exit":
            run["exit"] = record.exit.exit_code
    return run


def test_wandb_sweep_is_one_group_of_offline_runs(tmp_path: Path) -> None:
    documents = run_sweep("wandb", tmp_path)
    folders = sorted(Path(p) for p in glob.glob(str(tmp_path / "wandb/offline-run-*")))
    assert len(folders) == 2
    runs = {run["name"]: run for run in map(read_wandb_run, folders)}
    assert sorted(runs) == sorted(run_name(job) for job in JOBS)
    for job, results in zip(JOBS, documents, strict=True):
        run = runs[run_name(job)]
        assert run["group"] == "g1" and run["exit"] == 0
        config = flat_params(results["config"])
        assert run["config"]["strategy._target_"] == config["strategy._target_"]
        assert run["config"]["num_rounds"] == 2
        assert_rounds_equal(run["history"], results)
        assert (folders[0] / "files" / "results.json").exists()


# --- the sweep's glue, progress and logs -------------------------------------------


def test_a_sweep_job_gets_the_sweep_folder_and_group_unless_set(tmp_path: Path) -> None:
    sweep = tmp_path / "multirun" / "2026-12-03" / "10-11-12"
    cfg = compose_config(["logger=mlflow"])
    assert sweep_overrides(cfg, sweep) == [
        f"logger.folder={sweep.resolve()}",
        "logger.group=2026-12-03_10-11-12",
    ]
    cfg = compose_config(["logger=mlflow", "logger.group=mine"])
    assert sweep_overrides(cfg, sweep, ["seed", "strategy.mu"]) == [
        f"logger.folder={sweep.resolve()}",
        "logger.swept=seed:strategy.mu",
    ]
    named = compose_config(["logger=mlflow", "logger.swept=seed:strategy.mu"])
    assert swept_of(named.logger.swept) == ["seed", "strategy.mu"]
    assert swept_of(["seed"]) == ["seed"] and swept_of(None) == []
    assert sweep_overrides(compose_config([]), sweep) == []
    assert sweep_name(tmp_path / "my-sweep") == "my-sweep"
    assert run_name_of(["engine=inprocess", "logger=wandb", "seed=1", "+x.y=2"]) == (
        "seed=1 +x.y=2"
    )
    assert run_name_of(["num_rounds=3", "seed=1", "strategy.mu=0.1"], ["seed"]) == (
        "seed=1"
    )


def test_sweep_runs_are_named_by_the_swept_keys(tmp_path: Path) -> None:
    from flwr_prox_strategies.experiment.sweeps.sweep import swept_keys
    from flwr_prox_strategies.experiment.track import build_tracker

    assert swept_keys(["-m", "strategy=fedavg,fedprox", "seed=0", "+x=1,2"]) == [
        "strategy",
        "x",
    ]
    cfg = compose_config(["logger=tensorboard", "logger.swept=strategy"])
    tracker = build_tracker(
        cfg, output_dir=tmp_path, overrides=["seed=0", "strategy=fedprox"]
    )
    assert tracker.log_dir == tmp_path / "tensorboard" / "strategy=fedprox"


def test_sweep_size_counts_the_basic_sweepers_jobs() -> None:
    from flwr_prox_strategies.experiment.sweeps.sweep import sweep_size

    basic = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
    argv = ["-m", "strategy=fedavg,fedprox", "seed=0,1,2", "num_rounds=3"]
    assert sweep_size(argv, basic) == 6
    assert sweep_size(["-m", "x=range(0,4)"], basic) == 4
    assert sweep_size(["-m", "x=interval(0,1)"], basic) is None
    assert sweep_size(argv, "hydra_plugins.optuna.OptunaSweeper") is None


# --- the background worker -----------------------------------------------------------


class Recording(Tracker):
    """A tracker that keeps what it is given (and can be held up or fail)."""

    name = "recording"

    def __init__(self, *, hold: threading.Event | None = None, fail_at=None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.hold = hold
        self.fail_at = fail_at

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.calls.append(("params", dict(params)))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self.hold is not None:
            assert self.hold.wait(60)
        if step == self.fail_at:
            raise ConnectionError("server gone")
        self.calls.append(("metrics", (step, dict(metrics))))

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        self.calls.append(("artifacts", list(paths)))

    def close(self, *, failed: bool = False) -> None:
        self.calls.append(("close", failed))


def test_a_held_up_backend_does_not_hold_up_the_caller() -> None:
    hold = threading.Event()
    backend = Recording(hold=hold)
    tracker = InBackground(backend)
    for step in range(1, 4):  # returns while the backend waits on the first
        tracker.log_metrics({"m": float(step)}, step=step)
    assert backend.calls == []
    hold.set()
    tracker.close()
    assert backend.calls == [
        ("metrics", (1, {"m": 1.0})),
        ("metrics", (2, {"m": 2.0})),
        ("metrics", (3, {"m": 3.0})),
        ("close", False),
    ]


def test_a_failing_backend_is_logged_once_and_the_caller_goes_on(caplog) -> None:
    backend = Recording(fail_at=2)
    tracker = InBackground(backend)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        for step in range(1, 4):
            tracker.log_metrics({"m": float(step)}, step=step)
        tracker.close()
    assert backend.calls == [("metrics", (1, {"m": 1.0}))]
    assert isinstance(tracker.error, ConnectionError)
    warnings = [r.getMessage() for r in caplog.records if "recording" in r.getMessage()]
    assert warnings == [
        "Tracking with recording stopped (log_metrics failed): "
        "ConnectionError: server gone"
    ]


def test_a_missing_library_names_the_extra(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "mlflow" else real(name, *a),
    )
    tracker = MLflowTracker(tracking_uri="sqlite:///x.db", experiment="e", run_name="r")
    with pytest.raises(ImportError, match=r"flwr-prox-strategies\[mlflow\]"):
        InBackground(tracker)


def test_round_metrics_flattens_sections_and_per_client_lists() -> None:
    entry = {
        "round": 3,
        "central": {"accuracy": 0.5, "loss": float("nan")},
        "train": {"replies-valid": 4, "dp-epsilon-total-max": 1.5, "note": "x"},
        "evaluate": {
            "eval-client-keys": [7, 9],
            "personal-accuracy-per-client": [0.8, 0.6],
            "personal-accuracy-clients-mean": 0.7,
        },
        "timing": {"round-s": 1.25},
        "elapsed-s": 10.0,
    }
    assert round_metrics(entry) == {
        "central/accuracy": 0.5,
        "train/replies-valid": 4.0,
        "train/dp-epsilon-total-max": 1.5,
        "evaluate/personal-accuracy-per-client/7": 0.8,
        "evaluate/personal-accuracy-per-client/9": 0.6,
        "evaluate/personal-accuracy-clients-mean": 0.7,
        "timing/round-s": 1.25,
        "elapsed-s": 10.0,
    }


# --- drop-in: any strategy, in a user's own ServerApp --------------------------------


def least_squares_app(*, fail: bool = False) -> ClientApp:
    """Clients that step towards their own target; replies as Flower's examples."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        if fail:
            raise RuntimeError("no data")
        k = int(context.node_config["partition-id"])
        (w,) = msg.content["arrays"].to_numpy_ndarrays()
        target = np.full_like(w, float(k + 1))
        w = w + 0.5 * (target - w)
        metrics = MetricRecord({"train_loss": float(np.sum((w - target) ** 2))})
        metrics["num-examples"] = 10
        content = RecordDict({"arrays": ArrayRecord([w]), "metrics": metrics})
        return Message(content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        metrics = MetricRecord({"eval_loss": 1.0, "num-examples": 10})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def test_tracked_logs_flowers_own_fedavg_round_by_round() -> None:
    backend = Recording()
    strategy = Tracked(
        FlowerFedAvg(fraction_evaluate=1.0),
        backend,
        params={"strategy": {"name": "fedavg"}},
        background=False,
    )

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        (w,) = arrays.to_numpy_ndarrays()
        return MetricRecord({"mean": float(w.mean())})

    grid = InProcessGrid(least_squares_app(), num_nodes=3)
    initial = ArrayRecord([np.zeros(2, dtype=np.float32)])
    result = strategy.start(
        grid=grid, initial_arrays=initial, num_rounds=3, evaluate_fn=central
    )
    assert backend.calls[0] == ("params", {"strategy.name": "fedavg"})
    assert backend.calls[-1] == ("close", False)
    rounds = [payload for kind, payload in backend.calls if kind == "metrics"]
    assert [step for step, _ in rounds] == [0, 1, 2, 3]
    for step, metrics in rounds[1:]:
        assert metrics["central/mean"] == pytest.approx(
            result.evaluate_metrics_serverapp[step]["mean"]
        )
        assert metrics["train/train_loss"] == pytest.approx(
            result.train_metrics_clientapp[step]["train_loss"]
        )
        assert metrics["train/replies-received"] == 3
        assert metrics["train/replies-with-error"] == 0
        assert metrics["evaluate/eval_loss"] == 1.0
        assert metrics["evaluate/replies-received"] == 3
        assert metrics["timing/round-s"] > 0
    # the wrapped strategy's instance is left as it was
    assert "aggregate_train" not in vars(strategy.strategy)
    assert strategy.fraction_evaluate == 1.0  # its attributes show through


def test_tracked_keeps_the_pack_strategys_failure_and_marks_the_run_failed() -> None:
    backend = Recording()
    strategy = Tracked(FedProx(proximal_mu=0.1), backend, background=False)
    grid = InProcessGrid(least_squares_app(fail=True), num_nodes=2)
    initial = ArrayRecord([np.zeros(2, dtype=np.float32)])
    with pytest.raises(NoRoundAggregatedError):
        strategy.start(grid=grid, initial_arrays=initial, num_rounds=2)
    assert backend.calls[-1] == ("close", True)
    rounds = [payload for kind, payload in backend.calls if kind == "metrics"]
    assert [step for step, _ in rounds] == [1, 2]  # logged after each evaluation
    assert all(m["train/replies-received"] == 2 for _, m in rounds)
    assert all(m["train/replies-with-error"] == 2 for _, m in rounds)
    assert all(m["train/replies-valid"] == 0 for _, m in rounds)


def test_tracked_flowers_fedavg_with_every_client_failing_shows_it() -> None:
    """Flower's FedAvg ends such a run without an error: the log must say so."""
    backend = Recording()
    strategy = Tracked(FlowerFedAvg(), backend, background=False)
    grid = InProcessGrid(least_squares_app(fail=True), num_nodes=2)
    initial = ArrayRecord([np.zeros(2, dtype=np.float32)])
    strategy.start(grid=grid, initial_arrays=initial, num_rounds=2)
    rounds = [payload for kind, payload in backend.calls if kind == "metrics"]
    assert [m["train/replies-with-error"] for _, m in rounds] == [2, 2]
    assert not any(key.startswith("train/train") for _, m in rounds for key in m)


def test_an_experiment_where_every_client_fails_is_a_failed_tracked_run(
    tmp_path: Path,
) -> None:
    from mlflow.tracking import MlflowClient

    from flwr_prox_strategies import to_client_app

    def broken_client(context):
        raise RuntimeError("cannot load my data")

    run_config = {
        "overrides": f"{BASE} logger=mlflow",
        "output-dir": str(tmp_path),
    }
    grid = InProcessGrid(
        to_client_app(broken_client), num_nodes=2, run_config=run_config
    )
    with pytest.raises(NoRoundAggregatedError):
        run_experiment(grid, run_config)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs(
        [client.get_experiment_by_name("flwr-prox-strategies").experiment_id]
    )
    assert run.info.status == "FAILED"
    assert run.data.metrics["train/replies-valid"] == 0
    assert run.data.metrics["train/replies-failed"] == 2


def test_tracked_refuses_what_is_not_a_strategy_or_tracker() -> None:
    with pytest.raises(TypeError, match="Flower Strategy"):
        Tracked(object(), Recording())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Tracker"):
        Tracked(FedProx(proximal_mu=0.1), object())  # type: ignore[arg-type]


def test_tracked_logs_into_the_users_own_wandb_run(tmp_path: Path) -> None:
    import wandb

    from flwr_prox_strategies.tracking import WandbTracker

    run = wandb.init(
        project="advanced-pytorch",
        mode="offline",
        dir=str(tmp_path),
        reinit="create_new",
        settings=wandb.Settings(silent=True, console="off"),
    )
    strategy = Tracked(FlowerFedAvg(), WandbTracker(run=run), background=False)
    grid = InProcessGrid(least_squares_app(), num_nodes=2)
    initial = ArrayRecord([np.zeros(2, dtype=np.float32)])
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=2)
    run.log({"my-own": 1.0}, step=2)  # the user's run is still open, theirs
    run.finish()
    (folder,) = glob.glob(str(tmp_path / "wandb/offline-run-*"))
    logged = read_wandb_run(Path(folder))
    assert logged["exit"] == 0
    for step in (1, 2):
        assert logged["history"][step]["train/train_loss"] == pytest.approx(
            result.train_metrics_clientapp[step]["train_loss"]
        )
    assert logged["history"][2]["my-own"] == 1.0

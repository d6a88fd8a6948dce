"""Run one experiment on a Grid (server side) and build clients (client side).

``apps/server_app.py`` and ``apps/client_app.py`` are thin wrappers around
:func:`run_experiment` and :func:`make_client`; the sweep launcher and the tests
call the same functions, so there is one code path.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import functools
import os
import time
from collections.abc import Callable, Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from omegaconf import DictConfig, OmegaConf

from ..core.client.client import ProtocolError
from ..core.client.training import evaluate_model
from ..core.contract.ledger import PER_CLIENT_LIMIT
from ..core.privacy.secagg import SecAggPlus
from ..core.server.outcome import (
    AggregationStalledError,
    EveryClientRetiredError,
    NoRoundAggregatedError,
    ReplyTally,
)
from ..core.server.strategy import ValidatedFedAvg
from .checkpoint import (
    CHECKPOINT_FILE,
    RoundEnd,
    check_checkpointing,
    client_state_dir,
    load_resume,
    mirrors_client_state,
    refuse_used_folder,
    restore_rng,
    resume_blockers,
    resume_folder,
)
from .config import (
    RUN_OUTPUT_DIR,
    RUN_OUTPUT_ROOT,
    allowed_targets,
    build_model,
    build_strategy,
    client_factory,
    compose_config,
    overrides_from_run_config,
    wrap_central_dp,
    wrap_secure_aggregation,
)
from .data import (
    ArrayDataset,
    load_data,
    partition_indices,
    partition_of,
    partition_sizes,
    split_held_out,
    to_loader,
)
from .results import RunRecorder, plot_run, write_json
from .track import close_tracker, open_tracker

OUTPUT_ROOT_ENV = "FLWR_PROX_OUTPUT_ROOT"
PARTITION_SIZES_FILE = "partition-sizes.json"


def config_from_run_config(run_config: Mapping[str, Any]) -> DictConfig:
    """Compose ``conf/`` from Flower's run config (overrides, num-rounds, seed)."""
    return compose_config(overrides_from_run_config(run_config))


def output_dir_for(cfg: DictConfig, run_config: Mapping[str, Any]) -> Path:
    """Return the output folder: ``output-dir``, else a new one under the root."""
    explicit = str(run_config.get(RUN_OUTPUT_DIR, "") or "")
    if explicit:
        return Path(explicit).expanduser().resolve()
    root = str(
        run_config.get(RUN_OUTPUT_ROOT, "") or os.environ.get(OUTPUT_ROOT_ENV, "")
    )
    base = Path(root).expanduser() if root else Path.cwd() / "outputs"
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    name = (
        f"{stamp}-{cfg.strategy._target_.rsplit('.', 1)[-1].lower()}-{cfg.dataset.name}"
    )
    return (base / name).resolve()


def wait_for_clients(grid: Grid, expected: int, timeout: float) -> None:
    """Fail fast, with the fix, when the federation does not match ``num_clients``."""
    deadline = time.monotonic() + timeout
    while True:
        count = len(list(grid.get_node_ids()))
        if count == expected:
            return
        if count > expected or time.monotonic() >= deadline:
            raise RuntimeError(
                f"the configuration says num_clients={expected}, but {count} "
                "SuperNode(s) are connected. Size the simulation with `flwr run . "
                f'--federation-config "num-supernodes={expected}"` (or start '
                f"{expected} SuperNodes), or set num_clients={count} in the overrides."
            )
        log(INFO, "Waiting for SuperNodes: %d of %d connected", count, expected)
        time.sleep(1.0)


def make_evaluate_fn(
    cfg: DictConfig, recorder: RunRecorder, num_rounds: int, strategy: Any = None
):
    """Central evaluation of the global model on the test set, with progress logs.

    The strategy's :meth:`~..core.server.hooks.AlgorithmHooks.central_models` (FedDyn's
    mean of all clients' models, APFL's weighted average) are evaluated too, each
    under its own section of ``results.json``. With ``evaluate.central_train``
    the global model's loss and accuracy on the whole training set (the FedProx
    paper's training loss) go under ``central-train``.
    """
    data = load_data(cfg)
    loader = to_loader(data.test, batch_size=1024, shuffle=False)
    train_loader = (
        to_loader(data.train, batch_size=1024, shuffle=False)
        if cfg.evaluate.get("central_train", False)
        else None
    )
    model = build_model(cfg)
    start = time.monotonic()

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy, count = evaluate_model(
            model, loader, torch.nn.functional.cross_entropy
        )
        metrics: dict[str, int | float | list[int] | list[float]] = {
            "loss": loss,
            "accuracy": accuracy,
            "num-examples": count,
        }
        recorder.record(server_round, "central", metrics)
        if train_loader is not None:
            train_loss, train_acc, _ = evaluate_model(
                model, train_loader, torch.nn.functional.cross_entropy
            )
            recorder.record(
                server_round,
                "central-train",
                {"loss": train_loss, "accuracy": train_acc},
            )
        extra_models: dict[str, ArrayRecord] = getattr(
            strategy, "central_models", dict
        )()
        for section, extra in extra_models.items():
            model.load_state_dict(extra.to_torch_state_dict())
            extra_loss, extra_acc, _ = evaluate_model(
                model, loader, torch.nn.functional.cross_entropy
            )
            recorder.record(
                server_round, section, {"loss": extra_loss, "accuracy": extra_acc}
            )
        log(
            INFO,
            "[progress] round %d/%d: central accuracy %.4f, loss %.4f (%.1f s)",
            server_round,
            num_rounds,
            accuracy,
            loss,
            time.monotonic() - start,
        )
        return MetricRecord(metrics)

    return evaluate


def sizes_entry(sizes: list[int], output_dir: Path) -> dict[str, Any]:
    """Return the partition sizes for ``results.json``: all, or a summary.

    ``results.json`` is rewritten every round, so beyond
    :data:`~..core.privacy.PER_CLIENT_LIMIT` clients it keeps the min, mean and
    max, and every client's size goes once to ``partition-sizes.json``.
    """
    if len(sizes) <= PER_CLIENT_LIMIT:
        return {"partition-sizes": sizes}
    output_dir.mkdir(parents=True, exist_ok=True)
    write_json(output_dir / PARTITION_SIZES_FILE, {"partition-sizes": sizes})
    return {
        "partition-size": {
            "min": min(sizes),
            "mean": sum(sizes) / len(sizes),
            "max": max(sizes),
            "file": PARTITION_SIZES_FILE,
        }
    }


def run_experiment(
    grid: Grid, run_config: Mapping[str, Any], *, cfg: DictConfig | None = None
) -> tuple[Result, Path]:
    """Run the composed experiment on ``grid``; write results and plots.

    With ``resume`` in ``run_config``, the run in that folder continues from
    its checkpoint (:mod:`.checkpoint`): ``Result`` then holds the rounds this
    call ran, numbered as in the whole run; ``results.json`` holds every round.

    Returns
    -------
    tuple[Result, Path]
        Flower's ``Result`` and the output folder.
    """
    cfg = cfg if cfg is not None else config_from_run_config(run_config)
    num_clients = int(cfg["num_clients"])
    num_rounds = int(cfg["num_rounds"])
    wait_for_clients(grid, num_clients, float(cfg["node_wait_timeout"]))
    resume_dir = resume_folder(run_config)
    output_dir = resume_dir or output_dir_for(cfg, run_config)
    strategy = build_strategy(cfg)
    for inner in getattr(strategy, "inner", [strategy]):  # P-FedAvg's servers too
        if isinstance(inner, ValidatedFedAvg):
            inner.min_round_nodes = int(cfg["quorum"])
            inner.node_wait_timeout = float(cfg["node_wait_timeout"])
    every = check_checkpointing(cfg, strategy)
    resume = None
    if resume_dir is not None:  # the strategy's state is loaded here
        resume = load_resume(resume_dir, cfg, strategy, run_config)
    else:
        refuse_used_folder(output_dir)
    torch.manual_seed(int(cfg.seed))
    model = build_model(cfg)
    sizes = partition_sizes(cfg, num_clients)
    recorder = RunRecorder(
        output_dir,
        meta={
            "strategy": type(strategy).__name__,
            "dataset": cfg.dataset.name,
            "num-clients": num_clients,
            "num-rounds": num_rounds,
            **sizes_entry(sizes, output_dir),
            "config": OmegaConf.to_container(cfg, resolve=True),
        },
        target=float(cfg["target_accuracy"]),
    )
    recorder.meta["checkpoint-every"] = every
    done = 0
    if resume is not None:
        done = resume.round
        recorder.restore(resume.results, up_to=done)
        recorder.meta.setdefault("resumed", []).append(
            {"from-round": done, "at": dt.datetime.now().isoformat(timespec="seconds")}
        )
        recorder.flush()  # drop what the crashed run recorded after its checkpoint
    (output_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    log(
        INFO,
        "Experiment: %r on %s, %d clients, %d rounds",
        strategy,
        cfg.dataset.name,
        num_clients,
        num_rounds,
    )
    log(INFO, "Partition sizes: min %d, max %d", min(sizes), max(sizes))
    log(INFO, "Output folder: %s", output_dir)
    states = client_state_dir(cfg, run_config)
    if every:
        log(
            INFO,
            "Checkpoint every %d round(s): %s; client state: %s",
            every,
            output_dir / CHECKPOINT_FILE,
            states or "in memory only",
        )
        if mirrors_client_state(cfg) and states is None:
            log(
                WARNING,
                "%s's clients keep their state in memory only (no output-dir in the "
                "run config, so they cannot know this run's folder): this run "
                "cannot be resumed after a crash; give output-dir to make it so",
                type(strategy).__name__,
            )
        for reason in resume_blockers(cfg, strategy):
            log(WARNING, "This run cannot be resumed after a crash: %s", reason)
    initial = resume.arrays if resume is not None else ArrayRecord(model.state_dict())
    rejoin = getattr(strategy, "rejoin", None)  # one P-FedAvg server of many
    if rejoin is not None and done < num_rounds:
        initial, caught_up = rejoin(initial, done)
        if caught_up > done:  # its neighbours went on without it
            recorder.meta.setdefault("rejoined", []).append(
                {"from-round": done, "to-round": caught_up}
            )
            done = caught_up
    tracker = open_tracker(
        cfg, output_dir=output_dir, overrides=overrides_from_run_config(run_config)
    )
    round_end = RoundEnd(
        recorder=recorder,
        central=make_evaluate_fn(cfg, recorder, num_rounds, strategy)
        if cfg.evaluate.central
        else None,
        strategy=strategy,
        every=every,
        num_rounds=num_rounds,
        offset=done,
        document={
            "config": OmegaConf.to_container(cfg, resolve=True),
            "client-state": states,
        },
        tracker=tracker,
    )
    # The wrapper (central DP, secure aggregation) runs the rounds; the strategy
    # keeps its state.
    released = wrap_central_dp(cfg, strategy)
    if released is not strategy:
        recorder.meta["central-dp"] = type(released).__name__
        log(INFO, "Central DP: %r around %r", released, strategy)
    released = wrap_secure_aggregation(
        cfg, released, lambda: max(partition_sizes(cfg, int(cfg["num_partitions"])))
    )
    if isinstance(released, SecAggPlus):
        recorder.meta["secure-aggregation"] = repr(released)
    if resume is not None:  # last: building models above drew from torch's RNG
        restore_rng(resume.rng)
    failure: AggregationStalledError | None = None
    try:
        if done < num_rounds:
            with round_end.observing(released):
                result = released.start(
                    grid=grid,
                    initial_arrays=initial,
                    num_rounds=num_rounds - done,
                    # Seconds a round waits for replies (Flower's default: 3600).
                    timeout=float(cfg["round_timeout"]),
                    evaluate_fn=round_end,
                )
        else:
            log(INFO, "The run in %s had done all %d rounds", output_dir, num_rounds)
            result = Result(arrays=initial)
    except AggregationStalledError as err:  # recorded below, then raised again
        failure, result = err, err.result
    except EveryClientRetiredError as err:  # a budget spent is an end, not a crash
        log(WARNING, "%s", err)
        recorder.meta["stopped-early"] = {"round": err.stopped_at, "reason": str(err)}
        result = err.result
    except BaseException as err:  # a crash: say so in results.json, then raise
        recorder.meta["failure"] = f"{type(err).__name__}: {err}"
        close_tracker(tracker, recorder.as_dict(), [recorder.flush()], failed=True)
        raise
    if done:  # Flower numbers a resumed start's rounds from 1: use the run's
        for history in (
            result.train_metrics_clientapp,
            result.evaluate_metrics_clientapp,
            result.evaluate_metrics_serverapp,
        ):
            shifted = {rnd + done: value for rnd, value in history.items() if rnd}
            history.clear()
            history.update(shifted)
    if round_end.checkpoints:
        log(
            INFO,
            "%d checkpoint(s) written, %.3f s in all",
            round_end.checkpoints,
            round_end.checkpoint_seconds,
        )
    stopped = recorder.meta.get("stopped-early")
    ran = num_rounds if stopped is None else int(stopped["round"]) - 1
    idle = [
        rnd
        for rnd in range(1, ran + 1)
        if int(recorder.rounds.get(rnd, {}).get("train", {}).get("replies-valid", 0))
        == 0
    ]
    recorder.meta["rounds-without-valid-reply"] = idle
    recorder.meta["rejections"] = dict(getattr(strategy, "rejections", {}))
    if failure is None and ran and len(idle) == ran:
        failure = NoRoundAggregatedError(
            f"no round aggregated a single valid reply (reasons: "
            f"{dict(getattr(strategy, 'rejections', {}))})",
            result,
            ReplyTally(),
        )
    if failure is not None:
        # The ServerApp must fail (`flwr ls` then shows the run as failed), but
        # only after results.json and the plots say what happened.
        recorder.meta["failure"] = str(failure)
        files = [recorder.flush()]
        try:
            files += plot_run(recorder.as_dict(), output_dir)
        except Exception as err:  # the failure is the news, not the plot
            log(WARNING, "Plots of the failed run not written: %s", err)
        close_tracker(tracker, recorder.as_dict(), files, failed=True)
        raise type(failure)(
            f"{failure} Results so far: {output_dir / 'results.json'}",
            failure.result,
            failure.reasons,
        ) from failure
    if idle:
        log(WARNING, "Rounds without a valid reply (model kept): %s", idle)
    recorder.complete = True
    recorder.flush()
    ledger = getattr(strategy, "epsilon_totals", None)
    if ledger:  # every client's epsilon; round rows list them only up to 100
        write_json(
            output_dir / "privacy-ledger.json",
            {"epsilon-total": {str(k): ledger[k] for k in sorted(ledger)}},
        )
    results = recorder.as_dict()
    plots = plot_run(results, output_dir)
    summary = results["summary"]
    log(
        INFO,
        "Finished: final accuracy %s, best %s, rounds to %.2f: %s, %.1f s",
        summary["final-accuracy"],
        summary["best-accuracy"],
        float(cfg["target_accuracy"]),
        summary["rounds-to-target"],
        summary["wall-time-s"],
    )
    if "final-personal-accuracy-mean" in summary:
        log(
            INFO,
            "Personalised accuracy on clients' held-out splits: mean %.4f, worst "
            "%.4f (global model: mean %s, worst %s)",
            summary["final-personal-accuracy-mean"],
            summary["final-personal-accuracy-worst"],
            summary.get("final-global-accuracy-on-clients-mean"),
            summary.get("final-global-accuracy-on-clients-worst"),
        )
    if "final-epsilon-max" in summary:
        log(
            INFO,
            "Privacy spent per client: epsilon max %.4g, mean %.4g (delta %s)",
            summary["final-epsilon-max"],
            summary["final-epsilon-mean"],
            summary["delta"],
        )
    log(INFO, "Results: %s", output_dir / "results.json")
    log(INFO, "Plots: %s", ", ".join(str(p) for p in plots))
    files = [output_dir / name for name in ("results.json", "privacy-ledger.json")]
    close_tracker(
        tracker, results, [*files, *plots, output_dir / CHECKPOINT_FILE], failed=False
    )
    log(INFO, "Output folder: %s", output_dir)
    return result, output_dir


@dataclasses.dataclass(frozen=True)
class ClientRecipe:
    """What every client of one run shares, built once per process.

    Flower builds a client for every message; at thousands of nodes with a few
    sampled a round, composing the config, instantiating the model and client
    through Hydra and hashing the data's cache keys cost more than one local
    step (``benchmarks/scale.py``). A client built from the recipe is the same
    as one built from scratch: its model is a copy of the template, and every
    fit and evaluate loads the server's arrays into it first.
    """

    cfg: DictConfig
    model: torch.nn.Module
    factory: Callable[..., Any]
    train: ArrayDataset
    parts: tuple[np.ndarray, ...]
    mean_size: float
    state_dir: str | None


@functools.lru_cache(maxsize=8)
def _client_recipe(
    run_config: tuple[tuple[str, Any], ...],
    allowed: tuple[str, ...],  # part of the key: the allow-list may change
) -> ClientRecipe:
    settings = dict(run_config)
    cfg = config_from_run_config(settings)
    num_partitions = int(cfg.get("num_partitions", cfg["num_clients"]))
    parts = partition_indices(cfg, num_partitions)
    sizes = [len(p) for p in parts]
    return ClientRecipe(
        cfg=cfg,
        model=build_model(cfg),
        factory=client_factory(cfg),
        train=load_data(cfg).train,
        parts=parts,
        mean_size=sum(sizes) / len(sizes),
        # Stateful clients mirror their state into the run's output folder, so
        # a resumed run (a new Flower run: empty context.state) gets it back.
        state_dir=client_state_dir(cfg, settings),
    )


def make_client(context: Context) -> Any:
    """Build this node's client from the composed config and its partition."""
    recipe = _client_recipe(
        tuple(sorted(context.run_config.items())), allowed_targets()
    )
    cfg = recipe.cfg
    try:
        partition_id = int(context.node_config["partition-id"])
        num_partitions = int(context.node_config["num-partitions"])
    except KeyError as err:
        raise ProtocolError(
            f"node_config lacks {err}; start SuperNodes with --node-config "
            '"partition-id=<i> num-partitions=<n>"'
        ) from err
    expected = len(recipe.parts)
    if num_partitions != expected:
        raise ProtocolError(
            f"this node says num-partitions={num_partitions}, the configuration says "
            f"num_partitions={expected} (num_clients={cfg['num_clients']}): every "
            "node must split the data the same way"
        )
    data = partition_of(recipe.train, recipe.parts, partition_id)
    held_out = None
    fraction = float(cfg.evaluate.get("local_test_fraction", 0.0))
    if fraction > 0:
        data, held_out = split_held_out(
            data, fraction, seed=int(cfg.seed) + partition_id
        )
    # The client seeds torch per (seed, server-round) at each fit, which fixes
    # this loader's shuffling too: reproducible, and a new order every round.
    seed = int(cfg.seed) * 10_007 + partition_id
    batch_size = int(cfg.train["batch_size"])
    return recipe.factory(
        model=copy.deepcopy(recipe.model),
        train_loader=to_loader(data, batch_size=batch_size, shuffle=True),
        test_loader=None
        if held_out is None
        else to_loader(held_out, batch_size=batch_size, shuffle=False),
        relative_size=len(data) / recipe.mean_size,
        seed=seed,
        state_dir=recipe.state_dir,
    )

"""Build an experiment from its composed configuration: strategy, model, data, record.

The second step of an experiment (:mod:`.server`): every ``_target_`` is
instantiated through :func:`.config.instantiate` (the allow-list), the run's
folder is chosen or resumed (:mod:`.checkpoint`), its record opened
(:class:`.results.RunRecorder`, the tracker of :mod:`.track`), and the strategy
wrapped for central DP or secure aggregation. The clients' side builds from the
same functions, once per process (:class:`ClientRecipe`).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import functools
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from logging import INFO
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Array, ArrayRecord, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from ..algorithms import registered_algorithms
from ..core.privacy.central import central_dp
from ..core.privacy.distributed import DistributedDP
from ..core.privacy.secagg import SecAggPlus
from ..core.server.strategy import ValidatedFedAvg
from ..core.transport.grid import FIRST_WAIT, PromptGrid
from ..tracking import Tracker
from .checkpoint import (  # noqa: F401
    OUTPUT_ROOT_ENV,
    Resume,
    checkpointing,
    client_state_dir,
    client_state_on_disk,
    output_dir_for,
)
from .config import (
    ALLOWED_TARGETS_ENV,
    allowed_targets,
    check_targets,
    config_from_run_config,
    instantiate,
    overrides_from_run_config,
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
from .results import PARTITION_SIZES_FILE, RunRecorder, sizes_entry  # noqa: F401
from .track import open_tracker

if TYPE_CHECKING:  # the clients' side and central evaluation import it when used
    import torch

# Keys only Hydra's own machinery or the sweep use; stripped before building.
_UNUSED = "_unused_"

CentralEvaluation = Callable[[int, ArrayRecord], MetricRecord]


# ------------------------------------------------------------ the configuration's parts
def _kwargs(node: DictConfig) -> dict[str, Any]:
    container = OmegaConf.to_container(node, resolve=True)
    assert isinstance(container, dict)
    data: dict[str, Any] = {str(k): v for k, v in container.items()}
    for key in data.pop(_UNUSED, []) or []:
        data.pop(key, None)
    return data


def build_strategy(cfg: DictConfig, **runtime: Any) -> Any:
    """Instantiate ``cfg.strategy`` (keys listed in ``_unused_`` are dropped).

    With ``deploy`` set (``deploy=peers``), the algorithm's deployed form
    instead: one of P-FedAvg's servers, :class:`..PFedAvgServer`, built from
    the same keys plus ``deploy``'s.
    """
    node = _kwargs(cfg.strategy)
    deploy = cfg.get("deploy")
    if deploy is None:
        return instantiate(node, **runtime)
    target = get_class(str(node["_target_"]))
    deployed = [
        a.deployed for a in registered_algorithms().values() if a.strategy is target
    ]
    if not deployed or deployed[0] is None:
        raise ValueError(
            f"deploy=peers runs one parameter server of P-FedAvg; strategy "
            f"{target.__name__} has no deployed form (use strategy=pfedavg)"
        )
    settings = dict(node)
    settings.pop("assignment", None)  # a server's clients are its own SuperNodes
    settings["_target_"] = f"{deployed[0].__module__}.{deployed[0].__name__}"
    settings.update(OmegaConf.to_container(deploy, resolve=True))  # type: ignore[arg-type]
    if isinstance(settings.get("addresses"), list):
        settings["addresses"] = [str(a) for a in settings["addresses"]]
    return instantiate(settings, **runtime)


def build_model(cfg: DictConfig) -> Any:
    """Instantiate ``cfg.model`` (made DP-SGD ready when ``privacy.dp`` is set).

    Server and clients both build their model here, so opacus' fix (when
    ``privacy.dp.fix_model``) gives both the same ``state_dict``.
    """
    from ..core.client.dp import make_private_model  # torch, for those who build

    return make_private_model(instantiate(cfg.model), build_dp(cfg))


def build_dp(cfg: DictConfig) -> Any:
    """Instantiate ``cfg.privacy.dp`` (None without sample-level privacy)."""
    node = cfg.get("privacy", {}).get("dp")
    return None if node is None else instantiate(node)


def wrap_central_dp(cfg: DictConfig, strategy: Any) -> Any:
    """Return ``strategy`` in a central-DP wrapper when ``privacy.central`` is set."""
    node = cfg.get("privacy", {}).get("central")
    if node is None:
        return strategy
    # (central_dp refuses a strategy without one global model, P-FedAvg, clearly.)
    sampled = sampled_per_round(cfg, strategy)
    return central_dp(
        strategy,
        clipping=str(node.clipping),
        noise_multiplier=float(node.noise_multiplier),
        clipping_norm=float(node.clipping_norm),
        num_sampled_clients=sampled,
    )


def sampled_per_round(cfg: DictConfig, strategy: Any) -> int:
    """Return the nodes a round of ``strategy`` samples from ``num_clients``."""
    return max(
        int(int(cfg["num_clients"]) * float(getattr(strategy, "fraction_train", 1))),
        int(getattr(strategy, "min_train_nodes", 1)),
    )


#: ``secure_aggregation`` keys whose null means SecAggPlus's default.
_SECAGG_DEFAULTED = (
    "security_bits",
    "correctness_bits",
    "corrupt_fraction",
    "dropout_fraction",
)


def wrap_secure_aggregation(
    cfg: DictConfig, strategy: Any, largest_partition: Callable[[], int]
) -> Any:
    """Return ``strategy`` in :class:`~..SecAggPlus` when ``secure_aggregation`` is set.

    ``max_weight: null`` becomes ``largest_partition()`` (no client's
    ``num-examples`` exceeds it, and no larger bound costs precision).
    """
    node = cfg.get("secure_aggregation")
    distributed = cfg.get("privacy", {}).get("distributed")
    if node is None:
        if distributed is not None:
            raise ValueError(
                "privacy=distributed needs secure_aggregation=secaggplus: the "
                "clients' noise protects only a sum the server cannot unpick"
            )
        return strategy
    if cfg.get("privacy", {}).get("central") is not None:
        raise ValueError(
            "secure_aggregation=secaggplus with privacy=central is not supported: "
            "Flower's central-DP wrappers clip each reply on the server, which "
            "secure aggregation hides; use privacy=distributed (the clients add "
            "the noise, the server sees only noisy sums)"
        )
    options = {
        str(k): v
        for k, v in OmegaConf.to_container(node, resolve=True).items()  # type: ignore[union-attr]
    }
    if options.get("max_weight") is None:
        options["max_weight"] = float(largest_partition())
    for key in _SECAGG_DEFAULTED:
        if options.get(key) is None:  # null: SecAggPlus's own default, kept there
            options.pop(key, None)
    if distributed is not None:
        settings = {
            str(k): v
            for k, v in OmegaConf.to_container(distributed, resolve=True).items()  # type: ignore[union-attr]
        }
        if settings.get("expected_clients") is None:
            settings["expected_clients"] = sampled_per_round(cfg, strategy)
        options["distributed_dp"] = DistributedDP(**settings)
    return SecAggPlus(strategy, **options)


def client_factory(cfg: DictConfig) -> Callable[..., Any]:
    """Return ``cfg.client``'s class with its options and the ``train`` settings.

    Call it with the runtime objects (model, loaders, seed, ...) to build a
    client; :func:`build_client` does both at once.
    """
    train = cfg.train
    # Runtime objects go in after Hydra: it would turn a dataclass (DPSGD)
    # into a DictConfig.
    factory = instantiate(_kwargs(cfg.client), _partial_=True)
    # Hydra's partial authorises its target again at every call (3 ms, more
    # than a client's round at thousands of nodes); the target was checked
    # against the allow-list above, so bind what Hydra resolved directly.
    return functools.partial(
        factory.func,
        *factory.args,
        **factory.keywords,
        local_epochs=int(train["local_epochs"]),
        learning_rate=float(train["learning_rate"]),
        momentum=float(train["momentum"]),
        weight_decay=float(train["weight_decay"]),
        optimizer=str(train.get("optimizer", "sgd")),
        max_grad_norm=train.get("max_grad_norm"),
        finetune_steps=int(train.get("finetune_steps", 0) or 0),
        dp=build_dp(cfg),
    )


def build_client(cfg: DictConfig, **runtime: Any) -> Any:
    """Instantiate ``cfg.client`` with the ``train`` settings and runtime objects."""
    return client_factory(cfg)(**runtime)


# ------------------------------------------------------------- the initial model
# A ServerApp needs the initial model's arrays, not torch: torch takes about
# 180 MB of a process, which at thousands of SuperNodes is a fifth of the
# simulation's. When its process has not loaded torch, the model is built in a
# child process, which sends the arrays back; a process that has torch already
# (the in-process engine, a test, a ServerApp with central evaluation) builds it
# itself. Both build it the same way, so the arrays are the same bits.
def initial_arrays(cfg: DictConfig) -> ArrayRecord:
    """Return the arrays of ``cfg.model`` as a new run starts it.

    In this process when it has loaded torch, else in a child process.

    Raises
    ------
    RuntimeError
        When the child process fails; its error is in the message.
    """
    if "torch" in sys.modules:
        return built_here(cfg)
    return built_in_child(cfg)


def built_here(cfg: DictConfig) -> ArrayRecord:
    """Seed torch's generator with ``cfg.seed``, build the model, return its arrays."""
    import torch

    torch.manual_seed(int(cfg.seed))
    return ArrayRecord(build_model(cfg).state_dict())


def built_in_child(cfg: DictConfig) -> ArrayRecord:
    """Return :func:`built_here`'s arrays, built by a child process."""
    env = dict(os.environ)
    # The child imports what this process imports: the app's folder (a flwr
    # run's FAB) and a plugin's package may be on sys.path only.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env[ALLOWED_TARGETS_ENV] = ",".join(allowed_targets())
    done = subprocess.run(
        [sys.executable, "-c", f"from {__name__} import _child; _child()"],
        input=OmegaConf.to_yaml(cfg, resolve=True).encode(),
        capture_output=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            "building the initial model in a child process failed "
            f"(exit {done.returncode}):\n{done.stderr.decode(errors='replace')[-3000:]}"
        )
    pieces: list[tuple[str, Array]] = pickle.loads(done.stdout)
    return ArrayRecord(array_dict=dict(pieces))


def _child() -> None:
    """Build the initial model of the configuration on stdin; pickle its arrays out."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever else writes to stdout (a library's print) goes to stderr
    cfg = OmegaConf.create(sys.stdin.buffer.read().decode())
    assert isinstance(cfg, DictConfig)
    # The server checked the targets' names only; every one is located here,
    # so a wrong client or model fails the run's start, not its first round.
    check_targets(cfg)
    with out:
        out.write(pickle.dumps(list(built_here(cfg).items())))


# ------------------------------------------------------------------ the server's run
@dataclasses.dataclass
class Experiment:
    """A run, built: what its rounds (:mod:`.run`) and record (:mod:`.record`) use.

    Attributes
    ----------
    grid : Grid
        The grid the rounds use (:func:`rounds_grid`).
    cfg : DictConfig
        The composed configuration.
    output_dir : Path
        The run's folder (a resumed run's own).
    strategy : Any
        The algorithm's strategy: it keeps the state a checkpoint saves.
    released : Any
        What runs the rounds: ``strategy``, or a central-DP or secure-aggregation
        wrapper around it.
    initial : ArrayRecord
        The model the rounds start from (a checkpoint's, when resumed).
    done : int
        Rounds already run: the checkpoint's round, or a P-FedAvg server's
        neighbours' when it rejoins.
    every : int
        ``checkpoint_every`` (0: no checkpoints).
    client_states : str | None
        Where the clients mirror their state, or None (in memory only).
    recorder : RunRecorder
        ``results.json`` as the run writes it.
    tracker : Tracker | None
        The experiment tracker (``logger=...``), or None.
    central : CentralEvaluation | None
        The central evaluation run at each round's end, or None.
    rng : dict[str, Any] | None
        A resumed run's RNG states, restored right before its rounds start.
    """

    grid: Grid
    cfg: DictConfig
    output_dir: Path
    strategy: Any
    released: Any
    initial: ArrayRecord
    done: int
    every: int
    client_states: str | None
    recorder: RunRecorder
    tracker: Tracker | None
    central: CentralEvaluation | None
    rng: dict[str, Any] | None

    @property
    def num_rounds(self) -> int:
        """The rounds the whole run has (``num_rounds``; ``done`` of them already)."""
        return int(self.cfg["num_rounds"])


def build_experiment(
    grid: Grid, cfg: DictConfig, run_config: Mapping[str, Any]
) -> Experiment:
    """Build the run that ``cfg`` describes, on ``grid``'s federation.

    In this order (the initial model depends on ``seed`` only, and is built in a
    child process when this one has not loaded torch: :mod:`.initial`): the
    federation is checked against ``num_clients``; the strategy is built; the run's
    folder is chosen, its checkpoint policy checked and a resumed run's state loaded
    (:func:`.checkpoint.checkpointing`); the model, the record (``results.json``,
    ``config.yaml``), the tracker and the central evaluation are built; the strategy
    is wrapped.

    Raises
    ------
    RuntimeError
        When the federation does not match ``num_clients``.
    CheckpointError
        When a resume cannot continue the run, or a new run's folder holds
        another run's checkpoint.
    """
    num_clients = int(cfg["num_clients"])
    num_rounds = int(cfg["num_rounds"])
    grid = rounds_grid(grid, cfg)
    wait_for_clients(grid, num_clients, float(cfg["node_wait_timeout"]))
    strategy = build_run_strategy(cfg)
    kept = checkpointing(
        cfg, strategy, run_config, new_folder=lambda: output_dir_for(cfg, run_config)
    )
    output_dir = kept.folder
    sizes = partition_sizes(cfg, num_clients)
    recorder = open_record(cfg, strategy, output_dir, sizes, kept.every, kept.resume)
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
    if kept.resume is not None:
        initial, done = kept.resume.arrays, kept.resume.round
    else:
        initial, done = initial_arrays(cfg), 0
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
    central = (
        central_evaluation(cfg, recorder, num_rounds, strategy)
        if cfg.evaluate.central
        else None
    )
    return Experiment(
        grid=grid,
        cfg=cfg,
        output_dir=output_dir,
        strategy=strategy,
        released=wrapped(cfg, strategy, recorder),
        initial=initial,
        done=done,
        every=kept.every,
        client_states=kept.client_states,
        recorder=recorder,
        tracker=tracker,
        central=central,
        rng=kept.resume.rng if kept.resume is not None else None,
    )


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


def build_run_strategy(cfg: DictConfig) -> Any:
    """Build the strategy, each of its servers held to the run's ``quorum``.

    A round then waits (``node_wait_timeout``) for ``quorum`` connected nodes.
    """
    strategy = build_strategy(cfg)
    for inner in getattr(strategy, "inner", [strategy]):  # P-FedAvg's servers too
        if isinstance(inner, ValidatedFedAvg):
            inner.min_round_nodes = int(cfg["quorum"])
            inner.node_wait_timeout = float(cfg["node_wait_timeout"])
    return strategy


def open_record(
    cfg: DictConfig,
    strategy: Any,
    output_dir: Path,
    sizes: list[int],
    every: int,
    resume: Resume | None,
) -> RunRecorder:
    """Open the run's ``results.json`` (a resumed run's, up to its checkpoint).

    Also writes the resolved configuration to ``config.yaml``.
    """
    recorder = RunRecorder(
        output_dir,
        meta={
            "strategy": type(strategy).__name__,
            "dataset": cfg.dataset.name,
            "num-clients": int(cfg["num_clients"]),
            "num-rounds": int(cfg["num_rounds"]),
            **sizes_entry(sizes, output_dir),
            "config": OmegaConf.to_container(cfg, resolve=True),
        },
        target=float(cfg["target_accuracy"]),
    )
    recorder.meta["checkpoint-every"] = every
    if resume is not None:
        recorder.restore(resume.results, up_to=resume.round)
        recorder.meta.setdefault("resumed", []).append(
            {
                "from-round": resume.round,
                "at": dt.datetime.now().isoformat(timespec="seconds"),
            }
        )
        recorder.flush()  # drop what the crashed run recorded after its checkpoint
    (output_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return recorder


def central_evaluation(
    cfg: DictConfig, recorder: RunRecorder, num_rounds: int, strategy: Any = None
) -> CentralEvaluation:
    """Central evaluation of the global model on the test set, with progress logs.

    The strategy's :meth:`~..core.server.hooks.AlgorithmHooks.central_models` (FedDyn's
    mean of all clients' models, APFL's weighted average) are evaluated too, each
    under its own section of ``results.json``. With ``evaluate.central_train``
    the global model's loss and accuracy on the whole training set (the FedProx
    paper's training loss) go under ``central-train``. It loads torch into the
    ServerApp's process.
    """
    import torch

    from ..core.client.training import evaluate_model

    data = load_data(cfg)
    loader = to_loader(data.test, batch_size=1024, shuffle=False)
    train_loader = (
        to_loader(data.train, batch_size=1024, shuffle=False)
        if cfg.evaluate.get("central_train", False)
        else None
    )
    model = build_model(cfg)
    start = time.monotonic()

    def record(server_round: int, section: str, data: Any) -> None:
        loss, accuracy, _ = evaluate_model(
            model, data, torch.nn.functional.cross_entropy
        )
        recorder.record(server_round, section, {"loss": loss, "accuracy": accuracy})

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
            record(server_round, "central-train", train_loader)
        extra_models: dict[str, ArrayRecord] = getattr(
            strategy, "central_models", dict
        )()
        for section, extra in extra_models.items():
            model.load_state_dict(extra.to_torch_state_dict())
            record(server_round, section, loader)
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


def wrapped(cfg: DictConfig, strategy: Any, recorder: RunRecorder) -> Any:
    """Return what runs the rounds: ``strategy`` in its central-DP and secure wrappers.

    The wrapper runs the rounds; the strategy inside keeps its state.
    """
    released = wrap_central_dp(cfg, strategy)
    if released is not strategy:
        recorder.meta["central-dp"] = type(released).__name__
        log(INFO, "Central DP: %r around %r", released, strategy)
    released = wrap_secure_aggregation(
        cfg, released, lambda: max(partition_sizes(cfg, int(cfg["num_partitions"])))
    )
    if isinstance(released, SecAggPlus):
        recorder.meta["secure-aggregation"] = repr(released)
    return released


def rounds_grid(grid: Grid, cfg: DictConfig) -> Grid:
    """Return the grid the rounds use: ``grid``, its replies pulled as they arrive.

    Flower's simulation grid pulls replies every ``pull_interval`` (0.1 s), so
    a round lasts a whole number of pulls. ``prompt_replies``:

    * ``auto`` (default): a grid with such a cadence is wrapped in a
      :class:`~flwr_prox_strategies.core.transport.grid.PromptGrid` that
      pulls at most that far apart. Other grids are used as they are: the
      in-process engine's hands replies over at once, and in a deployment the
      SuperNodes' own 3 s polling sets the pace (pulling promptly there
      gained nothing: ``benchmarks/prompt_replies.py``);
    * ``true``: any grid is wrapped (waits up to its cadence, else 3 s);
    * ``false``: none is.

    Raises
    ------
    ValueError
        If ``prompt_replies`` is none of ``auto``, true, false.
    """
    prompt = cfg.get("prompt_replies", "auto")
    if not (prompt == "auto" or isinstance(prompt, bool)):
        raise ValueError(f"prompt_replies must be auto, true or false, got {prompt!r}")
    cadence: Any = getattr(grid, "pull_interval", None)
    fixed = isinstance(cadence, int | float) and cadence > FIRST_WAIT
    if prompt is False or (prompt == "auto" and not fixed):
        return grid
    view = PromptGrid(grid, max_wait=float(cadence)) if fixed else PromptGrid(grid)
    log(
        INFO,
        "Replies are pulled as they arrive: each wait %g of the time waited, "
        "%g to %g s (prompt_replies=false: the grid's own cadence)",
        view.share,
        view.first_wait,
        view.max_wait,
    )
    return view


# ----------------------------------------------------------------- the clients' side
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
    state_on_disk: bool

    def client(self, node_config: Mapping[str, Any]) -> Any:
        """Build the client of the node whose ``node_config`` names its partition.

        Raises
        ------
        ProtocolError
            When ``node_config`` lacks ``partition-id`` or ``num-partitions``,
            or splits the data another way than the configuration.
        """
        from ..core.client.message import ProtocolError  # the clients' side: torch

        cfg = self.cfg
        try:
            partition_id = int(node_config["partition-id"])
            num_partitions = int(node_config["num-partitions"])
        except KeyError as err:
            raise ProtocolError(
                f"node_config lacks {err}; start SuperNodes with --node-config "
                '"partition-id=<i> num-partitions=<n>"'
            ) from err
        expected = len(self.parts)
        if num_partitions != expected:
            raise ProtocolError(
                f"this node says num-partitions={num_partitions}, the configuration "
                f"says num_partitions={expected} (num_clients={cfg['num_clients']}): "
                "every node must split the data the same way"
            )
        data = partition_of(self.train, self.parts, partition_id)
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
        return self.factory(
            model=copy.deepcopy(self.model),
            train_loader=to_loader(data, batch_size=batch_size, shuffle=True),
            test_loader=None
            if held_out is None
            else to_loader(held_out, batch_size=batch_size, shuffle=False),
            relative_size=len(data) / self.mean_size,
            seed=seed,
            state_dir=self.state_dir,
            # Only when asked: a client class of the user's may not know it.
            **({"state_in_memory": False} if self.state_on_disk else {}),
        )


def client_recipe(run_config: Mapping[str, Any]) -> ClientRecipe:
    """Return this process's :class:`ClientRecipe` for ``run_config`` (cached)."""
    return _client_recipe(tuple(sorted(run_config.items())), allowed_targets())


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
        state_on_disk=client_state_on_disk(cfg),
    )

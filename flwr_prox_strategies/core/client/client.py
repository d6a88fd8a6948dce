"""The base ``NumPyClient`` of the pack: a torch model, its data, local SGD.

An algorithm's client subclasses :class:`TorchClient` and overrides
:meth:`TorchClient.gradient_term` (the extra gradient its local objective adds)
and, if it keeps state across rounds, :meth:`TorchClient.after_training`. The
training loop itself lives once, in :mod:`.training`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from typing import Any, ClassVar

import torch
from flwr.app import Context
from flwr.client import NumPyClient
from numpy.typing import NDArray
from torch import nn

from ...ops.checks import check_choice, check_int, check_non_negative, check_positive
from ..transport.keys import (
    CLIENT_KEY_METRIC,
    GRADIENT_RECORD,
    LOCAL_EPOCHS_KEY,
    LOCAL_STEPS_KEY,
    LR_SCALE_KEY,
    REPORT_GRADIENT_KEY,
    SERVER_ROUND_KEY,
)
from .dp import (
    DPSGD,
    PrivacyLedger,
    TrainingRun,
    dp_sgd,
    make_private_model,
    sample_rate_of,
)
from .rule import (
    ClientRule,
    ProtocolError,
    arrays_from_params,
    client_key_of,
    load_arrays,
    params_from_arrays,
    require,
)
from .state import ClientState
from .training import (
    BatchFn,
    GradientTerm,
    LossFn,
    PairLoader,
    TrainReport,
    batch_unpacker,
    check_batches,
    evaluate_model,
    full_gradient,
    resolve_device,
    seed_torch,
    train_local,
    trainable,
)
from .wiring import RuleTerm

Batch = tuple[torch.Tensor, torch.Tensor]

#: The optimisers the pack's clients build (``optimizer=``).
OPTIMIZERS = ("sgd", "adam")

# The train-config key Flower's examples send the learning rate under.
SERVER_LR_KEY = "lr"


class TorchClient(NumPyClient):
    """Local SGD on a user's torch model and data: the FedAvg client.

    The base ``NumPyClient`` of the pack's clients. The algorithm's client
    side is its :class:`~flwr_prox_strategies.extend.ClientRule`
    (:attr:`rule_class`), the same object a user's own Message-API client
    uses; this class runs it inside the pack's training loop. Mount it on a
    ``ClientApp`` with :func:`~flwr_prox_strategies.to_client_app`.

    Parameters
    ----------
    model : torch.nn.Module
        The model; its ``state_dict`` order is the wire order of the arrays.
    train_loader : Iterable
        Local training data (e.g. a ``torch.utils.data.DataLoader``) yielding
        ``(inputs, targets)`` pairs or mappings (see ``input_key``).
    test_loader : Iterable | None (default: None)
        Local held-out data for ``evaluate``; the training data when None.
    local_epochs : int (default: 1)
        Epochs per round unless the server sends ``local-epochs``.
    learning_rate : float (default: 0.01)
        SGD step size. A server that sends ``lr`` in the train config (as
        Flower's examples do) overrides it unless ``use_server_lr=False``; the
        server's ``lr-scale`` (decay) multiplies either.
    momentum : float (default: 0.0)
        SGD momentum (reset each round: the optimiser is rebuilt per fit).
    weight_decay : float (default: 0.0)
        L2 penalty coefficient added by the optimiser.
    optimizer : str (default: "sgd")
        ``"sgd"`` (``torch.optim.SGD`` with ``momentum``) or ``"adam"``
        (``torch.optim.Adam``, its state reset each round). SCAFFOLD and FedDC
        need ``"sgd"``; under Adam, FedProx's ``mu`` and FedDyn's ``alpha``
        act differently (the algorithm pages measure it).
    loss_fn : callable | None (default: None)
        ``loss_fn(outputs, targets)`` returning the mean loss of a batch;
        cross-entropy when None.
    max_grad_norm : float | None (default: None)
        Clip the total gradient (data term plus the algorithm's term) to this
        Euclidean norm before each step (the FedDyn/FedDC official codes use 10).
    state_dir : str | None (default: None)
        Mirror this client's cross-round state to ``<state_dir>/<partition>.npz``
        so a later run can resume it (see
        :class:`~flwr_prox_strategies.extend.ClientState`).
    state_in_memory : bool (default: True)
        False keeps that state in ``state_dir`` only, not in
        ``context.state``: a simulation of thousands of stateful nodes then
        holds one client's state at a time (needs ``state_dir``).
    relative_size : float (default: 1.0)
        This client's data size over the mean client's, ``n_k / mean_j n_j``.
        The FedDyn and FedDC official codes divide their penalty by it; 1.0
        gives the papers' uniform form.
    seed : int | None (default: None)
        When set, torch's generator is seeded with ``(seed, server-round)`` at
        the start of each fit, so shuffling and dropout are reproducible and a
        resumed run repeats an uninterrupted one.
    finetune_steps : int (default: 0)
        Personalised evaluation by local fine-tuning: when > 0, ``evaluate``
        also trains a copy of the received model for this many SGD steps on
        the local training data and reports it as ``personal-*`` metrics (the
        "FedAvg + fine-tuning" baseline of personalised FL). The copy is thrown
        away; the client's state is untouched.
    dp : ~flwr_prox_strategies.DPSGD | None (default: None)
        Sample-level differential privacy: train by DP-SGD through opacus
        (per-sample clipping, Gaussian noise, Poisson sampling) and report
        epsilon every round. The algorithm's extra gradient
        term is added after privatisation, neither clipped nor noised;
        ``max_grad_norm`` then clips the total (private) gradient. Needs a
        ``DataLoader`` with a ``batch_size``.
    input_key : str | None (default: None)
        Where a mapping batch (flwr-datasets, Flower's examples) keeps the
        inputs; None takes ``"img"`` or ``"image"``.
    label_key : str (default: "label")
        Where a mapping batch keeps the targets.
    batch_fn : callable | None (default: None)
        ``batch_fn(batch) -> (inputs, targets)`` for any other batch format
        (replaces ``input_key`` / ``label_key``). The first batch of each
        loader is unpacked at construction, so a format the client cannot
        read fails here, naming what it got.
    use_server_lr : bool (default: True)
        Take the step size from a server-sent ``lr`` when there is one.
    device : str (default: "auto")
        Torch device; ``"auto"`` is CUDA when available, else the CPU.

    Raises
    ------
    ValueError
        If a hyper-parameter is out of range, naming it: ``local_epochs`` or
        ``finetune_steps`` negative, ``learning_rate`` not > 0, ``momentum``
        or ``weight_decay`` negative, ``max_grad_norm`` or ``relative_size``
        not > 0; with ``dp``, if the model has a layer DP-SGD cannot train
        (BatchNorm, without ``fix_model``) or the training loader is not a
        ``torch.utils.data.DataLoader`` with a ``batch_size``.
    TypeError
        If ``dp`` is not a :class:`~flwr_prox_strategies.DPSGD` or None, or a
        loader's first batch cannot be read as ``(inputs, targets)`` (naming
        what it got).
    ImportError
        With ``dp``, if opacus is not installed (the ``[dp]`` extra).

    Notes
    -----
    Personalised evaluation. ``evaluate`` reports the received (global) model
    as ``loss``/``accuracy`` and every model of :meth:`personal_models` as
    ``<name>-loss``/``<name>-accuracy`` on the same local held-out data, plus
    ``client-key``, so the strategy can tabulate clients and their worst one.
    A personalised algorithm (APFL here; Ditto- or pFedMe-style later)
    overrides :meth:`personal_models` and nothing else.
    """

    def __init__(
        self,
        model: nn.Module,
        train_loader: Iterable[Batch],
        test_loader: Iterable[Batch] | None = None,
        *,
        local_epochs: int = 1,
        learning_rate: float = 0.01,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        optimizer: str = "sgd",
        loss_fn: LossFn | None = None,
        max_grad_norm: float | None = None,
        state_dir: str | None = None,
        state_in_memory: bool = True,
        relative_size: float = 1.0,
        seed: int | None = None,
        finetune_steps: int = 0,
        dp: DPSGD | None = None,
        input_key: str | None = None,
        label_key: str = "label",
        batch_fn: BatchFn | None = None,
        use_server_lr: bool = True,
        device: str = "auto",
    ) -> None:
        check_int("local_epochs", local_epochs, 0)
        check_positive("learning_rate", learning_rate)
        check_non_negative("momentum", momentum)
        check_non_negative("weight_decay", weight_decay)
        check_int("finetune_steps", finetune_steps, 0)
        check_choice("optimizer", optimizer, OPTIMIZERS)
        if optimizer != "sgd" and self.rule_class.plain_sgd:
            raise ValueError(
                f"optimizer must be 'sgd' for {type(self).__name__}: "
                f"{self.protocol}'s control-variate update assumes plain SGD "
                f"steps; got {optimizer!r}"
            )
        self.optimizer_name = optimizer
        if max_grad_norm is not None and not (
            math.isfinite(max_grad_norm) and max_grad_norm > 0
        ):
            raise ValueError(
                f"max_grad_norm must be None or > 0, got {max_grad_norm!r}"
            )
        if dp is not None and not isinstance(dp, DPSGD):
            raise TypeError(f"dp must be a DPSGD or None, got {type(dp).__name__}")
        self.dp = dp
        if dp is not None:
            sample_rate_of(train_loader, dp)  # fails now on a loader DP-SGD can't use
        self.device = resolve_device(device)
        self.model = make_private_model(model, dp).to(self.device)
        self.batch_fn = batch_fn or batch_unpacker(input_key, label_key)
        check_batches(train_loader, self.batch_fn, "train_loader")
        if test_loader is not None:
            check_batches(test_loader, self.batch_fn, "test_loader")
        # What the user gave (DP-SGD resamples it), and the same seen as pairs.
        self.train_data = train_loader
        self.train_loader = PairLoader(train_loader, self.batch_fn)
        self.test_loader = (
            None if test_loader is None else PairLoader(test_loader, self.batch_fn)
        )
        self.use_server_lr = bool(use_server_lr)
        self.local_epochs = local_epochs
        self.learning_rate = float(learning_rate)
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.loss_fn: LossFn = loss_fn or nn.functional.cross_entropy
        self.max_grad_norm = max_grad_norm
        if not (math.isfinite(relative_size) and relative_size > 0):
            raise ValueError(f"relative_size must be > 0, got {relative_size!r}")
        self.relative_size = float(relative_size)
        if not state_in_memory and not state_dir:
            raise ValueError(
                "state_in_memory=False keeps the client state in files only: it "
                "needs a state_dir"
            )
        self.state_dir = state_dir
        self.state_in_memory = bool(state_in_memory)
        self.seed = seed
        self.finetune_steps = finetune_steps
        self.context: Context | None = None
        self._state: ClientState | None = None
        # This round's step size (learning_rate times the server's lr-scale).
        self.round_lr = self.learning_rate
        # Extra ArrayRecords the server sent with the model (name -> arrays),
        # set by the adapter before fit.
        self.received_arrays: dict[str, list[NDArray]] = {}
        self.server_round = 0
        # Extra ArrayRecords for the reply (name -> arrays in model order),
        # filled by fit and read by the adapter.
        self.reply_arrays: dict[str, list[NDArray]] = {}
        # This round's rule (built by gradient_term from what the server sent).
        self.rule: ClientRule | None = None
        self._base_lr = self.learning_rate

    #: The algorithm's client rule: what this client adds to plain local SGD.
    rule_class: ClassVar[type[ClientRule]] = ClientRule
    #: The strategy whose config keys this client reads (named in protocol
    #: errors); the same as its rule's.
    protocol: ClassVar[str] = "FedAvg"

    @property
    def client_key(self) -> int:
        """Stable integer id of this client: its partition id, else its node id."""
        return client_key_of(self.context)

    @property
    def state(self) -> ClientState:
        """Return the cross-round state (``context.state``, see ``state_dir``)."""
        if self._state is None:
            self._state = ClientState(
                self.context,
                state_dir=self.state_dir,
                client_key=str(self.client_key),
                in_memory=self.state_in_memory,
            )
        return self._state

    def required(self, config: dict[str, Any], key: str) -> Any:
        """Return ``config[key]``, or fail naming :attr:`protocol`."""
        return require(config, key, type(self).__name__, self.protocol)

    # ------------------------------------------------------------ parameters
    def get_parameters(self, config: dict[str, Any]) -> list[NDArray]:
        """Return the model's state as numpy arrays, in ``state_dict`` order."""
        return [
            t.detach().cpu().numpy().copy() for t in self.model.state_dict().values()
        ]

    def set_parameters(self, parameters: Sequence[NDArray]) -> None:
        """Load numpy arrays (``state_dict`` order) into the model."""
        load_arrays(self.model, parameters)

    # ---------------------------------------------------------------- hooks
    def rule_options(self, config: dict[str, Any]) -> dict[str, Any]:
        """Return the rule's own options, from this round's train ``config``.

        Keyword arguments for :attr:`rule_class` beyond what every rule takes
        (FedDyn's ``decoupled``); the base passes none.
        """
        return {}

    def gradient_term(self, config: dict[str, Any]) -> GradientTerm | None:
        """Build this round's rule (:meth:`make_rule`); return its gradient term."""
        return self.make_rule(config).term

    def make_rule(self, config: dict[str, Any]) -> ClientRule:
        """Build this round's rule from what the server sent and the state.

        Parameters
        ----------
        config : dict[str, Any]
            This round's train config.

        Returns
        -------
        ClientRule
            An instance of :attr:`rule_class`, also kept as ``self.rule``.
        """
        self.rule = self.rule_class(
            self.model,
            config,
            received=self.received_arrays,
            state=self.state,
            client_key=self.client_key,
            relative_size=self.relative_size,
            base_lr=self._base_lr,
            **self.rule_options(config),
        )
        return self.rule

    def stop_rule(self, config: dict[str, Any], term: GradientTerm | None):
        """Return a ``stop_after_epoch(epoch) -> bool`` callable, or None.

        FedProx's client returns its gamma-inexactness test; the base, None
        (every epoch runs).
        """
        return None

    def after_training(
        self, config: dict[str, Any], report: TrainReport
    ) -> dict[str, Any]:
        """Finish the round's rule (state, extra records); return its metrics."""
        if self.rule is None:
            return {}
        extra, metrics = self.rule.reply_records(steps=report.steps, lr=self.round_lr)
        self.reply_arrays.update(extra)
        return metrics

    def local_solve(
        self, config: dict[str, Any], *, epochs: int, steps: int | None
    ) -> TrainReport:
        """Train ``self.model`` (loaded with the global model) for this round.

        The base runs the pack's training loop on the local objective that
        :meth:`gradient_term` defines; an algorithm that trains more than one
        model per step (APFL) overrides this instead.
        """
        term = self.gradient_term(config)
        with self.training_run(self.make_optimizer(), self.measured(term)) as run:
            return train_local(
                run.model,
                run.loader,
                epochs=epochs,
                optimizer=run.optimizer,
                loss_fn=self.loss_fn,
                term=run.term,
                stop_after_epoch=self.stop_rule(config, term),
                max_grad_norm=run.max_grad_norm,
                max_steps=steps,
                device=self.device,
            )

    def measured(self, term: GradientTerm | None) -> GradientTerm | None:
        """Return ``term`` added through this round's rule, which counts what it did.

        The pack's loop then reports, as a user's loop does, how many of its
        optimiser steps held the term (:attr:`ClientRule.counts
        <flwr_prox_strategies.extend.ClientRule.counts>`). A term that is not
        the rule's is returned as it is.
        """
        if self.rule is None or term is not self.rule.term:
            return term
        return RuleTerm(self.rule.wiring)

    def training_run(
        self, optimizer: torch.optim.Optimizer, term: GradientTerm | None
    ) -> AbstractContextManager[TrainingRun]:
        """Return what to train with: the model, or its DP-SGD wrapping (``dp``).

        Every local solve goes through this, so privacy never depends on the
        algorithm remembering it.
        """
        if self.dp is None:
            return nullcontext(
                TrainingRun(
                    self.model, self.train_loader, optimizer, term, self.max_grad_norm
                )
            )
        return self._private_run(optimizer, term)

    @contextmanager
    def _private_run(
        self, optimizer: torch.optim.Optimizer, term: GradientTerm | None
    ) -> Iterator[TrainingRun]:
        assert self.dp is not None
        with dp_sgd(
            self.model,
            self.train_data,
            optimizer,
            dp=self.dp,
            ledger=PrivacyLedger(self.dp, self.state),
            term=term,
            max_grad_norm=self.max_grad_norm,
            seed=self.noise_seed(),
        ) as run:
            yield replace(run, loader=PairLoader(run.loader, self.batch_fn))

    def noise_seed(self) -> int | None:
        """Seed of this round's DP noise and Poisson draws (None: unseeded)."""
        if self.seed is None:
            return None
        return (self.seed * 1_000_003 + self.server_round) * 31 + 17

    def make_optimizer(self) -> torch.optim.Optimizer:
        """Build this round's optimiser (``optimizer``: SGD, or Adam)."""
        if self.optimizer_name == "adam":
            return torch.optim.Adam(
                trainable(self.model),
                lr=self.round_lr,
                weight_decay=self.weight_decay,
            )
        return torch.optim.SGD(
            trainable(self.model),
            lr=self.round_lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
        )

    # ------------------------------------------------------------------ fit
    def fit(
        self, parameters: list[NDArray], config: dict[str, Any]
    ) -> tuple[list[NDArray], int, dict[str, Any]]:
        """Train from the global model; return the local model and metrics."""
        try:
            return self._fit(parameters, config)
        finally:
            self._close_state()

    def _close_state(self) -> None:
        # A state kept on disk only writes what a failed call did, as
        # context.state keeps it in memory.
        if self._state is not None:
            self._state.close()

    def _fit(
        self, parameters: list[NDArray], config: dict[str, Any]
    ) -> tuple[list[NDArray], int, dict[str, Any]]:
        self.reply_arrays = {}
        self.rule = None
        server_round = int(config.get(SERVER_ROUND_KEY, 0))
        self.server_round = server_round
        # (A stateful rule commits or drops last round's state when it is built:
        # the two-phase commit lives in ClientRule, once for every client.)
        if self.seed is not None:
            seed_torch(self.seed * 1_000_003 + server_round)
        self.set_parameters(parameters)
        epochs = int(config.get(LOCAL_EPOCHS_KEY, self.local_epochs))
        steps = config.get(LOCAL_STEPS_KEY)
        self._base_lr = (
            float(config[SERVER_LR_KEY])
            if self.use_server_lr and SERVER_LR_KEY in config
            else self.learning_rate
        )
        self.round_lr = self._base_lr * float(config.get(LR_SCALE_KEY, 1.0))
        metrics: dict[str, Any] = {}
        if self.dp is not None and config.get(REPORT_GRADIENT_KEY, False):
            raise ProtocolError(
                "the server asks for the exact local gradient (monitor_dissimilarity"
                "), which is not private; turn it off when clients use DP-SGD"
            )
        if config.get(REPORT_GRADIENT_KEY, False):
            grads = full_gradient(
                self.model, self.train_loader, self.loss_fn, device=self.device
            )
            self.reply_arrays[GRADIENT_RECORD] = self.to_state_order(grads)
            metrics["grad-sq-norm"] = float(
                sum(float((g.double() ** 2).sum()) for g in grads)
            )
        steps = None if steps is None else int(steps)
        ledger = None if self.dp is None else PrivacyLedger(self.dp, self.state)
        if ledger is not None:  # refuse a round that would exceed the budget
            planned = epochs * len(self.train_loader) if steps is None else steps  # type: ignore[arg-type]
            spent_before = ledger.check_round(self.train_data, planned)
        report = self.local_solve(config, epochs=epochs, steps=steps)
        if ledger is not None:
            who = f"{type(self).__name__} {self.client_key}"
            metrics.update(
                ledger.report_round(
                    who, self.server_round, self.train_data, spent_before, report.steps
                )
            )
        # (DP-SGD's Poisson sampling may draw only empty batches: noise steps.)
        if report.examples_seen == 0 and (epochs > 0 or steps) and self.dp is None:
            raise ValueError("the training loader yielded no examples")
        metrics.update(
            {
                "train-loss": report.mean_loss,
                "local-epochs-run": report.epochs,
                "local-steps": report.steps,
            }
        )
        metrics.update(self.after_training(config, report))
        metrics[CLIENT_KEY_METRIC] = self.client_key
        self.state.flush()
        return self.get_parameters({}), self.num_train_examples(), metrics

    def num_train_examples(self) -> int:
        """Return the number of local training examples (the weight)."""
        dataset = getattr(self.train_data, "dataset", None)
        if dataset is not None:
            return len(dataset)
        return sum(len(targets) for _, targets in self.train_loader)

    def from_state_order(self, arrays: Sequence[NDArray]) -> list[torch.Tensor]:
        """Return the trainable parameters' entries of ``state_dict``-ordered arrays."""
        return params_from_arrays(self.model, arrays)

    def to_state_order(self, grads: Sequence[torch.Tensor]) -> list[NDArray]:
        """Lay out per-parameter tensors like ``state_dict`` (zeros for buffers)."""
        return arrays_from_params(self.model, grads)

    # ------------------------------------------------------------- evaluate
    def personal_models(self, config: dict[str, Any]) -> dict[str, nn.Module]:
        """Return this client's personalised models (name -> module) to evaluate.

        Called by :meth:`evaluate` with the received global model loaded in
        ``self.model``. The base returns the fine-tuned copy when
        ``finetune_steps > 0`` (as ``"personal"``), else nothing.
        """
        if self.finetune_steps == 0:
            return {}
        tuned = copy.deepcopy(self.model)
        train_local(
            tuned,
            self.train_loader,
            epochs=0,
            optimizer=torch.optim.SGD(
                trainable(tuned),
                lr=self.learning_rate,
                momentum=self.momentum,
                weight_decay=self.weight_decay,
            ),
            loss_fn=self.loss_fn,
            max_grad_norm=self.max_grad_norm,
            max_steps=self.finetune_steps,
            device=self.device,
        )
        return {"personal": tuned}

    def evaluate(
        self, parameters: list[NDArray], config: dict[str, Any]
    ) -> tuple[float, int, dict[str, Any]]:
        """Evaluate the received model (and personal ones) on local held-out data."""
        try:
            return self._evaluate(parameters, config)
        finally:
            self._close_state()

    def _evaluate(
        self, parameters: list[NDArray], config: dict[str, Any]
    ) -> tuple[float, int, dict[str, Any]]:
        if self.seed is not None:  # fine-tuning shuffles: reproducible as fit is
            server_round = int(config.get(SERVER_ROUND_KEY, 0))
            seed_torch(self.seed * 1_000_003 + server_round + 500_009)
        self.set_parameters(parameters)
        loader = self.test_loader if self.test_loader is not None else self.train_loader
        loss, accuracy, count = evaluate_model(
            self.model, loader, self.loss_fn, device=self.device
        )
        metrics: dict[str, Any] = {"loss": loss, CLIENT_KEY_METRIC: self.client_key}
        if math.isfinite(accuracy):
            metrics["accuracy"] = accuracy
        metrics.update(self._evaluate_named(self.personal_models(config), loader))
        return loss, count, metrics

    def _evaluate_named(
        self, models: Mapping[str, nn.Module], loader: Iterable[Batch]
    ) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for name, model in models.items():
            loss, accuracy, _ = evaluate_model(
                model, loader, self.loss_fn, device=self.device
            )
            metrics[f"{name}-loss"] = loss
            if math.isfinite(accuracy):
                metrics[f"{name}-accuracy"] = accuracy
        return metrics

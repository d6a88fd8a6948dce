r"""Client rules: an algorithm's client side, as pieces for any training loop.

Every algorithm of the pack changes local training in the same three places:

1. **read** what its strategy sent (config values, extra ArrayRecords) and the
   client's own state from earlier rounds (``context.state``);
2. **add** its gradient term to the data gradient at every optimiser step
   (FedProx's :math:`\mu(w - w_t)`, FedDyn's regulariser, SCAFFOLD's and
   FedDC's corrections);
3. **reply** with the trained model, the extra records its strategy expects,
   and its state advanced (committed only once the server confirms the reply
   was aggregated: the two-phase commit of :mod:`.state`).

A :class:`ClientRule` holds one algorithm's version of the three, and nothing
else: the training loop, the optimiser, the loss, the batch format and the
device stay the user's. The pack's own ``XxxClient`` NumPyClients run the very
same rule inside :func:`.training.train_local`, so there is one implementation
of each client rule.

In a Message-API ``ClientApp`` (Flower's quickstart, for instance)::

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = Net()
        rule = FedProxRule.from_message(msg, context, model)  # loads the model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        rule.attach(optimizer)  # adds the term at every optimizer.step()
        ...  # your loop, your loss, your batches, your device
        return rule.reply(num_examples=len(trainloader.dataset),
                          metrics={"train_loss": loss})

``attach`` adds the term just before each update: in the optimiser's step
pre-hook, or, for a step called with a closure (Lightning, LBFGS), after the
closure's ``backward()``. It comes after anything the loop does between
``backward()`` and ``step()`` (gradient clipping, say). To have the term
clipped with the data gradient, as the pack's own loop does with
``max_grad_norm``, call :meth:`ClientRule.add_gradient` yourself before
clipping: the hook then adds nothing more.

What the reply says is measured, not assumed (:mod:`.steps`): every
``step()`` of a torch optimiser over the model is counted, and
``<algorithm>-applied`` is the number of them whose update held the term. A
training stack that wipes the term or steps another optimiser makes the reply
say so, and the server warns (or, with ``strict=True``, rejects).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from logging import ERROR, INFO, WARNING
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.common.logger import log
from numpy.typing import NDArray
from torch import nn

from ..docstrings import with_class_attributes
from ..transport.keys import (
    ACCEPTED_KEYS_KEY,
    ACCEPTED_ROUND_KEY,
    ACCEPTED_ROUNDS_KEY,
    CLIENT_KEY_METRIC,
    LR_SCALE_KEY,
    MISSING_MOD_HINT,
    NUM_EXAMPLES_KEY,
    RESET_KEYS_KEY,
    RESET_STATE_KEY,
    RUN_TAG_KEY,
    SECAGG_RECORD,
    SERVER_ROUND_KEY,
    STATE_OUTSIDE_COMMIT_METRIC,
    STATE_ROUND_METRIC,
    node_key,
)
from ..transport.records import to_ndarrays, to_record
from .state import ClientState
from .steps import StepCounts, StepWatch, innermost_optimizer, shortfall_text
from .training import GradientTerm, trainable

# Metric every rule's reply carries: the local optimiser steps it counted.
LOCAL_STEPS_METRIC = "local-steps"
#: Metric of a rule's reply: steps whose term was added, then lost before the
#: update (a backward pass after it, or the gradients cleared or replaced).
TERM_LOST_METRIC = "term-lost-steps"
#: Metric of a rule's reply: steps with no term added before the update.
TERM_MISSING_METRIC = "term-missing-steps"


class ProtocolError(Exception):
    """The server sent something this client cannot work with.

    Raised by a client or a client rule when the train message lacks what its
    algorithm needs (a config key or an ArrayRecord its strategy sends: is the
    ServerApp running that strategy?), or carries arrays that do not fit the
    model. The message names the strategy needed and what was received.
    :func:`to_client_app` turns it into an error reply with code
    ``MOD_FAILED_PRECONDITION``, so the server logs a failed node with the
    reason instead of averaging in a meaningless model.
    """


def require(config: Mapping[str, Any], key: str, client: str, strategy: str) -> Any:
    """Return ``config[key]`` or raise a ProtocolError naming the strategy needed."""
    if key not in config:
        raise ProtocolError(
            f"{client} needs '{key}' in the train config, which {strategy} sends; "
            f"is the ServerApp running {strategy}? Received keys: {sorted(config)}"
        )
    return config[key]


def accepted_round(config: Mapping[str, Any], client_key: int) -> int | None:
    """Return the last round whose reply was aggregated (None: not said)."""
    if ACCEPTED_ROUND_KEY in config:
        return int(config[ACCEPTED_ROUND_KEY])
    if ACCEPTED_KEYS_KEY in config:
        table = dict(
            zip(config[ACCEPTED_KEYS_KEY], config[ACCEPTED_ROUNDS_KEY], strict=True)
        )
        return int(table.get(client_key, -1))
    return None


def must_reset(config: Mapping[str, Any], client_key: int) -> bool:
    """Return True when the server asks this client to start afresh."""
    if config.get(RESET_STATE_KEY, False):
        return True
    return client_key in list(config.get(RESET_KEYS_KEY, []))


def client_key_of(context: Context | None) -> int:
    """Stable integer id of a client: its partition id, else its node id."""
    if context is None:
        return 0
    partition = context.node_config.get("partition-id")
    if partition is not None:
        return int(partition)
    return node_key(context.node_id)


def params_from_arrays(
    model: nn.Module,
    arrays: Sequence[NDArray],
    like: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Pick the trainable parameters' entries out of ``state_dict``-ordered arrays.

    The tensors take the dtype and device of ``like`` (one per trainable
    parameter; a rule passes its :attr:`ClientRule.anchor`), else the
    parameters' own.
    """
    keys = list(model.state_dict(keep_vars=True))
    if len(arrays) != len(keys):
        raise ProtocolError(f"received {len(arrays)} arrays, expected {len(keys)}")
    by_key = dict(zip(keys, arrays, strict=True))
    names = {id(p): name for name, p in model.named_parameters()}
    params = trainable(model)
    templates = params if like is None else list(like)
    return [
        torch.as_tensor(
            np.asarray(by_key[names[id(p)]]), dtype=t.dtype, device=t.device
        )
        for p, t in zip(params, templates, strict=True)
    ]


def numpy_dtype(tensor: torch.Tensor) -> np.dtype[Any]:
    """Return the numpy dtype a tensor travels as (bfloat16 as float32)."""
    if tensor.dtype == torch.bfloat16:
        return np.dtype(np.float32)
    return np.dtype(str(tensor.dtype).removeprefix("torch."))


def to_numpy(tensor: torch.Tensor, dtype: np.dtype[Any] | None = None) -> NDArray:
    """Return a tensor as a numpy array on the CPU, in ``dtype`` (default: its own)."""
    value = tensor.detach()
    if value.dtype == torch.bfloat16:
        value = value.float()
    array = value.cpu().numpy()
    return array if dtype is None or array.dtype == dtype else array.astype(dtype)


def arrays_from_params(
    model: nn.Module,
    tensors: Sequence[torch.Tensor],
    dtypes: Sequence[np.dtype[Any]] | None = None,
) -> list[NDArray]:
    """Lay out per-parameter tensors like ``state_dict`` (zeros for buffers).

    Each array takes the dtype of ``dtypes`` (one per ``state_dict`` entry:
    what the server sent), else its entry's own (bfloat16 as float32).
    """
    by_id = {id(p): t for p, t in zip(trainable(model), tensors, strict=True)}
    named = dict(model.named_parameters())
    entries = model.state_dict(keep_vars=True).items()
    wanted = list(dtypes) if dtypes is not None else [None] * len(entries)
    out = []
    for (key, value), given in zip(entries, wanted, strict=True):
        dtype = numpy_dtype(value) if given is None else np.dtype(given)
        param = named.get(key)
        tensor = by_id.get(id(param)) if param is not None else None
        out.append(
            to_numpy(tensor, dtype)
            if tensor is not None
            else np.zeros(tuple(value.shape), dtype=dtype)
        )
    return out


def rule_precision(param: torch.Tensor) -> torch.Tensor:
    """Return a copy of ``param`` in the precision a rule computes in.

    Half-precision parameters (bfloat16, float16) are copied as float32: the
    anchor, the state and the received records keep the server's precision
    while the model trains in the lower one.
    """
    value = param.detach().clone()
    if value.is_floating_point() and value.element_size() < 4:
        return value.float()
    return value


def _single(records: Mapping[str, Any], kind: str, preferred: str) -> Any:
    if preferred in records:
        return records[preferred]
    if len(records) == 1:
        return next(iter(records.values()))
    raise ProtocolError(
        f"message carries {len(records)} {kind}s, none named '{preferred}'"
    )


@dataclass
class Received:
    """What a train or evaluate message carries, in plain Python."""

    arrays: ArrayRecord  # the model
    config: dict[str, Any]  # the ConfigRecord as a dict
    extra: dict[str, list[NDArray]]  # every other ArrayRecord, name -> arrays


def read_message(message: Message) -> Received:
    """Split a message into the model, its config and the extra ArrayRecords."""
    content = message.content
    if SECAGG_RECORD in content.config_records:
        # Only a ClientApp without the mod lets a protocol message reach here.
        raise ProtocolError(
            "the server runs secure aggregation (SecAggPlus) and this ClientApp "
            f"does not answer it: {MISSING_MOD_HINT}"
        )
    arrays: ArrayRecord = _single(dict(content.array_records), "ArrayRecord", "arrays")
    config: ConfigRecord = (
        _single(dict(content.config_records), "ConfigRecord", "config")
        if content.config_records
        else ConfigRecord()
    )
    return Received(
        arrays=arrays,
        config={str(key): value for key, value in config.items()},
        extra={
            name: to_ndarrays(record)
            for name, record in content.array_records.items()
            if record is not arrays
        },
    )


@with_class_attributes()
class ClientRule:
    """One algorithm's client side: read, add the gradient term, reply.

    The base is FedAvg's rule: no term, no state, the model as the reply.
    An algorithm overrides
    :meth:`~flwr_prox_strategies.extend.ClientRule.setup`
    (read what it needs, return its
    :class:`~flwr_prox_strategies.extend.GradientTerm`) and
    :meth:`~flwr_prox_strategies.extend.ClientRule.finish`
    (advance its state, return its extra reply records and metrics).

    In a Message-API ``ClientApp``, build the rule with :meth:`from_message`
    (which loads the received model and passes the parameters below), add
    its term at every step with :meth:`attach` (or :meth:`add_gradient`), and
    reply with :meth:`reply`::

        @app.train()
        def train(msg: Message, context: Context) -> Message:
            model = Net()
            rule = FedProxRule.from_message(msg, context, model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            rule.attach(optimizer)  # adds the term at every step()
            ...  # your loop, your loss, your batches, your device
            return rule.reply(num_examples=len(trainloader.dataset),
                              metrics={"train_loss": loss})

    ``attach`` adds the term just before each update (after the closure's
    ``backward()`` for a closure-based step), so it comes after anything the
    loop does between ``backward()`` and ``step()`` (gradient clipping,
    say). To have the term clipped with the data gradient, call
    :meth:`add_gradient` yourself before clipping. The reply's
    ``<algorithm>-applied`` counts the optimiser steps whose update held the
    term (:attr:`~flwr_prox_strategies.extend.ClientRule.counts`), measured
    at every step; in Lightning or Hugging
    Face's Trainer, :mod:`flwr_prox_strategies.integrations` applies a rule
    in one line.

    Parameters
    ----------
    model : torch.nn.Module
        The model, already loaded with the received global model (the rule
        anchors at its current parameters).
    config : Mapping[str, Any]
        This round's train config (the ``ConfigRecord`` as a dict).
    received : Mapping[str, Sequence[NDArray]] | None (default: None)
        The extra ArrayRecords the server sent (name -> arrays in the model's
        ``state_dict`` order).
    state : ~flwr_prox_strategies.extend.ClientState | None (default: None)
        The client's cross-round state (in-memory when None).
    client_key : int (default: 0)
        The client's stable id: its partition id (the node's
        ``partition-id``), else its node id.
    relative_size : float (default: 1.0)
        ``n_k / mean_j n_j``; the FedDyn and FedDC official codes divide their
        penalty by it.
    base_lr : float | None (default: None)
        The learning rate before the server's per-round decay (FedDC's
        official beta = 1/(K lr0) uses it); when None, the step
        size seen in training divided by the server's ``lr-scale``.

    Raises
    ------
    ValueError
        If ``relative_size`` is not a finite number > 0, or a value the
        server sent is out of its range (naming it).
    ProtocolError
        If the train config lacks a key, or the message an ArrayRecord, that
        the algorithm's strategy sends (naming the strategy needed).

    Attributes
    ----------
    model : torch.nn.Module
        The model being trained.
    config : dict[str, Any]
        This round's train config.
    received : dict[str, Sequence[NDArray]]
        The extra ArrayRecords the server sent, in ``state_dict`` order (read
        them as tensors with ``received_params``).
    server_round : int
        The round the server numbered this message with (``server-round``):
        what :meth:`ClientState.set_pending
        <flwr_prox_strategies.extend.ClientState.set_pending>` takes.
    state : ~flwr_prox_strategies.extend.ClientState
        The client's cross-round state; save with ``set_pending``, never
        ``set``, what the server sums over.
    params : list[torch.Tensor]
        The model's trainable parameters, in ``model.parameters()`` order: the
        layout of the rule's state, of ``received_params`` and of ``anchor``.
        A reply record is laid out otherwise (every ``state_dict`` entry,
        buffers included): ``to_reply_layout``.
    anchor : list[torch.Tensor]
        The parameters at the received global model (float32 at least).
    client_key : int
        The client's stable id (the key of the server's per-client tables).
    relative_size : float
        ``n_k / mean_j n_j`` as given.
    term : GradientTerm | None
        What ``setup`` returned.
    """

    #: The strategy whose values the rule reads (named in protocol errors).
    protocol: ClassVar[str] = "FedAvg"
    #: The metric the reply carries, the count of optimiser steps whose update
    #: held the rule's term (measured at every step). It is the strategy's
    #: :attr:`~flwr_prox_strategies.extend.ValidatedFedAvg.rule_metric`, which
    #: warns about (or with ``strict=True`` rejects) replies without it or
    #: with fewer applied steps than ``local-steps``.
    applied_metric: ClassVar[str | None] = None
    #: Whether the client keeps state the server sums over. It is then
    #: committed in two phases (pending until the server confirms the reply
    #: was aggregated).
    stateful: ClassVar[bool] = False
    #: Whether the update assumes plain SGD steps (SCAFFOLD's and FedDC's
    #: control variates). Then every optimiser seen stepping the model
    #: (attached or not) must be ``torch.optim.SGD`` without momentum, with
    #: one learning rate: another is refused before its first update.
    plain_sgd: ClassVar[bool] = False
    #: Whether the client spends privacy itself (a noisy release) and keeps
    #: the total in ``context.state``: a resumed run must find that ledger,
    #: so the pack's experiment mirrors the state to disk.
    keeps_privacy_ledger: ClassVar[bool] = False
    #: Whether the state update estimates the round's mean gradient from the
    #: local path (SCAFFOLD's option II, FedDC's correction). Then the path is
    #: measured from the parameters at the first step
    #: (:meth:`~flwr_prox_strategies.ClientRule.starting_point`).
    path_estimate: ClassVar[bool] = False
    #: Whether the state update divides by the step size
    #: (:meth:`~flwr_prox_strategies.ClientRule.reply` then needs it).
    needs_lr: ClassVar[bool] = False
    #: The names of the state records the rule keeps in ``context.state``
    #: (what a reset forgets).
    state_names: ClassVar[tuple[str, ...]] = ()
    #: State records the client keeps for itself whatever the server does with
    #: its reply (APFL's personal model): saved with ``state.set``, outside
    #: the two-phase commit, because the server neither sums nor confirms
    #: them. Everything else a rule keeps goes through ``set_pending``.
    personal_state: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        model: nn.Module,
        config: Mapping[str, Any],
        *,
        received: Mapping[str, Sequence[NDArray]] | None = None,
        state: ClientState | None = None,
        client_key: int = 0,
        relative_size: float = 1.0,
        base_lr: float | None = None,
    ) -> None:
        if not (math.isfinite(relative_size) and relative_size > 0):
            raise ValueError(f"relative_size must be > 0, got {relative_size!r}")
        self.model = model
        self.config = dict(config)
        self.received = dict(received or {})
        self.state = state if state is not None else ClientState(None)
        self.client_key = int(client_key)
        self.relative_size = float(relative_size)
        self.base_lr = base_lr
        self.server_round = int(self.config.get(SERVER_ROUND_KEY, 0))
        if self.stateful:
            dropped = self.state.bind(self.config.get(RUN_TAG_KEY), self.state_names)
            if dropped is not None:
                log(
                    WARNING,
                    "client %d: its saved state (%s) %s; ignored, the client "
                    "starts afresh and the server accounts for it",
                    self.client_key,
                    self.state.path or "context.state",
                    dropped,
                )
            if must_reset(self.config, self.client_key):
                self.state.reset(self.state_names)
            self.state.resolve(accepted_round(self.config, self.client_key))
        # The state records as committed when the round began: a record the
        # rule replaces before it replies was saved outside the two-phase
        # commit (see metrics()).
        self._committed_at_start = {
            name: self.state.records.array_records.get(name)
            for name in self.state_names
        }
        self.params = trainable(model)
        # The received global model, the point every rule measures from (in
        # float32 at least: a half-precision model keeps a full-precision anchor).
        self.anchor = [rule_precision(p) for p in self.params]
        # Where local training started: the anchor, unless the user changed
        # part of the model after from_message (a personal layer restored).
        self.start = self.anchor
        self._own_steps = 0
        self._given_lrs: list[float] = []
        self._prepared = False
        self._first: torch.Tensor | None = None
        self._first_device: torch.device | None = None
        self._warned_twice = False
        self._warned_outside = False
        self._handles: list[Any] = []
        self._message: Message | None = None
        self._keys: list[str] = []
        self._dtypes: list[np.dtype[Any]] | None = None
        self.term: GradientTerm | None = self.setup()
        # Counts the optimiser steps over the model and whether each held the
        # term: what the reply reports (see .steps).
        self.watch = StepWatch(
            model,
            self.params,
            on_optimizer=self._learn_optimizer,
            on_params_changed=self._trainable_now,
        )

    def undecayed_lr(self, lr: float) -> float:
        """Return the step size before the server's per-round decay (``base_lr``)."""
        if self.base_lr is not None:
            return float(self.base_lr)
        return lr / float(self.config.get(LR_SCALE_KEY, 1.0))

    # ---------------------------------------------------------- the algorithm
    def setup(self) -> GradientTerm | None:
        """Read this round's values and state; return the gradient term.

        Called once, when the rule is built. Read the config with
        :meth:`required`, extra ArrayRecords with :meth:`received_params` and
        the client's state with ``self.state``; the model's parameters at the
        received global model are ``self.anchor``.

        Returns
        -------
        GradientTerm | None
            The term added to the data gradient at every step; None (the base,
            FedAvg): nothing.
        """
        return None

    def finish(
        self, steps: int, lr: float
    ) -> tuple[dict[str, list[NDArray]], dict[str, Any]]:
        """Advance the state after ``steps`` steps of size ``lr``.

        Called once, after training. A stateful rule saves its new state as
        pending (``self.state.set_pending(...)``).

        Parameters
        ----------
        steps : int
            The optimiser steps taken this round.
        lr : float
            Their step size (their mean when it varied; NaN when unknown and
            not needed).

        Returns
        -------
        tuple[dict[str, list[NDArray]], dict[str, Any]]
            The extra reply records (name -> arrays in ``state_dict`` order)
            and the rule's metrics. The base returns neither.
        """
        return {}, {}

    def required(self, key: str) -> Any:
        """Return ``config[key]``, or fail naming the strategy this rule needs.

        Parameters
        ----------
        key : str
            A train-config key the strategy sends.

        Returns
        -------
        Any
            The value.

        Raises
        ------
        ProtocolError
            If the config has no ``key``, naming :attr:`protocol`.
        """
        try:
            return require(self.config, key, type(self).__name__, self.protocol)
        except ProtocolError as err:
            raise ProtocolError(f"{err}{self._server_hint()}") from None

    def _server_hint(self) -> str:
        # Another algorithm's strategy is recognised by its config keys, which
        # start like its rule's applied metric ("feddyn-alpha", "feddyn-applied").
        for rule in pack_rules():
            metric = rule.applied_metric
            if metric is None or rule is type(self):
                continue
            prefix = metric.removesuffix("-applied") + "-"
            if any(str(key).startswith(prefix) for key in self.config):
                return (
                    f". The server runs {rule.protocol} (it sent its "
                    f"'{prefix}*' keys): build {rule.__name__} in your "
                    f"@app.train instead of {type(self).__name__}"
                )
        return ""

    def received_params(self, name: str) -> list[torch.Tensor]:
        """Return the extra ArrayRecord ``name`` as tensors like the parameters.

        Parameters
        ----------
        name : str
            The record the strategy sends (SCAFFOLD's ``scaffold-c``, ...).

        Returns
        -------
        list[torch.Tensor]
            One tensor per trainable parameter, on its device and dtype.

        Raises
        ------
        ProtocolError
            If the message carried no such record, or it does not fit the model.
        """
        if name not in self.received:
            raise ProtocolError(
                f"{type(self).__name__} needs the ArrayRecord '{name}' that "
                f"{self.protocol} sends; is the ServerApp running {self.protocol}? "
                f"Received: {sorted(self.received)}"
            )
        return params_from_arrays(self.model, self.received[name], like=self.anchor)

    def to_reply_layout(
        self, tensors: Sequence[torch.Tensor], *, buffers: str = "zeros"
    ) -> list[NDArray]:
        """Lay out one tensor per trainable parameter as a reply record is laid out.

        Reply records (the model's and every extra one) hold one array per
        ``state_dict`` entry, buffers included (BatchNorm's running
        statistics), in ``state_dict`` order and in the dtypes the server
        sent (a rule built by
        :meth:`~flwr_prox_strategies.ClientRule.from_message`; else the
        model's); the rule's state, its ``anchor`` and ``received_params``
        hold one per trainable parameter (its ``params``). Return a
        :meth:`finish` record through this, so it never loses the buffers.

        Parameters
        ----------
        tensors : Sequence[torch.Tensor]
            One per trainable parameter, in the rule's ``params`` order.
        buffers : str (default: "zeros")
            What the record holds at the entries that are not trainable
            parameters (buffers, frozen parameters): zeros (a difference or a
            control variate has none) or the model's current values.

        Returns
        -------
        list[NDArray]
            One array per ``state_dict`` entry, ready for :meth:`finish`'s
            records.

        Raises
        ------
        ValueError
            If ``buffers`` is another value, or ``tensors`` does not have one
            tensor of the right shape per trainable parameter.
        """
        if buffers not in ("zeros", "model"):
            raise ValueError(f"buffers must be 'zeros' or 'model', got {buffers!r}")
        tensors = list(tensors)
        if len(tensors) != len(self.params) or any(
            tuple(t.shape) != tuple(p.shape)
            for t, p in zip(tensors, self.params, strict=True)
        ):
            raise ValueError(
                f"{type(self).__name__}.to_reply_layout takes one tensor per trainable "
                f"parameter ({len(self.params)}, shaped as rule.params), got "
                f"{len(tensors)}"
            )
        entries = self.model.state_dict()
        arrays = arrays_from_params(self.model, tensors, self._server_dtypes())
        if buffers == "model":
            ours = {id(p) for p in self.params}
            trained = {n for n, p in self.model.named_parameters() if id(p) in ours}
            for i, (name, value) in enumerate(entries.items()):
                if name not in trained:
                    arrays[i] = to_numpy(value, arrays[i].dtype)
        return arrays

    def _server_dtypes(self) -> list[np.dtype[Any]] | None:
        """Return the dtypes the server sent, one per ``state_dict`` entry, or None."""
        dtypes = self._dtypes
        if not dtypes or len(dtypes) != len(self.model.state_dict()):
            return None
        return dtypes

    def from_reply_layout(self, arrays: Sequence[NDArray]) -> list[torch.Tensor]:
        """Pick the trainable parameters' entries out of a record's arrays.

        The inverse of :meth:`to_reply_layout`: ``state_dict``-ordered arrays
        (a received record's, a reply's) -> one tensor per trainable
        parameter, on the device and in the dtype of the rule's ``anchor``.

        Parameters
        ----------
        arrays : Sequence[NDArray]
            One array per ``state_dict`` entry.

        Returns
        -------
        list[torch.Tensor]
            One tensor per trainable parameter, in the rule's ``params`` order.

        Raises
        ------
        ProtocolError
            If the number of arrays is not the number of ``state_dict`` entries.
        """
        return params_from_arrays(self.model, arrays, like=self.anchor)

    def saved_outside_commit(self) -> list[str]:
        """Return the state records this round's rule saved outside the commit.

        A record of :attr:`state_names` that is committed now but was not
        when the round began (or was another) was written with
        :meth:`ClientState.set <flwr_prox_strategies.extend.ClientState.set>`,
        which commits at once: a reply the server then rejects would still
        change the client's state, and the server cannot confirm it. Save it
        with ``self.state.set_pending(name, arrays, self.server_round)``.

        Returns
        -------
        list[str]
            Their names (empty for a rule that uses ``set_pending``).
        """
        records = self.state.records.array_records
        return [
            name
            for name in self.state_names
            if records.get(name) is not None
            and records.get(name) is not self._committed_at_start.get(name)
        ]

    def metrics(self) -> dict[str, Any]:
        """Return the metrics every reply of this rule carries.

        Returns
        -------
        dict[str, Any]
            :attr:`applied_metric`: the optimiser steps whose update held the
            term (measured, see
            :attr:`~flwr_prox_strategies.extend.ClientRule.counts`), with
            ``term-lost-steps`` and ``term-missing-steps``, the steps that did
            not; ``client-key``;
            and, for a stateful rule, ``state-round`` (the round its committed
            state comes from) and ``state-outside-commit`` (how many of its
            state records it saved outside the two-phase commit, see
            :meth:`saved_outside_commit`).
        """
        metrics: dict[str, Any] = {}
        if self.applied_metric is not None:
            counts = self.counts
            metrics[self.applied_metric] = counts.applied
            metrics[TERM_LOST_METRIC] = counts.lost
            metrics[TERM_MISSING_METRIC] = counts.missing
        metrics[CLIENT_KEY_METRIC] = self.client_key  # orders the server's sum
        if self.stateful:
            metrics[STATE_ROUND_METRIC] = self.state.committed_round()
            outside = self.saved_outside_commit()
            metrics[STATE_OUTSIDE_COMMIT_METRIC] = len(outside)
            if outside and not self._warned_outside:
                self._warned_outside = True
                log(
                    ERROR,
                    "client %d: %s saved its state %s with state.set, which commits "
                    "at once (a reply the server rejects would still change the "
                    "client): save it with self.state.set_pending(name, arrays, "
                    "self.server_round) in finish()",
                    self.client_key,
                    type(self).__name__,
                    outside,
                )
        return metrics

    # ------------------------------------------------------ what was measured
    @property
    def counts(self) -> StepCounts:
        """The round's steps so far, and which held the term (measured).

        Counted at every ``step()`` of a torch optimiser over the model's
        parameters (the steps taken, those whose update held the term, those
        that lost it, those that never got it); a loop without one is
        counted by its
        :meth:`~flwr_prox_strategies.ClientRule.add_gradient` calls; a rule
        that takes its own steps (FedEPM) by
        :meth:`~flwr_prox_strategies.extend.ClientRule.took_steps`.
        """
        if self._own_steps:
            return StepCounts(steps=self._own_steps, applied=self._own_steps)
        return self.watch.result()

    @property
    def steps(self) -> int:
        """The local steps taken so far this round (measured).

        See :attr:`~flwr_prox_strategies.extend.ClientRule.counts`.
        """
        return self.counts.steps

    def took_steps(self, steps: int) -> None:
        """Record ``steps`` steps the rule took itself (its update, by construction).

        For rules that compute their own update instead of adding a term to
        an optimiser's (FedEPM's closed-form iterations).
        """
        self._own_steps += int(steps)

    # ------------------------------------------------------ in the user's loop
    def add_gradient(self, lr: float | None = None) -> None:
        """Add the term's gradient to every ``p.grad``, once per step.

        Call it between ``loss.backward()`` (and the whole of it: with a
        closure-based step, inside the closure after ``backward()``) and the
        optimiser's update, when you do not :meth:`attach` the rule; a second
        call before the update adds nothing. Whether the update then holds
        the term is measured
        (:attr:`~flwr_prox_strategies.extend.ClientRule.counts`), not assumed.

        Parameters
        ----------
        lr : float | None (default: None)
            The step size about to be taken, for a loop without a torch
            optimiser (the rule reads it from the optimiser that steps).

        Raises
        ------
        RuntimeError
            If the model's parameters changed shape, or were moved or
            replaced after the first step.
        """
        self._prepare()
        if self.watch.term_intact():
            if not self._warned_twice:
                self._warned_twice = True
                log(
                    WARNING,
                    "client %d: %s.add_gradient was called again before the "
                    "optimiser's update; the term is added once per step",
                    self.client_key,
                    type(self).__name__,
                )
            return
        if self.term is not None:
            self.term.add_(self.params)
        self.watch.term_added(in_gradients=self.term is not None)
        if lr is not None:
            self._given_lrs.append(float(lr))

    def ensure_term(self) -> None:
        """Add the term unless this step's gradients already hold it.

        What :meth:`attach` runs before every update (after the closure, for
        a closure-based step).
        """
        if not self.watch.term_intact():
            self.add_gradient()

    def _prepare(self) -> None:
        """Before the first step: follow a moved model, note where training starts."""
        if self._prepared:
            # A cheap look each step (the model's first parameter, the same
            # object on the same device), the whole check when it changed.
            first = next(iter(self.model.parameters()), None)
            if first is not self._first or (
                first is not None and first.device != self._first_device
            ):
                self.check_model_unmoved()
            return
        self.follow_model()
        if self.path_estimate:
            self.start = self.starting_point()
        self._first = next(iter(self.model.parameters()), None)
        self._first_device = None if self._first is None else self._first.device
        self._prepared = True

    def _trainable_now(self) -> list[torch.Tensor]:
        return trainable(self.model)

    def _learn_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Check an optimiser that steps the model (attached or not) before it does."""
        self._prepare()
        if self.plain_sgd:
            self.check_plain_sgd(optimizer)

    def starting_point(self) -> list[torch.Tensor]:
        """Return the parameters local training starts from (read at the first step).

        They are :attr:`anchor`, the received global model, unless the user
        changed some after :meth:`from_message` (a personal layer restored
        from ``context.state``, as Flower's advanced-pytorch example does).
        The anchor stays the global model every term pulls towards (FedProx's
        and FedDyn's penalties, FedDyn's and FedDC's drift); the rules that
        estimate the round's mean gradient from the local path (SCAFFOLD's
        option II, FedDC's correction) divide the path from this point, so a
        restored layer's jump is not counted as gradient.
        """
        changed = [
            i
            for i, (p, a) in enumerate(zip(self.params, self.anchor, strict=True))
            if not torch.equal(p.detach(), a.to(p.dtype))
        ]
        if not changed:
            return self.anchor
        log(
            INFO,
            "client %d: %d of the model's %d trainable tensors differ from the "
            "received model at the first step (changed after from_message); "
            "%s measures this round's gradient estimate from there",
            self.client_key,
            len(changed),
            len(self.params),
            type(self).__name__,
        )
        return [rule_precision(p) for p in self.params]

    def follow_model(self) -> None:
        """Follow a model moved to another device or dtype since the rule was built.

        Frameworks move the model after :meth:`from_message` (Lightning does
        it inside ``fit()``, converting it for ``precision="bf16-true"``
        too). Before the first step the rule follows: it moves its anchor
        (keeping its precision) and builds its term again (:meth:`setup`) on
        the parameters' device. A dtype change alone needs nothing: the term
        is computed in the rule's precision and added to the gradients in
        theirs.

        Raises
        ------
        RuntimeError
            If the parameters no longer match the received model's shapes.
        """
        current = trainable(self.model)
        same = len(current) == len(self.params) and all(
            p is q for p, q in zip(current, self.params, strict=True)
        )
        moved = any(
            p.device != a.device for p, a in zip(current, self.anchor, strict=False)
        )
        if same and not moved:
            return
        if len(current) != len(self.anchor) or any(
            p.shape != a.shape for p, a in zip(current, self.anchor, strict=True)
        ):
            raise RuntimeError(
                f"{type(self).__name__}: the model's trainable parameters no "
                "longer match the received model's shapes; build the rule on "
                "the model you train"
            )
        device = current[0].device if current else torch.device("cpu")
        self.params = current
        self.anchor = [
            a.to(p.device) for a, p in zip(self.anchor, current, strict=True)
        ]
        self.start = self.anchor
        self.term = self.setup()
        self.watch.follow(current)
        log(
            INFO,
            "client %d: the model moved (device %s, dtype %s) after the rule "
            "was built; %s follows it",
            self.client_key,
            device,
            current[0].dtype if current else "-",
            type(self).__name__,
        )

    def check_model_unmoved(self) -> None:
        """Fail if its parameters were moved or replaced after the first step."""
        current = trainable(self.model)
        moved = len(current) != len(self.params) or any(
            p is not q or p.device != a.device
            for p, q, a in zip(current, self.params, self.anchor, strict=False)
        )
        if moved:
            raise RuntimeError(
                f"{type(self).__name__}: the model's parameters were moved or "
                "replaced after local training started; move the model before "
                "its first step"
            )

    def attach(self, optimizer: Any) -> Any:
        """Add the term at every ``optimizer.step()``, once, just before the update.

        For a step called with a closure (Lightning's automatic optimisation,
        LBFGS, any ``optimizer.step(closure)``) the term is added after the
        closure has run ``backward()``, at every call of the closure, and
        the closure's returned loss includes the term's value when the term
        has one (``value(params)``); otherwise in the step's pre-hook. Either
        way it comes after anything your loop does between ``backward()`` and
        ``step()`` (gradient clipping, AMP's unscaling). To have the term
        clipped with the data gradient, call :meth:`add_gradient` yourself
        before clipping: the hook then adds nothing more.

        Parameters
        ----------
        optimizer : torch.optim.Optimizer
            Built from ``model.parameters()`` of the model given to the rule.
            A wrapper (opacus' ``DPOptimizer``, accelerate's
            ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``) is
            hooked through the optimiser it wraps, so under DP-SGD the term
            comes after the clipping and the noise.

        Returns
        -------
        torch.optim.Optimizer
            The same optimiser, hooked (:meth:`detach` removes the hook;
            :meth:`reply` does).

        Raises
        ------
        ValueError
            If the optimiser does not update every trainable parameter of the
            model, or the rule assumes plain SGD (SCAFFOLD, FedDC) and the
            optimiser is not ``torch.optim.SGD`` without momentum.
        """
        target = innermost_optimizer(optimizer)
        if self.plain_sgd:
            self.check_plain_sgd(target)
        optimized = {id(p) for group in target.param_groups for p in group["params"]}
        missing = [
            i for i, p in enumerate(trainable(self.model)) if id(p) not in optimized
        ]
        if missing:
            raise ValueError(
                f"{type(self).__name__}.attach: the optimizer does not update "
                f"{len(missing)} of the model's trainable parameters; build it "
                "from model.parameters() of the model given to the rule"
            )
        self._handles.append(target.register_step_pre_hook(self._before_update))
        return optimizer

    def _before_update(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Step pre-hook of :meth:`attach`: add the term now, or after the closure."""
        # (args[0] is the optimiser itself: torch passes step's own arguments.)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self.ensure_term()
            return None

        def closure_with_term() -> Any:
            loss = closure()
            self.ensure_term()
            value = getattr(self.term, "value", None)
            if isinstance(loss, torch.Tensor) and callable(value):
                loss = loss + value(self.params)
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_with_term}
        return (args[0], closure_with_term, *args[2:]), dict(kwargs)

    def check_plain_sgd(self, optimizer: Any) -> None:
        """Refuse an optimiser whose steps are not plain SGD steps of one size.

        Raises
        ------
        ValueError
            Naming the optimiser found and what the rule needs.
        """
        optimizer = innermost_optimizer(optimizer)
        if type(optimizer) is not torch.optim.SGD:
            raise ValueError(
                f"{type(self).__name__} needs torch.optim.SGD without momentum "
                f"({self.protocol}'s control-variate update assumes plain SGD "
                f"steps); got {type(optimizer).__name__}. Build the optimiser "
                "your training stack steps as torch.optim.SGD(params, lr=..., "
                "momentum=0)"
            )
        for group in optimizer.param_groups:
            if group.get("momentum", 0.0) != 0.0 or group.get("nesterov", False):
                raise ValueError(
                    f"{type(self).__name__} needs momentum=0 ({self.protocol}'s "
                    "control-variate update assumes plain SGD steps); got "
                    f"momentum={group.get('momentum')}"
                )
        rates = {float(group["lr"]) for group in optimizer.param_groups}
        if len(rates) > 1:
            raise ValueError(
                f"{type(self).__name__} needs one learning rate for every "
                f"parameter ({self.protocol}'s update divides by it); the "
                f"optimiser's groups have {sorted(rates)}"
            )

    def detach(self) -> None:
        """Remove the optimiser hooks :meth:`attach` installed (:meth:`reply` does)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def close(self) -> None:
        """End the round's watch: remove every hook; warn if a step lacked the term.

        :meth:`reply` and :meth:`reply_records` call it; the counts
        (:attr:`~flwr_prox_strategies.extend.ClientRule.counts`) stay readable.
        """
        self.detach()
        if self.watch.closed:
            return
        self.watch.close()
        counts = self.counts
        if self.applied_metric is None or counts.applied >= counts.steps:
            return
        log(
            WARNING,
            "client %d: %s's term reached the update in %d of %d optimiser steps: %s",
            self.client_key,
            type(self).__name__,
            counts.applied,
            counts.steps,
            shortfall_text(counts.lost, counts.missing, type(self).__name__),
        )

    # ------------------------------------------------------ Message API, both ends
    @classmethod
    def from_message(
        cls,
        message: Message,
        context: Context,
        model: nn.Module,
        *,
        state_dir: str | None = None,
        **options: Any,
    ) -> ClientRule:
        """Read a train message: load its model into ``model``, build the rule.

        The client key is the node's ``partition-id``, else its node id.

        Parameters
        ----------
        message : Message
            The train message of the pack's strategy.
        context : Context
            The node's context (``context.state`` keeps the rule's state).
        model : torch.nn.Module
            Your model; the received arrays are loaded into it (on its device).
        state_dir : str | None (default: None)
            Mirror the rule's state to ``<state_dir>/<client key>.npz`` so a
            restarted node resumes it (see
            :class:`~flwr_prox_strategies.extend.ClientState`).
        **options
            The rule's own options (``relative_size``, ``base_lr``, and those
            of the subclass, e.g. FedDyn's ``decoupled``).

        Returns
        -------
        ClientRule
            The rule, anchored at the received model.

        Raises
        ------
        ProtocolError
            If the message's arrays do not fit ``model``, or it lacks what
            the algorithm's strategy sends (naming the strategy needed).
        ValueError
            If an option or a received value is out of range.
        """
        received = read_message(message)
        load_arrays(model, received.arrays)
        key = client_key_of(context)
        rule = cls(
            model,
            received.config,
            received=received.extra,
            state=ClientState(context, state_dir=state_dir, client_key=str(key)),
            client_key=key,
            **options,
        )
        rule._message = message
        rule._keys = list(received.arrays.keys())
        rule._dtypes = [np.dtype(array.dtype) for array in received.arrays.values()]
        return rule

    def lr_of_round(self, lr: float | None) -> float:
        """Return the step size of this round's steps (for :meth:`finish`).

        The rates the optimiser actually applied when it was seen stepping
        (their mean: a scheduler's rates too; the rate itself when constant),
        else ``lr``, else the rates given to :meth:`add_gradient`.
        """
        measured = self.counts.lr_mean()
        if measured is not None:
            if lr is None or math.isclose(float(lr), measured, rel_tol=1e-6):
                return measured if lr is None else float(lr)
            log(
                WARNING,
                "client %d: %s was given lr=%g, but the optimiser's steps had a "
                "mean learning rate of %g; the measured rate is used",
                self.client_key,
                type(self).__name__,
                float(lr),
                measured,
            )
            return measured
        if lr is not None:
            return float(lr)
        if self._given_lrs:
            first = self._given_lrs[0]
            if all(rate == first for rate in self._given_lrs):
                return first
            return sum(self._given_lrs) / len(self._given_lrs)
        if self.steps == 0 or not self.needs_lr:
            return math.nan  # no step taken, or no state divides by it
        raise ValueError(
            f"{type(self).__name__}: give reply(lr=...) or attach the optimizer; "
            f"{self.protocol}'s update divides by the step size"
        )

    def reply_records(
        self, *, steps: int | None = None, lr: float | None = None
    ) -> tuple[dict[str, list[NDArray]], dict[str, Any]]:
        """Finish the round; return the extra records and metrics to send.

        What :meth:`reply` sends, for a client that builds its own reply (as
        the pack's clients do).

        Parameters
        ----------
        steps : int | None (default: None)
            The optimiser steps taken; when a torch optimiser was seen
            stepping the model, its measured count is used (a different
            ``steps`` is logged).
        lr : float | None (default: None)
            Their step size; the rates the optimiser applied are used when it
            was seen stepping.

        Returns
        -------
        tuple[dict[str, list[NDArray]], dict[str, Any]]
            The extra records (name -> arrays in ``state_dict`` order) and
            the metrics (the rule's,
            :meth:`~flwr_prox_strategies.extend.ClientRule.metrics`
            and ``local-steps``).
        """
        self.close()
        counted = self.counts.steps
        if steps is None or (self.watch.observed and int(steps) == counted):
            steps = counted
        elif self.watch.observed:
            log(
                WARNING,
                "client %d: %s was told %d steps, but the optimiser took %d; "
                "the counted steps are used",
                self.client_key,
                type(self).__name__,
                int(steps),
                counted,
            )
            steps = counted
        steps = int(steps)
        extra, metrics = self.finish(steps, self.lr_of_round(lr))
        self.state.flush()
        return extra, {**metrics, **self.metrics(), LOCAL_STEPS_METRIC: steps}

    def reply(
        self,
        *,
        num_examples: int,
        metrics: Mapping[str, Any] | None = None,
        steps: int | None = None,
        lr: float | None = None,
    ) -> Message:
        """Build the train reply: the model, the records and metrics expected.

        Parameters
        ----------
        num_examples : int
            The local training set's size (the average's weight).
        metrics : Mapping[str, Any] | None (default: None)
            Your own numeric metrics (e.g. ``train_loss``).
        steps, lr : int | float | None (default: None)
            The optimiser steps taken and their step size; counted by
            :meth:`attach` / :meth:`add_gradient` when not given.

        Returns
        -------
        Message
            The reply to the train message: the model (``"arrays"``), the
            extra records the strategy expects, and the metrics with
            ``num-examples`` and the rule's own (``<algorithm>-applied``, the
            client key, ...). The rule's state is saved.

        Raises
        ------
        RuntimeError
            If the rule was not built by :meth:`from_message`.
        ValueError
            If the rule's state update divides by the step size and neither
            ``lr`` was given nor the optimiser attached.
        """
        if self._message is None:
            raise RuntimeError(
                f"{type(self).__name__}.reply needs a rule built by from_message"
            )
        extra, rule_metrics = self.reply_records(steps=steps, lr=lr)
        record = MetricRecord()
        for key, value in {**dict(metrics or {}), **rule_metrics}.items():
            if isinstance(value, (bool, np.bool_)):
                value = int(value)
            elif isinstance(value, (np.generic, torch.Tensor)):
                value = value.item()  # MetricRecord holds Python numbers
            record[key] = value
        record[NUM_EXAMPLES_KEY] = int(num_examples)
        values = list(self.model.state_dict().values())
        # In the dtypes the server sent (a half-precision model replies in them).
        dtypes = self._server_dtypes()
        state = [
            to_numpy(v, None if dtypes is None else dtypes[i])
            for i, v in enumerate(values)
        ]
        content = RecordDict({"arrays": to_record(state, self._keys or None)})
        for name, arrays in extra.items():
            if dtypes is not None and len(arrays) == len(dtypes):
                arrays = [
                    np.asarray(a).astype(dt, copy=False)
                    for a, dt in zip(arrays, dtypes, strict=True)
                ]
            content[name] = to_record(arrays, self._keys or None)
        content["metrics"] = record
        return Message(content, reply_to=self._message)


def pack_rules() -> list[type[ClientRule]]:
    """Return every client rule the pack defines (the imported ones)."""
    found: list[type[ClientRule]] = []
    pending = list(ClientRule.__subclasses__())
    while pending:
        rule = pending.pop(0)
        pending.extend(rule.__subclasses__())
        if rule.__module__.startswith("flwr_prox_strategies.") and rule not in found:
            found.append(rule)
    return found


def load_arrays(model: nn.Module, arrays: ArrayRecord | Sequence[NDArray]) -> None:
    """Load arrays into ``model`` (``state_dict`` order, every shape checked)."""
    values = to_ndarrays(arrays) if isinstance(arrays, ArrayRecord) else arrays
    state = model.state_dict()
    if len(values) != len(state):
        raise ProtocolError(
            f"received {len(values)} arrays, the model has {len(state)} tensors"
        )
    new_state = {}
    for (key, current), value in zip(state.items(), values, strict=True):
        if tuple(current.shape) != tuple(np.shape(value)):
            raise ProtocolError(
                f"array for '{key}' has shape {np.shape(value)}, "
                f"model expects {tuple(current.shape)}"
            )
        new_state[key] = torch.as_tensor(
            np.asarray(value), dtype=current.dtype, device=current.device
        )
    model.load_state_dict(new_state, strict=True)


__all__ = [
    "ClientRule",
    "ProtocolError",
    "accepted_round",
    "arrays_from_params",
    "client_key_of",
    "load_arrays",
    "params_from_arrays",
    "read_message",
    "require",
]

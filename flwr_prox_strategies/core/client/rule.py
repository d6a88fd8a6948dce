"""Client rules: an algorithm's client side, as pieces for any training loop.

A :class:`ClientRule` holds one algorithm's three changes to local training:
**read** what its strategy sent and the client's state, **add** its gradient
term at every optimiser step (:meth:`ClientRule.attach`), **reply** with the
model, its strategy's records and its state advanced (the two-phase commit of
:mod:`.state`); the loop, optimiser, loss and device stay the user's. The pack's
own clients run the same rule in :func:`.training.train_local`. Usage, where
``attach`` adds the term and what the reply's counts measure (:mod:`.steps`):
the documentation's page "Use your own ClientApp and training loop".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from flwr.app import Message
from numpy.typing import NDArray
from torch import nn

from ..docstrings import with_class_attributes
from ..transport.keys import (
    CLIENT_KEY_METRIC,
    LOCAL_STEPS_METRIC,
    LR_SCALE_KEY,
    SERVER_ROUND_KEY,
    TERM_LOST_METRIC,
    TERM_MISSING_METRIC,
)
from .layout import (
    ReplyLayout,
    arrays_from_params,
    load_arrays,
    params_from_arrays,
    rule_precision,
)
from .message import (
    ProtocolError,
    accepted_round,
    client_key_of,
    read_message,
    require,
    server_hint,
)
from .runtime import RuleRuntime
from .state import ClientState, RoundCommit
from .training import GradientTerm, trainable
from .wiring import TermWiring


@with_class_attributes()
class ClientRule(RuleRuntime):
    """One algorithm's client side: read, add the gradient term, reply.

    The base is FedAvg's rule: no term, no state, the model as the reply. An
    algorithm overrides :meth:`~flwr_prox_strategies.extend.ClientRule.setup`
    (return its :class:`~flwr_prox_strategies.extend.GradientTerm`) and
    :meth:`~flwr_prox_strategies.extend.ClientRule.finish` (advance its
    state, return its extra reply records and metrics), and declares what it
    is in the class attributes below. The machinery lives in
    the rule's parts: ``wiring`` (the term at every step, measured),
    ``layout`` (reply records as the server laid them out) and ``commit``
    (a stateful rule's two-phase commit).

    In a Message-API ``ClientApp``::

        @app.train()
        def train(msg: Message, context: Context) -> Message:
            model = Net()
            rule = FedProxRule.from_message(msg, context, model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            rule.attach(optimizer)  # adds the term at every step()
            ...  # your loop, your loss, your batches, your device
            return rule.reply(num_examples=len(trainloader.dataset),
                              metrics={"train_loss": loss})

    :mod:`flwr_prox_strategies.integrations` applies it in Lightning or
    Hugging Face's Trainer.

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
        The client's stable id: its partition id, else its node id.
    relative_size : float (default: 1.0)
        ``n_k / mean_j n_j``; the FedDyn and FedDC official codes divide their
        penalty by it.
    base_lr : float | None (default: None)
        The learning rate before the server's per-round decay (FedDC's
        official beta = 1/(K lr0) uses it); when None, the step size seen in
        training divided by the server's ``lr-scale``.

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
        what ``state.set_pending`` takes.
    state : ~flwr_prox_strategies.extend.ClientState
        The client's cross-round state; save with ``set_pending``, never
        ``set``, what the server sums over.
    params : list[torch.Tensor]
        The model's trainable parameters, in ``model.parameters()`` order: the
        layout of the rule's state, of ``received_params`` and of ``anchor``
        (a reply record holds every ``state_dict`` entry: ``to_reply_layout``).
    anchor : list[torch.Tensor]
        The parameters at the received global model (float32 at least).
    start : list[torch.Tensor]
        Where local training started: ``anchor``, or for a rule with
        ``path_estimate`` the parameters at the first step.
    client_key : int
        The client's stable id (the key of the server's per-client tables).
    relative_size : float
        ``n_k / mean_j n_j`` as given.
    term : GradientTerm | None
        What ``setup`` returned.
    """

    #: The strategy whose values the rule reads (named in protocol errors).
    protocol: ClassVar[str] = "FedAvg"
    #: The reply's count of optimiser steps whose update held the term
    #: (measured): the strategy's
    #: :attr:`~flwr_prox_strategies.extend.ValidatedFedAvg.rule_metric`.
    applied_metric: ClassVar[str | None] = None
    #: Whether the client keeps state the server sums over (then committed in
    #: two phases: pending until the server confirms the reply was aggregated).
    stateful: ClassVar[bool] = False
    #: Whether the update assumes plain SGD steps (SCAFFOLD's and FedDC's
    #: control variates): any other optimiser stepping the model is refused
    #: before its first update.
    plain_sgd: ClassVar[bool] = False
    #: Whether the client spends privacy itself (a noisy release) and keeps
    #: the total in ``context.state``: a resumed run must find that ledger,
    #: so the pack's experiment mirrors the state to disk.
    keeps_privacy_ledger: ClassVar[bool] = False
    #: Whether the state update estimates the round's mean gradient from the
    #: local path (SCAFFOLD's option II, FedDC's correction). Then the path is
    #: measured from the parameters at the first step (``start``).
    path_estimate: ClassVar[bool] = False
    #: Whether the state update divides by the step size.
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
        self.commit = (
            RoundCommit(
                self.state,
                self.state_names,
                self.config,
                client_key=self.client_key,
                rule=type(self).__name__,
            )
            if self.stateful
            else None
        )
        self.params = trainable(model)
        # Float32 at least: a half-precision model keeps a full-precision anchor.
        self.anchor = [rule_precision(p) for p in self.params]
        self.start = self.anchor
        self.layout = ReplyLayout(model)
        self._message: Message | None = None
        self.term: GradientTerm | None = self.setup()
        self.wiring = TermWiring(self)

    # ------------------------------------------------- what an algorithm writes
    def setup(self) -> GradientTerm | None:
        """Read this round's values and state; return the gradient term.

        Called once, when the rule is built (and again on the new device if
        the model moves before the first step). Read the config with
        :meth:`required`, extra ArrayRecords with :meth:`received_params`, the
        client's state with ``self.state``; the parameters at the received
        global model are ``self.anchor``.

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
        pending (``self.state.set_pending(name, arrays, self.server_round)``).

        Parameters
        ----------
        steps : int
            The optimiser steps taken this round (measured).
        lr : float
            Their step size (their mean when it varied; NaN when unknown and
            not needed).

        Returns
        -------
        tuple[dict[str, list[NDArray]], dict[str, Any]]
            The extra reply records (name -> arrays in ``state_dict`` order,
            see :meth:`to_reply_layout`) and the rule's metrics. The base
            returns neither.
        """
        return {}, {}

    # ------------------------------------------------ what an algorithm calls
    def required(self, key: str) -> Any:
        """Return ``config[key]``, or raise a ProtocolError naming :attr:`protocol`."""
        try:
            return require(self.config, key, type(self).__name__, self.protocol)
        except ProtocolError as err:
            hint = server_hint(self.config, type(self), pack_rules())
            raise ProtocolError(f"{err}{hint}") from None

    def received_params(self, name: str) -> list[torch.Tensor]:
        """Return the extra ArrayRecord ``name`` as tensors like ``anchor``.

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
        return self.from_reply_layout(self.received[name])

    def to_reply_layout(
        self, tensors: Sequence[torch.Tensor], *, buffers: str = "zeros"
    ) -> list[NDArray]:
        """Lay out one tensor per trainable parameter as a reply record is laid out.

        Reply records hold one array per ``state_dict`` entry, buffers
        included, in the dtypes the server sent; a rule's state, ``anchor``
        and ``received_params`` hold one per trainable parameter. Return a
        :meth:`finish` record through this, so it never loses the buffers.

        Parameters
        ----------
        tensors : Sequence[torch.Tensor]
            One per trainable parameter, in the rule's ``params`` order.
        buffers : str (default: "zeros")
            What the record holds at the other entries (buffers, frozen
            parameters): zeros (a difference or a control variate has none) or
            the model's current values ("model").

        Raises
        ------
        ValueError
            If ``buffers`` is another value, or ``tensors`` does not have one
            tensor of the right shape per trainable parameter.
        """
        return self.layout.to_reply(
            tensors, self.params, buffers=buffers, rule=type(self).__name__
        )

    def from_reply_layout(self, arrays: Sequence[NDArray]) -> list[torch.Tensor]:
        """Pick the trainable parameters' entries out of ``state_dict``-ordered arrays.

        The inverse of :meth:`to_reply_layout`, on the device and in the dtype
        of ``anchor``; a ProtocolError if the count of arrays is wrong.
        """
        return params_from_arrays(self.model, arrays, like=self.anchor)

    def undecayed_lr(self, lr: float) -> float:
        """Return the step size before the server's per-round decay (``base_lr``)."""
        if self.base_lr is not None:
            return float(self.base_lr)
        return lr / float(self.config.get(LR_SCALE_KEY, 1.0))

    def took_steps(self, steps: int) -> None:
        """Record ``steps`` steps the rule took itself (FedEPM's own iterations)."""
        self.wiring.own_steps += int(steps)

    def metrics(self) -> dict[str, Any]:
        """Return the metrics every reply of this rule carries.

        :attr:`applied_metric` (the steps whose update held the term,
        measured) with ``term-lost-steps`` and ``term-missing-steps``;
        ``client-key``; for a stateful rule ``state-round`` and
        ``state-outside-commit`` (state records saved with ``state.set``,
        outside the two-phase commit).
        """
        metrics: dict[str, Any] = {}
        if self.applied_metric is not None:
            counts = self.counts
            metrics[self.applied_metric] = counts.applied
            metrics[TERM_LOST_METRIC] = counts.lost
            metrics[TERM_MISSING_METRIC] = counts.missing
        metrics[CLIENT_KEY_METRIC] = self.client_key  # orders the server's sum
        if self.commit is not None:
            metrics.update(self.commit.metrics())
        return metrics


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


__all__ = [
    "LOCAL_STEPS_METRIC",
    "TERM_LOST_METRIC",
    "TERM_MISSING_METRIC",
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

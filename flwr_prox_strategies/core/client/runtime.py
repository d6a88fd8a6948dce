"""What a training loop and a ClientApp call on a rule: attach it, reply with it.

:class:`RuleRuntime` is the side of :class:`~.rule.ClientRule` that the
user's code meets: ``from_message`` reads the train message, ``attach`` (or
``add_gradient``) adds the term at every step, ``reply`` builds the answer.
Each is a call into the rule's parts (``wiring``, ``layout``, the algorithm's
``finish``), so an algorithm's author never reads them to write a rule.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Context, Message, RecordDict
from numpy.typing import NDArray
from torch import nn
from typing_extensions import Self

from ..transport.keys import LOCAL_STEPS_METRIC, NUM_EXAMPLES_KEY
from .layout import ReplyLayout, load_arrays
from .message import client_key_of, metric_record, read_message
from .state import ClientState
from .steps import StepCounts
from .wiring import TermWiring

# Methods that moved into the rule's parts: ``rule.<name>`` still works, with a
# DeprecationWarning naming the new home.
_MOVED = {
    "follow_model": ("wiring", "follow_model"),
    "check_model_unmoved": ("wiring", "check_model_unmoved"),
    "check_plain_sgd": ("wiring", "check_plain_sgd"),
    "starting_point": ("wiring", "starting_point"),
    "ensure_term": ("wiring", "ensure_term"),
    "lr_of_round": ("wiring", "lr_of_round"),
    "saved_outside_commit": ("commit", "saved_outside"),
}


class RuleRuntime:
    """The calls a training loop and a ``ClientApp`` make on a rule.

    The base of :class:`~flwr_prox_strategies.ClientRule`; every method is
    a short call into the rule's parts.
    """

    wiring: TermWiring
    layout: ReplyLayout
    state: ClientState
    _message: Message | None = None

    if TYPE_CHECKING:  # the algorithm's side, in ClientRule

        def finish(  # noqa: D102
            self, steps: int, lr: float
        ) -> tuple[dict[str, list[NDArray]], dict[str, Any]]: ...

        def metrics(self) -> dict[str, Any]: ...  # noqa: D102

    def __getattr__(self, name: str) -> Any:
        part, new = _MOVED.get(name, ("", ""))
        if self.__dict__.get(part) is None:
            raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")
        warnings.warn(
            f"ClientRule.{name} is deprecated: use rule.{part}.{new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(self.__dict__[part], new)

    # -------------------------------------------------- what a training loop calls
    @property
    def counts(self) -> StepCounts:
        """The round's steps so far, and which held the term (measured).

        Counted at every ``step()`` of a torch optimiser over the model's
        parameters; a loop without one is counted by its
        :meth:`~flwr_prox_strategies.ClientRule.add_gradient`
        calls; a rule that takes its own steps by :meth:`took_steps`.
        """
        return self.wiring.counts()

    @property
    def steps(self) -> int:
        """The local steps taken so far this round (measured)."""
        return self.counts.steps

    def attach(self, optimizer: Any, *more: Any) -> Any:
        """Add the term at every ``optimizer.step()``, once, just before the update.

        Several optimisers that each step a disjoint part of the model (a GAN's
        generator and discriminator, an encoder with its own learning rate):
        ``rule.attach(optimizer_a, optimizer_b)``; each update gets the term
        on its own part, and counts as applied when its whole part held it.

        For a step called with a closure (Lightning, LBFGS) the term is added
        after the closure's ``backward()`` and the closure's loss includes the
        term's value; otherwise in the step's pre-hook. Either way it comes
        after what the loop does between ``backward()`` and ``step()``
        (clipping, AMP's unscaling); to clip the term with the data gradient,
        call :meth:`add_gradient` before clipping. A wrapper (opacus'
        ``DPOptimizer``, accelerate, Lightning) is hooked through the
        optimiser it wraps, so under DP-SGD the term comes after the noise.

        Returns
        -------
        torch.optim.Optimizer | tuple
            The same optimiser (the optimisers, as a tuple, when several),
            hooked (:meth:`detach` and :meth:`reply` remove the hooks).

        Raises
        ------
        ValueError
            If the optimisers together do not update every trainable parameter
            of the model, or the rule assumes plain SGD (``plain_sgd``) and an
            optimiser is not ``torch.optim.SGD`` without momentum.
        """
        return self.wiring.attach(optimizer, *more)

    def add_gradient(self, lr: float | None = None) -> None:
        """Add the term's gradient to every ``p.grad``, once per step.

        Call it between ``loss.backward()`` and the update when you do not
        :meth:`attach` the rule (with a closure, inside it after
        ``backward()``); a second call before the update adds nothing. ``lr``
        is the step size about to be taken, for a loop without a torch
        optimiser.

        Raises
        ------
        RuntimeError
            If the model's parameters changed shape, or were moved or
            replaced after the first step.
        """
        self.wiring.add_gradient(lr)

    def detach(self) -> None:
        """Remove the optimiser hooks :meth:`attach` installed (:meth:`reply` does)."""
        self.wiring.detach()

    def close(self) -> None:
        """End the round's watch: remove every hook; warn if a step lacked the term."""
        self.wiring.close()

    # ---------------------------------------------------- the Message API's ends
    @classmethod
    def from_message(
        cls,
        message: Message,
        context: Context,
        model: nn.Module,
        *,
        state_dir: str | None = None,
        state_in_memory: bool = True,
        **options: Any,
    ) -> Self:
        """Read a train message: load its model into ``model``, build the rule.

        Parameters
        ----------
        message : Message
            The train message of the pack's strategy.
        context : Context
            The node's context (``context.state`` keeps the rule's state; the
            client key is the node's ``partition-id``, else its node id).
        model : torch.nn.Module
            Your model; the received arrays are loaded into it (on its device).
        state_dir : str | None (default: None)
            Mirror the rule's state to ``<state_dir>/<client key>.npz`` so a
            restarted node resumes it.
        state_in_memory : bool (default: True)
            False keeps the rule's state in ``state_dir`` only, none of it in
            ``context.state``: a simulation of thousands of nodes then holds no
            node's state in memory. The file is read when the rule is built,
            and written then (a commit, a reset: what the server's message
            changed, before your loop runs) and when the reply is built.
        **options
            The rule's own options (``relative_size``, ``base_lr``, and those
            of the subclass, e.g. FedDyn's ``decoupled``).

        Raises
        ------
        ProtocolError
            If the message's arrays do not fit ``model``, or it lacks what
            the algorithm's strategy sends (naming the strategy needed).
        ValueError
            If an option or a received value is out of range, or
            ``state_in_memory`` is False without a ``state_dir``.
        """
        if not state_in_memory and not state_dir:
            raise ValueError(
                "state_in_memory=False keeps the rule's state in files only: it "
                "needs a state_dir"
            )
        received = read_message(message)
        load_arrays(model, received.arrays)
        key = client_key_of(context)
        build: Any = cls  # the constructor is ClientRule's
        rule = build(
            model,
            received.config,
            received=received.extra,
            state=ClientState(
                context,
                state_dir=state_dir,
                client_key=str(key),
                in_memory=state_in_memory,
            ),
            client_key=key,
            **options,
        )
        if not state_in_memory:
            # Memory would keep what building the rule changed if the user's
            # loop then raised; on disk only, the file must.
            rule.state.flush()
        rule._message = message
        rule.layout = ReplyLayout(
            model,
            list(received.arrays.keys()),
            [np.dtype(array.dtype) for array in received.arrays.values()],
        )
        return rule

    def reply_records(
        self, *, steps: int | None = None, lr: float | None = None
    ) -> tuple[dict[str, list[NDArray]], dict[str, Any]]:
        """Finish the round; return the extra records and metrics :meth:`reply` sends.

        For a client that builds its own reply (as the pack's clients do).
        ``steps`` and ``lr`` are used when no torch optimiser was seen
        stepping the model; otherwise the counted steps and applied rates are
        (a disagreement is logged). The metrics are the rule's
        (:meth:`~flwr_prox_strategies.extend.ClientRule.metrics`) with ``local-steps``.
        """
        self.close()
        steps = self.wiring.steps_of_round(steps)
        extra, metrics = self.finish(steps, self.wiring.lr_of_round(lr))
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
            The model (``"arrays"``, in the dtypes the server sent), the extra
            records the strategy expects, and the metrics with
            ``num-examples`` and the rule's own. The rule's state is saved.

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
        record = metric_record({**dict(metrics or {}), **rule_metrics})
        record[NUM_EXAMPLES_KEY] = int(num_examples)
        content = RecordDict({"arrays": self.layout.model_record()})
        for name, arrays in extra.items():
            content[name] = self.layout.record(arrays)
        content["metrics"] = record
        return Message(content, reply_to=self._message)


__all__ = ["RuleRuntime"]

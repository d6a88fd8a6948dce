"""A rule's wiring into the user's loop: the term at every step, measured.

:class:`TermWiring` is the part of a :class:`~.rule.ClientRule` that meets a
training loop: it hooks an optimiser (or is called by the loop) to add the
term once per step just before the update, follows a model moved to another
device or dtype before the first step, refuses a model moved after it, and
reads the step counts and rates off the :class:`~.steps.StepWatch`. What it
reports is measured, never assumed.
"""

from __future__ import annotations

import math
from logging import INFO, WARNING
from typing import Any, ClassVar, Protocol

import torch
from flwr.common.logger import log

from ..contract.steps import shortfall_text
from .layout import rule_precision
from .steps import StepCounts, StepWatch, innermost_optimizer
from .training import FederatedPart, GradientTerm, trainable


class WiredRule(Protocol):
    """What the wiring reads of a rule (a :class:`~.rule.ClientRule` has it all)."""

    model: torch.nn.Module
    params: list[torch.Tensor]
    anchor: list[torch.Tensor]
    start: list[torch.Tensor]
    term: GradientTerm | None
    client_key: int
    protocol: ClassVar[str]
    applied_metric: ClassVar[str | None]
    plain_sgd: ClassVar[bool]
    path_estimate: ClassVar[bool]
    needs_lr: ClassVar[bool]

    def setup(self) -> GradientTerm | None: ...  # noqa: D102


def check_plain_sgd(optimizer: Any, rule: str, protocol: str) -> None:
    """Refuse an optimiser whose steps are not plain SGD steps of one size.

    Parameters
    ----------
    optimizer : Any
        A torch optimiser, or a wrapper of one.
    rule, protocol : str
        The rule and the strategy whose update assumes plain SGD (named in
        the error).

    Raises
    ------
    ValueError
        Naming the optimiser found and what the rule needs.
    """
    optimizer = innermost_optimizer(optimizer)
    if type(optimizer) is not torch.optim.SGD:
        raise ValueError(
            f"{rule} needs torch.optim.SGD without momentum ({protocol}'s "
            "control-variate update assumes plain SGD steps); got "
            f"{type(optimizer).__name__}. Build the optimiser your training "
            "stack steps as torch.optim.SGD(params, lr=..., momentum=0)"
        )
    for group in optimizer.param_groups:
        if group.get("momentum", 0.0) != 0.0 or group.get("nesterov", False):
            raise ValueError(
                f"{rule} needs momentum=0 ({protocol}'s control-variate update "
                f"assumes plain SGD steps); got momentum={group.get('momentum')}"
            )
    rates = {float(group["lr"]) for group in optimizer.param_groups}
    if len(rates) > 1:
        raise ValueError(
            f"{rule} needs one learning rate for every parameter ({protocol}'s "
            f"update divides by it); the optimiser's groups have {sorted(rates)}"
        )


class RuleTerm:
    """A rule's term as a :class:`~.training.GradientTerm` that adds it once a step.

    What the pack's own loop adds: each call goes through the rule's wiring,
    so it is counted as a user's loop calling ``add_gradient`` would be.
    """

    def __init__(self, wiring: TermWiring) -> None:
        self.wiring = wiring

    def add_(self, params: Any) -> None:
        """Add the rule's term to the gradients once this step."""
        self.wiring.add_gradient()


class TermWiring:
    """Adds one rule's term at every optimiser step and measures what happened.

    Built by the rule after its :meth:`~.rule.ClientRule.setup`; it reads and,
    when the model moves before the first step, renews the rule's ``params``,
    ``anchor``, ``start`` and ``term``.

    Parameters
    ----------
    rule : WiredRule
        The rule it wires in.

    Attributes
    ----------
    watch : StepWatch
        Counts the optimiser steps over the model and whether each held the
        term (see :mod:`.steps`).
    handles : list
        The optimiser hooks installed (removed by :meth:`detach`).
    """

    def __init__(self, rule: WiredRule) -> None:
        self.rule = rule
        self.name = type(rule).__name__
        self.handles: list[Any] = []
        self.own_steps = 0
        self.given_lrs: list[float] = []
        self._prepared = False
        self._first: torch.Tensor | None = None
        self._first_device: torch.device | None = None
        self._warned_twice = False
        self.watch = StepWatch(
            rule.model,
            rule.params,
            on_optimizer=self.learn_optimizer,
            on_params_changed=lambda: trainable(rule.model),
        )

    # ------------------------------------------------------------ the counts
    def counts(self) -> StepCounts:
        """Return the round's steps so far and which held the term."""
        if self.own_steps:
            return StepCounts(steps=self.own_steps, applied=self.own_steps)
        return self.watch.result()

    def steps_of_round(self, told: int | None) -> int:
        """Return the steps to report: counted when an optimiser was seen stepping."""
        counted = self.counts().steps
        if told is None or (self.watch.observed and int(told) == counted):
            return counted
        if self.watch.observed:
            log(
                WARNING,
                "client %d: %s was told %d steps, but the optimiser took %d; "
                "the counted steps are used",
                self.rule.client_key,
                self.name,
                int(told),
                counted,
            )
            return counted
        return int(told)

    def lr_of_round(self, lr: float | None) -> float:
        """Return the step size of this round's steps (what ``finish`` gets).

        The rates the optimiser actually applied when it was seen stepping
        (their mean: a scheduler's rates too; the rate itself when constant),
        else ``lr``, else the rates given to ``add_gradient``.
        """
        measured = self.counts().lr_mean()
        if measured is not None:
            if lr is None or math.isclose(float(lr), measured, rel_tol=1e-6):
                return measured if lr is None else float(lr)
            log(
                WARNING,
                "client %d: %s was given lr=%g, but the optimiser's steps had a "
                "mean learning rate of %g; the measured rate is used",
                self.rule.client_key,
                self.name,
                float(lr),
                measured,
            )
            return measured
        if lr is not None:
            return float(lr)
        if self.given_lrs:
            first = self.given_lrs[0]
            if all(rate == first for rate in self.given_lrs):
                return first
            return sum(self.given_lrs) / len(self.given_lrs)
        if self.counts().steps == 0 or not self.rule.needs_lr:
            return math.nan  # no step taken, or no state divides by it
        raise ValueError(
            f"{self.name}: give reply(lr=...) or attach the optimizer; "
            f"{self.rule.protocol}'s update divides by the step size"
        )

    # ------------------------------------------------------ in the user's loop
    def add_gradient(
        self, lr: float | None = None, part: list[int] | None = None
    ) -> None:
        """Add the term's gradient to every ``p.grad`` (of ``part``), once per step.

        Only the parameters whose gradient lacks it get it: with several
        optimisers over disjoint parts, a part updated since the last call
        gets it again, the others keep theirs.
        """
        self.prepare()
        todo = self.watch.without_term(part)
        if not todo:
            if part is not None:
                return
            if not self._warned_twice:
                self._warned_twice = True
                log(
                    WARNING,
                    "client %d: %s.add_gradient was called again before the "
                    "optimiser's update; the term is added once per step",
                    self.rule.client_key,
                    self.name,
                )
            return
        term = self.rule.term
        if term is not None:
            self._add_term(todo)
        every = len(todo) == len(self.rule.params) and part is None
        self.watch.term_added(None if every else todo, in_gradients=term is not None)
        if lr is not None:
            self.given_lrs.append(float(lr))

    def _add_term(self, indices: list[int]) -> None:
        """Add the term to the gradients of ``indices``, and to no other."""
        term, params = self.rule.term, self.rule.params
        assert term is not None
        if len(indices) == len(params):
            term.add_(params)
            return
        chosen = set(indices)
        kept = {i: p.grad for i, p in enumerate(params) if i not in chosen}
        for i in kept:
            params[i].grad = None
        try:
            term.add_(params)  # a term is elementwise: the others' share is dropped
        finally:
            for i, grad in kept.items():
                params[i].grad = grad

    def ensure_term(self, optimizer: Any = None) -> None:
        """Add the term where ``optimizer``'s part (every part) lacks it."""
        part = None if optimizer is None else self.watch.part_of(optimizer)
        if self.watch.without_term(part):
            self.add_gradient(part=part)

    def attach(self, optimizer: Any, *more: Any) -> Any:
        """Add the term before every update of each optimiser (through any wrapper).

        Several optimisers over disjoint parts of the model (a GAN's generator
        and discriminator, an encoder with its own rate) together must update
        every trainable parameter; each one's update gets the term on its own
        part.
        """
        given = (optimizer, *more)
        targets = [innermost_optimizer(o) for o in given]
        if self.rule.plain_sgd:
            for target in targets:
                self.check_plain_sgd(target)
        optimized = {
            id(p)
            for target in targets
            for group in target.param_groups
            for p in group["params"]
        }
        params = trainable(self.rule.model)
        missing = [i for i, p in enumerate(params) if id(p) not in optimized]
        if missing:
            what = "optimizer does" if not more else f"{len(given)} optimizers do"
            raise ValueError(
                f"{self.name}.attach: the {what} not update {len(missing)} of the "
                "model's trainable parameters; build one from model.parameters() "
                "of the model given to the rule, or attach every optimiser that "
                "steps a part of it: rule.attach(optimizer_a, optimizer_b)"
            )
        if isinstance(self.rule.model, FederatedPart):
            part = {id(p) for p in self.rule.model.parameters()}
            outside = [
                p
                for target in targets
                for group in target.param_groups
                for p in group["params"]
                if p.requires_grad and id(p) not in part
            ]
            if outside:
                raise ValueError(
                    f"{self.name}.attach: the optimizer steps {len(outside)} "
                    "trainable parameter tensors outside the federated part, which "
                    "the server would never see; freeze them (requires_grad=False) "
                    "or federate them too (federated_part(model, which=...))"
                )
        for target in targets:
            self.handles.append(target.register_step_pre_hook(self.before_update))
        return optimizer if not more else given

    def before_update(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Step pre-hook of :meth:`attach`: add the term now, or after the closure."""
        # (args[0] is the optimiser itself: torch passes step's own arguments.)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self.ensure_term(optimizer)
            return None

        def closure_with_term() -> Any:
            loss = closure()
            self.ensure_term(optimizer)
            value = getattr(self.rule.term, "value", None)
            if isinstance(loss, torch.Tensor) and callable(value):
                loss = loss + value(self.rule.params)
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_with_term}
        return (args[0], closure_with_term, *args[2:]), dict(kwargs)

    def check_plain_sgd(self, optimizer: Any) -> None:
        """Refuse an optimiser whose steps are not plain SGD steps of one size."""
        check_plain_sgd(optimizer, self.name, self.rule.protocol)

    def detach(self) -> None:
        """Remove the optimiser hooks :meth:`attach` installed."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def close(self) -> None:
        """End the round's watch: remove every hook; warn if a step lacked the term."""
        self.detach()
        if self.watch.closed:
            return
        self.watch.close()
        counts = self.counts()
        if self.rule.applied_metric is None or counts.applied >= counts.steps:
            return
        log(
            WARNING,
            "client %d: %s's term reached the update in %d of %d optimiser steps: %s",
            self.rule.client_key,
            self.name,
            counts.applied,
            counts.steps,
            shortfall_text(counts.lost, counts.missing, self.name),
        )

    # -------------------------------------------------- before the first step
    def learn_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Check an optimiser that steps the model (attached or not) before it does."""
        self.prepare()
        if self.rule.plain_sgd:
            self.check_plain_sgd(optimizer)

    def prepare(self) -> None:
        """Before the first step: follow a moved model, note where training starts."""
        model = self.rule.model
        if self._prepared:
            # A cheap look each step (the model's first parameter, the same
            # object on the same device), the whole check when it changed.
            first = next(iter(model.parameters()), None)
            if first is not self._first or (
                first is not None and first.device != self._first_device
            ):
                self.check_model_unmoved()
            return
        self.follow_model()
        if self.rule.path_estimate:
            self.rule.start = self.starting_point()
        self._first = next(iter(model.parameters()), None)
        self._first_device = None if self._first is None else self._first.device
        self._prepared = True

    def starting_point(self) -> list[torch.Tensor]:
        """Return the parameters local training starts from (read at the first step).

        They are the rule's ``anchor``, the received global model, unless the
        user changed some after ``from_message`` (a personal layer restored
        from ``context.state``, as Flower's advanced-pytorch example does).
        The anchor stays the global model every term pulls towards (FedProx's
        and FedDyn's penalties, FedDyn's and FedDC's drift); the rules that
        estimate the round's mean gradient from the local path (SCAFFOLD's
        option II, FedDC's correction) divide the path from this point, so a
        restored layer's jump is not counted as gradient.
        """
        rule = self.rule
        changed = [
            i
            for i, (p, a) in enumerate(zip(rule.params, rule.anchor, strict=True))
            if not torch.equal(p.detach(), a.to(p.dtype))
        ]
        if not changed:
            return rule.anchor
        log(
            INFO,
            "client %d: %d of the model's %d trainable tensors differ from the "
            "received model at the first step (changed after from_message); "
            "%s measures this round's gradient estimate from there",
            rule.client_key,
            len(changed),
            len(rule.params),
            self.name,
        )
        return [rule_precision(p) for p in rule.params]

    def follow_model(self) -> None:
        """Follow a model moved to another device or dtype since the rule was built.

        Frameworks move the model after ``from_message`` (Lightning does it
        inside ``fit()``, converting it for ``precision="bf16-true"`` too).
        Before the first step the rule follows: it moves its anchor (keeping
        its precision) and builds its term again (``setup``) on the
        parameters' device. A dtype change alone needs nothing: the term is
        computed in the rule's precision and added to the gradients in theirs.

        Raises
        ------
        RuntimeError
            If the parameters no longer match the received model's shapes.
        """
        rule = self.rule
        current = trainable(rule.model)
        same = len(current) == len(rule.params) and all(
            p is q for p, q in zip(current, rule.params, strict=True)
        )
        moved = any(
            p.device != a.device for p, a in zip(current, rule.anchor, strict=False)
        )
        if same and not moved:
            return
        if len(current) != len(rule.anchor) or any(
            p.shape != a.shape for p, a in zip(current, rule.anchor, strict=True)
        ):
            raise RuntimeError(
                f"{self.name}: the model's trainable parameters no longer match "
                "the received model's shapes; build the rule on the model you train"
            )
        device = current[0].device if current else torch.device("cpu")
        rule.params = current
        rule.anchor = [
            a.to(p.device) for a, p in zip(rule.anchor, current, strict=True)
        ]
        rule.start = rule.anchor
        rule.term = rule.setup()
        self.watch.follow(current)
        log(
            INFO,
            "client %d: the model moved (device %s, dtype %s) after the rule "
            "was built; %s follows it",
            rule.client_key,
            device,
            current[0].dtype if current else "-",
            self.name,
        )

    def check_model_unmoved(self) -> None:
        """Fail if the parameters were moved or replaced after the first step."""
        rule = self.rule
        current = trainable(rule.model)
        moved = len(current) != len(rule.params) or any(
            p is not q or p.device != a.device
            for p, q, a in zip(current, rule.params, rule.anchor, strict=False)
        )
        if moved:
            raise RuntimeError(
                f"{self.name}: the model's parameters were moved or replaced "
                "after local training started; move the model before its first step"
            )


__all__ = ["RuleTerm", "TermWiring", "WiredRule", "check_plain_sgd"]

r"""Which optimiser updates held the rule's term: measured at every step.

What the counts mean: ``docs/howto/own-client.md``. :class:`StepWatch` sees every
``step()`` through torch's global optimiser step hooks (a wrapping optimiser is
counted once, through the one that updates), notes the gradient tensors the term
went into and follows them through later backward passes (which accumulate onto
the term and keep it) by hooks on each parameter; gradients cleared, zeroed or
replaced before the update lose it. A
loop without a torch optimiser is counted by its calls to
:meth:`ClientRule.add_gradient
<flwr_prox_strategies.extend.ClientRule.add_gradient>`.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

# Attributes under which optimiser wrappers keep the optimiser they wrap:
# opacus' DPOptimizer, accelerate's AcceleratedOptimizer, Lightning's
# LightningOptimizer.
WRAPPED_OPTIMIZER_ATTRIBUTES = ("original_optimizer", "optimizer", "_optimizer")


def innermost_optimizer(optimizer: Any) -> Any:
    """Return the optimiser that updates the parameters, unwrapping wrappers.

    opacus' ``DPOptimizer`` (``original_optimizer``), accelerate's
    ``AcceleratedOptimizer`` (``optimizer``) and Lightning's
    ``LightningOptimizer`` (``_optimizer``) step the optimiser they wrap.
    """
    seen = {id(optimizer)}
    while True:
        for attribute in WRAPPED_OPTIMIZER_ATTRIBUTES:
            inner = getattr(optimizer, attribute, None)
            steps = isinstance(inner, torch.optim.Optimizer) or (
                hasattr(inner, "param_groups")
                and callable(getattr(inner, "step", None))
            )
            if steps and id(inner) not in seen:
                seen.add(id(inner))
                optimizer = inner
                break
        else:
            return optimizer


def optimizer_parameters(optimizer: Any) -> list[torch.Tensor]:
    """Return every parameter an optimiser's groups hold."""
    return [p for group in optimizer.param_groups for p in group["params"]]


@dataclass
class StepCounts:
    """What a rule's steps did over one round (:attr:`ClientRule.counts`).

    Parameters
    ----------
    steps : int (default: 0)
        Optimiser steps that updated the model's parameters.
    applied : int (default: 0)
        Those whose update held the term (the reply's ``<algorithm>-applied``).
    lost : int (default: 0)
        Those for which the term was added, then lost before the update (the
        gradients cleared, zeroed or replaced after it: a closure's
        ``zero_grad()``; a backward pass accumulates onto it and keeps it).
    missing : int (default: 0)
        Those with no term added since the previous step.
    lr_sum : float (default: 0.0)
        The sum of the steps' learning rates, read from the optimiser.
    first_lr : float | None (default: None)
        The first step's learning rate (None: no optimiser step seen).
    lr_varied : bool (default: False)
        Whether the learning rate changed between steps (a scheduler).
    """

    steps: int = 0
    applied: int = 0
    lost: int = 0
    missing: int = 0
    lr_sum: float = 0.0
    first_lr: float | None = None
    lr_varied: bool = False

    def add_lr(self, lr: float) -> None:
        """Count one step's learning rate."""
        if self.first_lr is None:
            self.first_lr = lr
        elif lr != self.first_lr:
            self.lr_varied = True
        self.lr_sum += lr

    def lr_mean(self) -> float | None:
        """Return the steps' mean learning rate (exactly the rate when constant)."""
        if self.first_lr is None or self.steps == 0:
            return None
        return self.lr_sum / self.steps if self.lr_varied else self.first_lr


# One live watch per model: building a new rule for a model retires the last
# one (a round that raised before its reply leaves no watch counting the next
# round's steps). Keyed weakly by the model, holding the watch weakly.
_LIVE: weakref.WeakKeyDictionary[Any, weakref.ReferenceType[StepWatch]] = (
    weakref.WeakKeyDictionary()
)
_LIVE_LOCK = threading.Lock()
# Every watch's global step hooks, with the watch held weakly. A watch that was
# never closed (its round raised) is freed with its rule; its hooks then do
# nothing, and the next watch removes them (not from inside a step, where
# torch iterates over its hooks).
_HOOKED: list[tuple[weakref.ReferenceType[StepWatch], list[RemovableHandle]]] = []


def _weakly(callback: Callable[..., Any]) -> Callable[[], Callable[..., Any] | None]:
    """Hold a bound method weakly (a watch must not keep its rule alive)."""
    if inspect.ismethod(callback):
        return weakref.WeakMethod(callback)
    return lambda: callback


class StepWatch:
    """Count a model's optimiser steps and whether each update held the term.

    Parameters
    ----------
    model : torch.nn.Module
        The model whose trainable parameters are watched (re-read when the
        model's parameters are replaced).
    params : Sequence[torch.Tensor]
        Its trainable parameters now.
    on_optimizer : Callable[[torch.optim.Optimizer], None]
        Called with each new optimiser (the one that updates) the first time
        it steps the parameters, before its update; it may raise to refuse
        it (SCAFFOLD's plain-SGD requirement).
    on_params_changed : Callable[[], list[torch.Tensor]]
        Called when an optimiser steps parameters the watch does not know
        (the model's parameters were replaced); returns the new ones.
    """

    def __init__(
        self,
        model: Any,
        params: Sequence[torch.Tensor],
        *,
        on_optimizer: Callable[[Any], None],
        on_params_changed: Callable[[], list[torch.Tensor]],
    ) -> None:
        self.counts = StepCounts()
        self.optimizers: list[weakref.ReferenceType[Any]] = []
        self._on_optimizer = _weakly(on_optimizer)
        self._on_params_changed = _weakly(on_params_changed)
        self._params: list[torch.Tensor] = []
        self._ids: set[int] = set()
        self._known: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        # Per parameter, since its last update: whether the term was added
        # (False: not), whether it went into no gradient (APFL's personal
        # step), the gradient that holds it, its version, whether it was
        # non-zero, and whether it still holds the term: a backward pass
        # accumulates onto it (followed), clearing or replacing loses it.
        # Several optimisers over disjoint parts each reset their own part.
        self._added: list[bool] = []
        self._free: list[bool] = []
        self._term_grads: list[torch.Tensor | None] = []
        self._term_versions: list[int | None] = []
        self._term_nonzero: list[bool] = []
        self._term_kept: list[bool] = []
        self._parts: weakref.WeakKeyDictionary[Any, list[int]] = (
            weakref.WeakKeyDictionary()
        )
        self._step_lr: float | None = None
        # A loop without a torch optimiser: its add_gradient calls, and the
        # parameters at the last one (their versions and a checksum: an update
        # through ``p.data`` leaves the version as it was).
        self.manual_adds = 0
        self.manual_applied = 0
        self._versions_at_add: list[tuple[int, float]] | None = None
        self._param_handles: list[RemovableHandle] = []
        self._closed = False
        self._watch_params(params)
        this = weakref.ref(self)

        def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
            watch = this()
            if watch is not None:
                watch._before_step(optimizer)

        def post(optimizer: Any, args: Any, kwargs: Any) -> None:
            watch = this()
            if watch is not None:
                watch._after_step(optimizer)

        self._step_handles = [
            register_optimizer_step_pre_hook(pre),
            register_optimizer_step_post_hook(post),
        ]
        with _LIVE_LOCK:
            for watch, handles in _HOOKED:
                if watch() is None:
                    for handle in handles:
                        handle.remove()
            _HOOKED[:] = [(w, h) for w, h in _HOOKED if w() is not None]
            _HOOKED.append((this, self._step_handles))
            previous = _LIVE.get(model)
            _LIVE[model] = this
        if previous is not None and (old := previous()) is not None:
            old.close()

    # ------------------------------------------------------------ the term
    def term_added(
        self, indices: Sequence[int] | None = None, *, in_gradients: bool = True
    ) -> None:
        """Note that the term was just added to the gradients of ``indices`` (all).

        ``in_gradients=False``: the rule acted this step without touching the
        gradients (APFL's personal step): nothing there can be lost.
        """
        every = indices is None
        for i in range(len(self._params)) if indices is None else indices:
            grad = self._params[i].grad
            self._added[i] = True
            self._free[i] = not in_gradients
            self._term_grads[i] = grad
            self._term_versions[i] = _version(grad)
            self._term_nonzero[i] = grad is not None and bool(grad.any())
            self._term_kept[i] = True
        if every and not self.observed:
            if self._versions_at_add is not None and self._params_moved():
                self.manual_applied += 1
            self.manual_adds += 1
            self._versions_at_add = [_fingerprint(p) for p in self._params]

    def term_intact(self, indices: Sequence[int] | None = None) -> bool:
        """Return whether the term added since the last update is in the gradients.

        ``indices``: of those parameters only (all by default).
        """
        return not self.without_term(indices)

    def without_term(self, indices: Sequence[int] | None = None) -> list[int]:
        """Return the parameters (of ``indices``, all) whose gradient lacks the term."""
        chosen = range(len(self._params)) if indices is None else indices
        return [i for i in chosen if not self._intact(i)]

    def part_of(self, optimizer: Any) -> list[int]:
        """Return the indices of the watched parameters ``optimizer`` updates."""
        part = self._parts.get(optimizer)
        if part is None:
            ids = {id(p) for p in optimizer_parameters(innermost_optimizer(optimizer))}
            part = [i for i, p in enumerate(self._params) if id(p) in ids]
            self._parts[optimizer] = part
        return part

    def _intact(self, index: int) -> bool:
        if not self._added[index]:
            return False
        return self._free[index] or (self._term_kept[index] and self._holds(index))

    def _holds(self, index: int) -> bool:
        """Whether parameter ``index``'s gradient is the term's, unchanged."""
        grad = self._params[index].grad
        if grad is not self._term_grads[index]:
            return False  # cleared (None) or replaced
        if grad is None or _version(grad) == self._term_versions[index]:
            return True
        # Changed in place: clipping, unscaling or weight decay keep the term
        # (scaled); zeroing it (zero_grad(set_to_none=False)) loses it.
        return not self._term_nonzero[index] or bool(grad.any())

    @property
    def observed(self) -> bool:
        """Whether a torch optimiser has stepped the parameters this round."""
        return self.counts.steps > 0 or bool(self.optimizers)

    def result(self) -> StepCounts:
        """Return the round's counts (a loop without an optimiser: its additions)."""
        if self.observed:
            return self.counts
        applied = self.manual_applied
        if self._versions_at_add is not None and self._params_moved():
            applied += 1
        return StepCounts(
            steps=self.manual_adds,
            applied=applied,
            missing=self.manual_adds - applied,
        )

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def follow(self, params: Sequence[torch.Tensor]) -> None:
        """Watch ``params`` instead (the model's parameters were replaced)."""
        self._watch_params(params)
        self._known = weakref.WeakKeyDictionary()

    def close(self) -> None:
        """Stop watching: remove every hook (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for handle in (*self._step_handles, *self._param_handles):
            handle.remove()
        self._param_handles = []

    # ----------------------------------------------------------- internals
    def _watch_params(self, params: Sequence[torch.Tensor]) -> None:
        for handle in self._param_handles:
            handle.remove()
        self._params = list(params)
        self._ids = {id(p) for p in self._params}
        count = len(self._params)
        self._added, self._free = [False] * count, [False] * count
        self._term_grads = [None] * count
        self._term_versions = [None] * count
        self._term_nonzero, self._term_kept = [False] * count, [False] * count
        self._parts = weakref.WeakKeyDictionary()
        this = weakref.ref(self)

        def following(index: int) -> Callable[[bool], Callable[..., None]]:
            def hook(after: bool) -> Callable[..., None]:
                def run(*_: Any) -> None:
                    watch = this()
                    if watch is not None:
                        watch._backward(index, after)

                return run

            return hook

        self._param_handles = []
        for index, p in enumerate(self._params):
            hook = following(index)
            self._param_handles.append(p.register_hook(hook(False)))
            self._param_handles.append(p.register_post_accumulate_grad_hook(hook(True)))

    def _backward(self, index: int, after: bool) -> None:
        """Follow a backward pass into parameter ``index``'s gradient.

        Before it accumulates: does the gradient still hold the term? After:
        the new gradient holds it too (accumulation adds onto it, in place or
        into a new tensor).
        """
        if not self._added[index] or self._free[index]:
            return
        if not after:
            self._term_kept[index] = self._term_kept[index] and self._holds(index)
        elif self._term_kept[index]:
            grad = self._params[index].grad
            self._term_grads[index] = grad
            self._term_versions[index] = _version(grad)

    def _params_moved(self) -> bool:
        assert self._versions_at_add is not None
        return any(
            _fingerprint(p) != seen
            for p, seen in zip(self._params, self._versions_at_add, strict=True)
        )

    def _updates_model(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` itself updates the watched parameters."""
        known = self._known.get(optimizer)
        if known is not None:
            return known
        if innermost_optimizer(optimizer) is not optimizer:
            self._known[optimizer] = False  # a wrapper: the one it wraps counts
            return False
        ids = {id(p) for p in optimizer_parameters(optimizer)}
        if not ids & self._ids and (reread := self._on_params_changed()) is not None:
            current = reread()
            if ids & {id(p) for p in current}:
                self._watch_params(current)
        updates = bool(ids & self._ids)
        self._known[optimizer] = updates
        return updates

    def _before_step(self, optimizer: Any) -> None:
        if self._closed or not self._updates_model(optimizer):
            return
        if not any(ref() is optimizer for ref in self.optimizers):
            if (learn := self._on_optimizer()) is not None:
                learn(optimizer)
            self.optimizers.append(weakref.ref(optimizer))
        self._step_lr = float(optimizer.param_groups[0]["lr"])

    def _after_step(self, optimizer: Any) -> None:
        if self._closed or not self._updates_model(optimizer):
            return
        counts = self.counts
        counts.steps += 1
        part = self.part_of(optimizer)
        if not all(self._added[i] for i in part):
            counts.missing += 1
        elif self.term_intact(part):
            counts.applied += 1
        else:
            counts.lost += 1
        if self._step_lr is not None:
            counts.add_lr(self._step_lr)
        for i in part:  # this part was updated: its next step needs the term again
            self._added[i] = False
            self._term_grads[i] = None
        self._step_lr = None


def _version(grad: torch.Tensor | None) -> int | None:
    """Return a gradient's version counter (in-place changes bump it)."""
    return None if grad is None else grad._version


def _fingerprint(param: torch.Tensor) -> tuple[int, float]:
    """Return a parameter's version and checksum (an update changes either)."""
    return param._version, float(param.detach().double().sum())


__all__ = ["StepCounts", "StepWatch", "innermost_optimizer"]

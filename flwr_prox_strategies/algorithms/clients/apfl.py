r"""APFL's client side: its rule, its client and the wire keys both sides read.

The strategy, the paper and the pointer to the pack's APFL page are in
``algorithms/apfl.py``, which re-exports the names of this module.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from numpy.typing import NDArray
from torch import nn

from ...core.client.client import TorchClient
from ...core.client.rule import ClientRule, ProtocolError, arrays_from_params
from ...core.client.state import ClientState
from ...core.client.training import (
    FederatedPart,
    LossFn,
    TrainReport,
    cycle_batches,
    trainable,
)
from ...core.docstrings import inherit_parameters
from ...core.transport.keys import LOCAL_STEPS_KEY
from ...ops import apfl as maths
from ...ops.apfl import averaging_weight_sum
from ..apfl import (
    ALPHA_STATE,
    APFL_ADAPTIVE_KEY,
    APFL_ALPHA_KEY,
    APFL_APPLIED_KEY,
    APFL_AVERAGE_A_KEY,
    APFL_FIRST_STEP_KEY,
    APFL_GRADIENT_KEY,
    APFL_LR_A_KEY,
    APFL_LR_MU_KEY,
    APFL_MIXING_KEY,
    APFL_STEP_KEY,
    AVERAGE_MODEL_RECORD,
    LAST_STEP_STATE,
    MIXINGS,
    PERSONAL_GRADIENTS,
    PERSONAL_STATE,
    PERSONAL_SUM_STATE,
    WEIGHTED_THETA_RECORD,
)


def current_alpha(config: Mapping[str, Any], state: ClientState, require: Any) -> float:
    """Return this client's mixture weight: learned (adaptive) or the server's."""
    alpha = float(require(APFL_ALPHA_KEY))
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"received apfl-alpha={alpha!r}; it must be in [0, 1]")
    learned = state.scalar(ALPHA_STATE, math.nan)
    return alpha if math.isnan(learned) else learned


def personal_params(
    state: ClientState, params: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Return omega_k (the received global model before the first fit)."""
    if state.get(PERSONAL_STATE) is None:
        return [p.detach().clone() for p in params]
    return state.get_tensors(PERSONAL_STATE, params)


def caught_up_personal_sum(
    state: ClientState, omega: list[torch.Tensor], up_to: int, a: float
) -> list[torch.Tensor]:
    r"""Return :math:`\sum_{t\le up\_to} p_t\omega_k^t` (idle steps included)."""
    saved = state.get(PERSONAL_SUM_STATE)
    last = int(state.scalar(LAST_STEP_STATE, 0.0)) if saved is not None else 0
    return maths.personal_sum(saved, last, omega, up_to, a)


class APFLRule(ClientRule):
    r"""APFL's client rule: the personal model :math:`\omega_k` beside your loop.

    Your model and optimiser train the global copy :math:`\theta_k` as usual;
    the rule keeps :math:`\omega_k` and :math:`\alpha_k` in the client's state
    and, at each step, takes :math:`\omega_k`'s step along the gradient at the
    mixture (call :meth:`personal_step` after ``backward()`` and before
    ``step()``), sets the server's step-size schedule on your optimiser, learns
    :math:`\alpha_k` when adaptive and keeps the weighted averages the final
    models need. The loop, exactly ``rule.local_steps`` steps: the APFL page.

    Parameters
    ----------
    learning_rate : float | None (default: None)
        :math:`\omega_k`'s step size when the server sends no schedule; None
        takes the attached optimiser's.
    momentum, weight_decay : float (default: 0.0)
        :math:`\omega_k`'s SGD settings (the pack's client uses its own).
    max_grad_norm : float | None (default: None)
        Clip :math:`\omega_k`'s gradient to this norm.
    *args, **kwargs
        As :class:`ClientRule` (``model``, ``config``, ``received``, ``state``,
        ``client_key``, ``relative_size``, ``base_lr``); build the rule with
        :meth:`ClientRule.from_message`, which passes them.

    Raises
    ------
    ProtocolError
        If the train config lacks APFL's keys (the server is not running
        APFL) or names unknown settings.
    ValueError
        If ``relative_size`` is not > 0, or (in :meth:`ClientRule.reply`) the
        round did not take exactly the ``local-steps`` the server asked for.
    """

    protocol = "APFL"
    applied_metric = APFL_APPLIED_KEY
    # omega_k is the client's own: it advances with the client's training
    # whether or not the server aggregates the reply (nothing on the server
    # depends on it), so it is saved at once, not two-phase.
    personal_state = (
        PERSONAL_STATE,
        PERSONAL_SUM_STATE,
        f"scalar:{ALPHA_STATE}",
        f"scalar:{LAST_STEP_STATE}",
    )

    def __init__(
        self,
        *args: Any,
        learning_rate: float | None = None,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = None,
        **kwargs: Any,
    ) -> None:
        self.learning_rate = learning_rate
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.max_grad_norm = max_grad_norm
        super().__init__(*args, **kwargs)

    def setup(self) -> None:
        """Read the round's settings; restore omega_k, alpha_k and the sums."""
        self.local_steps = int(self.required(LOCAL_STEPS_KEY))
        self.first = int(self.required(APFL_FIRST_STEP_KEY))
        self.mixing = str(self.required(APFL_MIXING_KEY))
        self.gradient_form = str(self.required(APFL_GRADIENT_KEY))
        if self.mixing not in MIXINGS or self.gradient_form not in PERSONAL_GRADIENTS:
            raise ProtocolError(
                f"unknown APFL settings mixing={self.mixing!r}, "
                f"personal-gradient={self.gradient_form!r}"
            )
        self.adaptive = bool(self.config.get(APFL_ADAPTIVE_KEY, False))
        self.alpha = current_alpha(self.config, self.state, self.required)
        self.average_a = (
            float(self.config[APFL_AVERAGE_A_KEY])
            if APFL_AVERAGE_A_KEY in self.config
            else None
        )
        self.lr_mu = self.config.get(APFL_LR_MU_KEY)
        self.lr_a = self.config.get(APFL_LR_A_KEY)
        self.personal = module_with(
            self.model, personal_params(self.state, self.params)
        )
        self.personal.train()
        self.omega = trainable(self.personal)
        self.names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.omega_optimizer: torch.optim.Optimizer | None = None
        self.theta_sum: list[torch.Tensor] | None = None
        self.omega_sum: list[torch.Tensor] | None = None
        if self.average_a is not None:
            self.omega_sum = caught_up_personal_sum(
                self.state, self.omega, self.first, self.average_a
            )
            self.theta_sum = [
                torch.zeros_like(p, dtype=torch.float64) for p in self.params
            ]
        self.alpha_grad = 0.0
        self.personal_loss_sum = 0.0
        self.seen = 0
        self.done = 0  # steps completed this round (t = first + done)
        return None

    def step_size(self, base: float) -> float:
        """Return step :math:`t`'s size: the server's schedule, else ``base``."""
        if self.lr_mu is None:
            return base
        t = self.first + self.done
        return maths.decay_rate(t, float(self.lr_mu), float(self.lr_a or 0.0))

    def personal_step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: LossFn,
        *,
        theta_outputs: torch.Tensor | None = None,
        untracked: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> None:
        r"""Compute omega_k's gradient at the mixture (and alpha's), at step t.

        Call it after ``loss.backward()`` and before ``optimizer.step()``, on
        the same batch; the attached optimiser's step then also steps
        :math:`\omega_k`.

        Parameters
        ----------
        inputs, targets : torch.Tensor
            The step's batch.
        loss_fn : callable
            ``loss_fn(outputs, targets)``, the mean loss of a batch.
        theta_outputs : torch.Tensor | None (default: None)
            Your model's outputs on ``inputs``: saves a forward pass with
            ``mixing="outputs"``.
        untracked : callable (default: contextlib.nullcontext)
            A context in which the model's forward computes no per-sample
            gradients (DP-SGD).
        """
        if self.omega_optimizer is None:
            self.omega_optimizer = torch.optim.SGD(
                self.omega,
                lr=self.learning_rate or 0.0,
                momentum=self.momentum,
                weight_decay=self.weight_decay,
            )
        alpha = self.alpha
        if len(targets) == 0:  # an empty Poisson batch (DP-SGD): theta takes its
            # noise-only step; omega sees a zero gradient.
            personal_loss = torch.zeros(())
            self.alpha_grad = 0.0
            for w in self.omega:
                w.grad = torch.zeros_like(w)
        elif self.mixing == "parameters":
            point = maths.mixture(
                alpha,
                [w.detach() for w in self.omega],
                [p.detach() for p in self.params],
            )
            # A federated part runs its whole model, under the same names.
            whole = (
                self.model.source
                if isinstance(self.model, FederatedPart)
                else self.model
            )
            personal_loss, mixture_grad = maths.gradient_at_mixture(
                whole, self.names, point, inputs, targets, loss_fn, untracked
            )
            grads = maths.personal_gradient(mixture_grad, alpha, self.gradient_form)
            for w, g in zip(self.omega, grads, strict=True):
                w.grad = g
            self.alpha_grad = maths.alpha_gradient(
                self.omega, self.params, mixture_grad
            )
        else:
            if theta_outputs is None:
                with torch.no_grad(), untracked():
                    theta_outputs = self.model(inputs)
            weight = torch.tensor(alpha, dtype=torch.float64, requires_grad=True)
            out = maths.mix(weight, self.personal(inputs), theta_outputs.detach())
            personal_loss = loss_fn(out, targets)
            self.omega_optimizer.zero_grad(set_to_none=True)
            personal_loss.backward()
            assert weight.grad is not None
            self.alpha_grad = float(weight.grad)
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.omega, max_norm=self.max_grad_norm)
        if len(targets):
            self.seen += len(targets)
            self.personal_loss_sum += float(personal_loss.detach()) * len(targets)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Set step t's size on both models and take omega_k's step."""
        base = self.learning_rate
        if base is None:
            base = float(optimizer.param_groups[0]["lr"])
            self.learning_rate = base
        lr = self.step_size(base)
        if self.omega_optimizer is None:
            raise RuntimeError(
                "APFLRule: call rule.personal_step(inputs, targets, loss_fn) after "
                "backward() and before optimizer.step()"
            )
        for opt in (optimizer, self.omega_optimizer):
            for group in opt.param_groups:
                group["lr"] = lr
        self.omega_optimizer.step()
        self._lr = lr
        self.add_gradient(lr)  # APFL adds no term to theta: the step is marked

    def after_step(self) -> None:
        """Learn alpha_k (adaptive); add step t's models to the weighted sums."""
        t = self.first + self.done
        if self.adaptive:
            self.alpha = maths.alpha_update(self.alpha, self._lr, self.alpha_grad)
        if self.theta_sum is not None and self.omega_sum is not None:
            assert self.average_a is not None
            weight_t = maths.averaging_weight(t + 1, self.average_a)
            for acc, p in zip(self.theta_sum, self.params, strict=True):
                acc.add_(p.detach().double(), alpha=weight_t)
            for acc, p in zip(self.omega_sum, self.omega, strict=True):
                acc.add_(p.detach().double(), alpha=weight_t)
        self.done += 1

    def attach(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Step omega_k with every ``optimizer.step()`` and schedule both sizes."""
        super().attach(optimizer)
        self.detach()  # the base's pre-hook would count steps before they end

        self.wiring.handles += [
            optimizer.register_step_pre_hook(lambda o, a, k: self.before_step(o)),
            optimizer.register_step_post_hook(lambda o, a, k: self.after_step()),
        ]
        return optimizer

    def finish(
        self, steps: int, lr: float
    ) -> tuple[dict[str, list[NDArray]], dict[str, Any]]:
        """Keep omega_k and alpha_k; upload the weighted average when asked."""
        if steps != self.local_steps:
            raise ValueError(
                f"APFL runs exactly local-steps={self.local_steps} steps per round "
                f"(one synchronisation period); this round took {steps}"
            )
        if not math.isfinite(self.alpha):
            raise ValueError("the adaptive mixture weight became non-finite")
        self.state.set(PERSONAL_STATE, [w.detach() for w in self.omega])
        self.state.set_scalar(ALPHA_STATE, self.alpha)
        extra: dict[str, list[NDArray]] = {}
        if self.theta_sum is not None and self.omega_sum is not None:
            assert self.average_a is not None
            round_weight = averaging_weight_sum(
                self.first + 1, self.first + steps, self.average_a
            )
            weighted = maths.normalised(self.theta_sum, round_weight, self.params)
            extra[WEIGHTED_THETA_RECORD] = arrays_from_params(self.model, weighted)
            self.state.set(PERSONAL_SUM_STATE, self.omega_sum)
            self.state.set_scalar(LAST_STEP_STATE, float(self.first + steps))
        seen = self.seen
        return extra, {
            "apfl-alpha": self.alpha,
            "personal-train-loss": self.personal_loss_sum / seen if seen else math.nan,
        }


@inherit_parameters(TorchClient)
class APFLClient(TorchClient):
    r"""APFL client: :class:`APFLRule` beside the pack's own training loop.

    Trains the global copy :math:`\theta_k` and the personal model
    :math:`\omega_k` on the same batches, exactly ``sync_gap`` steps a round.
    Its parameters are :class:`FedAvgClient`'s; the learning rate is used for
    both models (with ``lr_schedule="decay"`` the server's schedule replaces
    it). With ``dp``, :math:`\theta_k` (everything the client uploads) trains
    by DP-SGD; the local :math:`\omega_k` does not.
    """

    protocol = "APFL"
    rule_class = APFLRule

    def rule_options(self, config: dict[str, Any]) -> dict[str, Any]:
        """Give the personal model the client's SGD settings."""
        return {
            "learning_rate": self.round_lr,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "max_grad_norm": self.max_grad_norm,
        }

    # ----------------------------------------------------------------- train
    def local_solve(
        self, config: dict[str, Any], *, epochs: int, steps: int | None
    ) -> TrainReport:
        """Run the round's tau steps on theta_k and omega_k."""
        rule = self.make_rule(config)
        assert isinstance(rule, APFLRule)
        self.model.train()
        loss_sum = 0.0
        seen = 0
        with self.training_run(self.make_optimizer(), None) as run:
            for inputs, targets in cycle_batches(run.loader, rule.local_steps):
                inputs, targets = inputs.to(self.device), targets.to(self.device)
                run.optimizer.zero_grad(set_to_none=True)
                out_theta = run.model(inputs)
                loss = self.loss_fn(out_theta, targets)
                loss.backward()
                rule.personal_step(
                    inputs,
                    targets,
                    self.loss_fn,
                    theta_outputs=out_theta,
                    untracked=run.untracked,
                )
                if run.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(
                        rule.params, max_norm=run.max_grad_norm
                    )
                rule.before_step(run.optimizer)
                run.optimizer.step()
                rule.after_step()
                if len(targets):
                    seen += len(targets)
                    loss_sum += float(loss.detach()) * len(targets)
        return TrainReport(
            epochs=1,
            steps=rule.steps,
            examples_seen=seen,
            mean_loss=loss_sum / seen if seen else math.nan,
        )

    # ---------------------------------------------------------------- state
    def _alpha(self, config: dict[str, Any]) -> float:
        return current_alpha(config, self.state, lambda key: self.required(config, key))

    def _personal_params(self) -> list[torch.Tensor]:
        return personal_params(self.state, trainable(self.model))

    # -------------------------------------------------------------- evaluate
    def personal_models(self, config: dict[str, Any]) -> dict[str, nn.Module]:
        r"""Return the personalised model; with averaging, the weighted final models."""
        alpha = self._alpha(config)
        mixing = str(self.required(config, APFL_MIXING_KEY))
        omega = self._personal_params()
        models = {
            "personal": mixed_model(
                module_with(self.model, omega), self.model, alpha, mixing
            )
        }
        average = self.received_arrays.get(AVERAGE_MODEL_RECORD)
        if average is None or APFL_AVERAGE_A_KEY not in config:
            return models
        a = float(config[APFL_AVERAGE_A_KEY])
        total_steps = int(self.required(config, APFL_STEP_KEY))
        personal_sum = caught_up_personal_sum(self.state, omega, total_steps, a)
        normaliser = averaging_weight_sum(1, total_steps, a)
        personal_average = module_with(
            self.model, maths.normalised(personal_sum, normaliser, omega)
        )
        global_average = module_with(self.model, self.from_state_order(average))
        models["personal-avg"] = mixed_model(
            personal_average, global_average, alpha, mixing
        )
        models["global-avg"] = global_average
        return models


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def module_with(model: nn.Module, params: Sequence[torch.Tensor]) -> nn.Module:
    """Return a copy of ``model`` whose trainable parameters are ``params``."""
    module = copy.deepcopy(model)
    with torch.no_grad():
        for p, value in zip(_trainable(module), params, strict=True):
            p.copy_(value)
    return module


class OutputMixture(nn.Module):
    r"""Predict :math:`\alpha f(x;\omega) + (1-\alpha) f(x;\theta)` (FedTorch)."""

    def __init__(self, personal: nn.Module, shared: nn.Module, alpha: float) -> None:
        super().__init__()
        self.personal = personal
        self.shared = shared
        self.alpha = alpha

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Mix the two models' outputs."""
        return maths.mix(self.alpha, self.personal(inputs), self.shared(inputs))


def mixed_model(
    personal: nn.Module, shared: nn.Module, alpha: float, mixing: str
) -> nn.Module:
    r"""Return the personalised model: the parameters' mixture, or the outputs'.

    ``mixing="parameters"``: a copy of ``shared`` at :math:`\bar\omega`;
    ``"outputs"``: :class:`OutputMixture` of the two models.
    """
    if mixing == "outputs":
        return OutputMixture(personal, shared, alpha)
    point = maths.mixture(alpha, _trainable(personal), _trainable(shared))
    return module_with(shared, point)

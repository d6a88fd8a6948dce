r"""APFL: adaptive personalised federated learning (Deng et al., 2020).

Y. Deng, M. M. Kamani and M. Mahdavi, "Adaptive Personalized Federated
Learning", 2020 (arXiv:2003.13461), Algorithm 1; official code:
github.com/MLOPTPSU/FedTorch.

Each client :math:`k` keeps a local copy :math:`\theta_k` of the global model, a
personal model :math:`\omega_k` and a mixture weight :math:`\alpha_k`; both
models take each local step from their values at :math:`t` (the maths:
``flwr_prox_strategies.ops.apfl``). One Flower round is one synchronisation
period of :math:`\tau` steps (``sync_gap``), then the server averages the
:math:`\theta_k`. The update as implemented, the weighted final models, the
state, the wire keys and the deviations from the paper and FedTorch: the pack's
APFL page (``docs/algorithms/apfl.md``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from flwr.app import ArrayRecord
from numpy.typing import NDArray
from torch import nn

from ..core.client.client import TorchClient
from ..core.client.rule import ClientRule, ProtocolError, arrays_from_params
from ..core.client.state import ClientState
from ..core.client.training import LossFn, TrainReport, cycle_batches, trainable
from ..core.contract.fields import RoundUpdate
from ..core.contract.validation import ValidReply
from ..core.docstrings import inherit_parameters
from ..core.server.strategy import ValidatedFedAvg
from ..core.transport.keys import LOCAL_STEPS_KEY
from ..core.transport.records import RecordSpec, dict_to_record, record_to_dict
from ..ops.aggregate import divided_like
from ..ops.apfl import OutputMixture as OutputMixture  # its home before ops.apfl
from ..ops.apfl import (
    add_weighted,
    alpha_gradient,
    alpha_update,
    average_offset,
    averaging_weight,
    averaging_weight_sum,
    decay_rate,
    gradient_at_mixture,
    mix,
    mixed_model,
    mixture,
    module_with,
    normalised,
    personal_gradient,
    personal_sum,
)
from ..ops.checks import check_choice, check_fraction, check_int, check_positive

APFL_ALPHA_KEY = "apfl-alpha"
APFL_ADAPTIVE_KEY = "apfl-adaptive-alpha"
APFL_MIXING_KEY = "apfl-mixing"
APFL_GRADIENT_KEY = "apfl-personal-gradient"
APFL_FIRST_STEP_KEY = "apfl-first-step"
APFL_AVERAGE_A_KEY = "apfl-average-a"
APFL_LR_MU_KEY = "apfl-lr-mu"
APFL_LR_A_KEY = "apfl-lr-a"
APFL_STEP_KEY = "apfl-step"
#: Reported by clients that apply APFL's rule (APFLRule).
APFL_APPLIED_KEY = "apfl-applied"
WEIGHTED_THETA_RECORD = "apfl-weighted-theta"
AVERAGE_MODEL_RECORD = "apfl-average-model"

MIXINGS = ("parameters", "outputs")
PERSONAL_GRADIENTS = ("mixture", "chain")
LR_SCHEDULES = ("constant", "decay")

PERSONAL_STATE = "apfl-personal"
PERSONAL_SUM_STATE = "apfl-personal-sum"
ALPHA_STATE = "apfl-alpha"
LAST_STEP_STATE = "apfl-last-step"


class APFL(ValidatedFedAvg):
    r"""APFL strategy: FedAvg of the clients' global copies every ``sync_gap`` steps.

    Each local step trains the client's copy :math:`\theta_k` of the global
    model and its personal model :math:`\omega_k` at the mixture
    :math:`\bar\omega_k = \alpha_k\omega_k + (1-\alpha_k)\theta_k` (Deng et
    al., 2020, Algorithm 1); the clients evaluate the personalised model beside
    the global one. Its clients are :class:`APFLClient` or your own loop with
    :class:`APFLRule`.

    Parameters
    ----------
    alpha : float (default: 0.5)
        Initial (or fixed) mixture weight :math:`\alpha \in [0, 1]`; 0 gives
        FedAvg, 1 purely local personal models.
    adaptive_alpha : bool (default: False)
        Each client learns its own :math:`\alpha_k` by gradient descent.
    sync_gap : int (default: 10)
        :math:`\tau`: local steps (mini-batches) per round, i.e. between two
        aggregations.
    mixing : str (default: "parameters")
        ``"parameters"`` (the paper) or ``"outputs"`` (the official code
        FedTorch, and FL4Health): what the personalised model mixes.
    personal_gradient : str | None (default: None)
        ``"mixture"`` (the gradient at the mixture,
        :math:`\nabla f_k(\bar\omega)`) or ``"chain"`` (the paper's Eq. (10):
        :math:`\alpha\nabla f_k(\bar\omega)`); both have the same fixed
        points. None picks "mixture" for parameter mixing and "chain" (the
        only defined one) for output mixing.
    lr_schedule : str (default: "constant")
        ``"constant"``: the clients' learning rate (times ``lr-scale``);
        ``"decay"``: :math:`\eta_t = 16/(\mu(t + a))`, the rate of the
        paper's convergence analysis.
    strong_convexity : float | None (default: None)
        :math:`\mu`, required by ``lr_schedule="decay"``.
    condition_number : float (default: 1.0)
        :math:`\kappa = L/\mu`; :math:`a = \max(128\kappa, \tau)` sets the decay
        and the averaging weights :math:`p_t = (t + a)^2`.
    weighted_average : bool (default: True)
        Keep the :math:`p_t`-weighted averages of the global and the
        personalised models that the paper's analysis returns (costs one
        more model per upload).
    **kwargs
        Keyword arguments of :class:`FedAvg` (not ``local_epochs``,
        ``local_steps`` or ``drop_percent``: APFL counts its local work in
        steps, ``sync_gap``). Here ``weighting`` defaults to ``"uniform"``
        (the paper's plain mean over the sampled clients); ``"num-examples"``
        weights by sample counts.

    Raises
    ------
    ValueError
        If ``alpha`` is outside ``[0, 1]``, ``sync_gap`` is not an integer
        >= 1, ``mixing``, ``personal_gradient`` or ``lr_schedule`` is not one
        of its choices, ``personal_gradient="mixture"`` is asked with
        ``mixing="outputs"``, ``lr_schedule="decay"`` lacks
        ``strong_convexity`` (or it is not > 0), ``condition_number`` is not
        > 0, ``local_epochs``, ``local_steps`` or ``drop_percent`` is given,
        or a keyword argument of :class:`FedAvg` is out of range.
    TypeError
        If a keyword is unknown.

    Notes
    -----
    Clients report ``apfl-applied`` (their steps that held the rule's term)
    beside ``local-steps``; replies without it are named in a warning once per
    run (rejected with ``strict=True``). Evaluation metrics: ``personal``,
    ``accuracy`` (the global model), ``personal-avg`` and ``global-avg``.

    References
    ----------
    Y. Deng, M. M. Kamani and M. Mahdavi, "Adaptive Personalized Federated
    Learning", 2020. https://arxiv.org/abs/2003.13461; official code:
    https://github.com/MLOPTPSU/FedTorch
    """

    default_weighting = "uniform"
    rule_metric = APFL_APPLIED_KEY
    rule_name = "APFL's personalised mixture"
    #: :math:`\sum_t p_t\,\mathrm{mean}_S\theta_k^t` and :math:`S_T`, over the
    #: aggregated rounds.
    #: The model is a positive combination of the replies' (NaN/inf reach it).
    model_linear_in_replies = True
    state_fields = ("average_sum", "average_weight")
    #: ``sync_gap`` numbers the steps (``apfl-first-step``).
    resume_settings = ("sync_gap", "alpha")
    settings = (
        "alpha",
        "adaptive_alpha",
        "sync_gap",
        "mixing",
        "personal_gradient",
        "lr_schedule",
        "weighted_average",
    )

    def __init__(
        self,
        *,
        alpha: float = 0.5,
        adaptive_alpha: bool = False,
        sync_gap: int = 10,
        mixing: str = "parameters",
        personal_gradient: str | None = None,
        lr_schedule: str = "constant",
        strong_convexity: float | None = None,
        condition_number: float = 1.0,
        weighted_average: bool = True,
        **kwargs: Any,
    ) -> None:
        check_fraction("alpha", alpha)
        check_int("sync_gap", sync_gap, 1)
        check_choice("mixing", mixing, MIXINGS)
        if personal_gradient is None:
            personal_gradient = "mixture" if mixing == "parameters" else "chain"
        check_choice("personal_gradient", personal_gradient, PERSONAL_GRADIENTS)
        if mixing == "outputs" and personal_gradient == "mixture":
            raise ValueError(
                "personal_gradient='mixture' is defined for mixing='parameters' "
                "only; output mixing's gradient is the chain-rule one ('chain')"
            )
        check_choice("lr_schedule", lr_schedule, LR_SCHEDULES)
        if lr_schedule == "decay":
            if strong_convexity is None:
                raise ValueError("lr_schedule='decay' needs strong_convexity (mu)")
            check_positive("strong_convexity", strong_convexity)
        check_positive("condition_number", condition_number)
        for name in ("local_epochs", "local_steps", "drop_percent"):
            if kwargs.get(name):
                raise ValueError(
                    f"APFL runs sync_gap local steps per round; {name} is not used "
                    f"(got {name}={kwargs[name]!r})"
                )
            kwargs.pop(name, None)
        super().__init__(local_steps=sync_gap, **kwargs)
        self.alpha = float(alpha)
        self.adaptive_alpha = bool(adaptive_alpha)
        self.sync_gap = sync_gap
        self.mixing = mixing
        self.personal_gradient = personal_gradient
        self.lr_schedule = lr_schedule
        self.strong_convexity = strong_convexity
        self.condition_number = float(condition_number)
        self.a = average_offset(self.condition_number, sync_gap)
        self.weighted_average = bool(weighted_average)
        self.average_sum: dict[str, NDArray] | None = None
        self.average_weight = 0.0

    def first_step(self, server_round: int) -> int:
        """Global step counter :math:`t` at the start of ``server_round``."""
        return (server_round - 1) * self.sync_gap

    def train_config(self, server_round: int) -> dict[str, Any]:
        """Send the mixture settings, the step counter and the schedule."""
        config: dict[str, Any] = {
            APFL_ALPHA_KEY: self.alpha,
            APFL_ADAPTIVE_KEY: self.adaptive_alpha,
            APFL_MIXING_KEY: self.mixing,
            APFL_GRADIENT_KEY: self.personal_gradient,
            APFL_FIRST_STEP_KEY: self.first_step(server_round),
        }
        if self.weighted_average:
            config[APFL_AVERAGE_A_KEY] = self.a
        if self.lr_schedule == "decay":
            assert self.strong_convexity is not None
            config[APFL_LR_MU_KEY] = self.strong_convexity
            config[APFL_LR_A_KEY] = self.a
        return config

    def expected_train_arrays(self, server_round: int) -> dict[str, RecordSpec]:
        """Expect the model, plus its p-weighted mean over the round's steps."""
        expected = super().expected_train_arrays(server_round)
        if self.weighted_average:
            expected[WEIGHTED_THETA_RECORD] = expected[self.arrayrecord_key]
        return expected

    def secure_sums(self) -> dict[str, tuple[str, ...]]:
        r"""Declare the weighted means of the :math:`\theta_k` (and of the averages)."""
        sums: dict[str, tuple[str, ...]] = {self.arrayrecord_key: ("mean",)}
        if self.weighted_average:
            sums[WEIGHTED_THETA_RECORD] = ("mean",)
        return sums

    def server_update(
        self, server_round: int, state: Mapping[str, Any], replies: list[ValidReply]
    ) -> RoundUpdate:
        r"""Return the weighted mean of the :math:`\theta_k`; add the round's steps.

        With ``weighted_average``, the round's steps :math:`t = (r-1)\tau + 1,
        \dots, r\tau` weigh the mean of the uploaded :math:`p`-weighted means by
        their :math:`\sum p_t` into :math:`\hat\theta`'s sum and weight. The
        clients' smallest and largest :math:`\alpha_k` are the round's metrics.
        """
        new_state: dict[str, Any] = {}
        if self.weighted_average:
            mean = self.weighted_mean(replies, WEIGHTED_THETA_RECORD)
            first = self.first_step(server_round)
            weight = averaging_weight_sum(first + 1, first + self.sync_gap, self.a)
            new_state = {
                "average_sum": add_weighted(state["average_sum"], mean, weight),
                "average_weight": state["average_weight"] + weight,
            }
        alphas = [
            float(v)
            for r in replies
            if isinstance(v := r.metrics.get("apfl-alpha"), (int, float))
        ]
        metrics: dict[str, Any] = (
            {"apfl-alpha-min": min(alphas), "apfl-alpha-max": max(alphas)}
            if alphas
            else {}
        )
        return RoundUpdate(
            dict_to_record(self.weighted_mean(replies)), new_state, metrics
        )

    def average_model(self) -> ArrayRecord | None:
        r"""Return :math:`\hat\theta`, the weighted global model (or None)."""
        if self.average_sum is None or self.global_arrays is None:
            return None
        model = record_to_dict(self.global_arrays)
        return dict_to_record(
            divided_like(model, self.average_sum, self.average_weight)
        )

    def central_models(self) -> dict[str, ArrayRecord]:
        """Evaluate the weighted average of the global model too."""
        model = self.average_model()
        return {} if model is None else {"central-average": model}

    def evaluate_config(self, server_round: int) -> dict[str, Any]:
        """Tell clients the mixture settings and the step count T so far."""
        config: dict[str, Any] = {
            APFL_ALPHA_KEY: self.alpha,
            APFL_MIXING_KEY: self.mixing,
            APFL_STEP_KEY: server_round * self.sync_gap,
        }
        if self.weighted_average:
            config[APFL_AVERAGE_A_KEY] = self.a
        return config

    def evaluate_records(self, server_round: int) -> dict[str, ArrayRecord]:
        r"""Send :math:`\hat\theta` so clients can evaluate :math:`\hat\omega_k`."""
        model = self.average_model()
        return {} if model is None else {AVERAGE_MODEL_RECORD: model}


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
    return personal_sum(saved, last, omega, up_to, a)


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
        return decay_rate(t, float(self.lr_mu), float(self.lr_a or 0.0))

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
            point = mixture(
                alpha,
                [w.detach() for w in self.omega],
                [p.detach() for p in self.params],
            )
            personal_loss, mixture_grad = gradient_at_mixture(
                self.model, self.names, point, inputs, targets, loss_fn, untracked
            )
            grads = personal_gradient(mixture_grad, alpha, self.gradient_form)
            for w, g in zip(self.omega, grads, strict=True):
                w.grad = g
            self.alpha_grad = alpha_gradient(self.omega, self.params, mixture_grad)
        else:
            if theta_outputs is None:
                with torch.no_grad(), untracked():
                    theta_outputs = self.model(inputs)
            weight = torch.tensor(alpha, dtype=torch.float64, requires_grad=True)
            out = mix(weight, self.personal(inputs), theta_outputs.detach())
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
            self.alpha = alpha_update(self.alpha, self._lr, self.alpha_grad)
        if self.theta_sum is not None and self.omega_sum is not None:
            assert self.average_a is not None
            weight_t = averaging_weight(t + 1, self.average_a)
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
            weighted = normalised(self.theta_sum, round_weight, self.params)
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
            self.model, normalised(personal_sum, normaliser, omega)
        )
        global_average = module_with(self.model, self.from_state_order(average))
        models["personal-avg"] = mixed_model(
            personal_average, global_average, alpha, mixing
        )
        models["global-avg"] = global_average
        return models


#: The configurations the conformance checks run (``flwr_prox_strategies.testing``),
#: name -> factory taking the number of nodes; together they set every state field.
CASES = {
    "default": lambda n: APFL(alpha=0.5, min_available_nodes=n),
    "last-iterate": lambda n: APFL(
        alpha=0.5, adaptive_alpha=True, weighted_average=False, min_available_nodes=n
    ),
}

r"""Sample-level differential privacy for every client: DP-SGD through opacus.

A client built with ``dp=DPSGD(...)`` trains through opacus (per-sample
gradients, Poisson sampling, clipping and noise); the algorithm's own gradient
term reads no data and is added *after* clipping and noise. The accountant's
history lives in ``context.state`` (spent is spent); each reply reports
``dp-epsilon``, ``dp-epsilon-total`` and ``dp-delta``, and a client over its
``target_epsilon`` answers :class:`PrivacyBudgetExhausted` instead of training.
The step's formula and why: the documentation's privacy guide.
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from logging import INFO
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.common.logger import log
from torch import nn
from torch.utils.data import DataLoader

from ..._optional import require
from ..contract.ledger import DELTA_METRIC, EPSILON_METRIC, EPSILON_TOTAL_METRIC
from .state import ClientState
from .training import GradientTerm

if TYPE_CHECKING:  # opacus is imported where DP-SGD runs (it configures logging)
    from opacus import GradSampleModule
    from opacus.accountants import IAccountant

#: The accountants :class:`DPSGD` accepts (opacus' RDP and PRV accountants).
ACCOUNTANT_NAMES = ("prv", "rdp")
_HISTORY = "dp-accountant-history"
_SPENT = "dp-sgd-epsilon"


def require_opacus() -> None:
    """Import opacus, or say which extra installs it.

    opacus is imported only where DP-SGD is used: its import calls
    ``logging.basicConfig``, which would double every Flower log line of a
    program that merely imports this pack.

    Raises
    ------
    ImportError
        When opacus is not installed, naming the ``dp`` extra.
    """
    require("opacus", "dp", "DP-SGD")


def _accountant(name: str) -> IAccountant:
    """Return a new opacus accountant of kind ``name`` (``"rdp"`` or ``"prv"``)."""
    require_opacus()
    from opacus.accountants import PRVAccountant, RDPAccountant

    return {"rdp": RDPAccountant, "prv": PRVAccountant}[name]()


class PrivacyBudgetExhausted(Exception):
    """Training this round would take the client past its target epsilon.

    Raised by a client built with ``dp=DPSGD(target_epsilon=...)`` before it
    trains a round that would spend more than its budget (the model and the
    privacy ledger are left untouched). :func:`to_client_app` sends
    ``"PrivacyBudgetExhausted: <message>"`` as the error reply's reason, which
    tells the pack's strategies the client is absent from now on rather than
    failed: it is counted in ``replies-absent`` and never sampled for training
    again.
    """


@dataclass(frozen=True)
class DPSGD:
    r"""Settings of sample-level DP-SGD on a client (opacus).

    Give it to any client of the pack (``XxxClient(..., dp=DPSGD(...))``): the
    client then trains through opacus (per-example clipping to :math:`C`,
    Gaussian noise :math:`\sigma C`, Poisson sampling), adds the algorithm's
    own gradient term after the noise (it reads no data: neither clipped nor
    noised), and reports ``dp-epsilon``, ``dp-epsilon-total`` and
    ``dp-delta`` every round (Abadi et al., "Deep Learning with Differential
    Privacy", CCS 2016).

    Parameters
    ----------
    noise_multiplier : float
        :math:`\sigma \ge 0`, noise standard deviation over the clipping norm.
    clipping_norm : float
        :math:`C > 0`, the bound on each example's gradient norm.
    delta : float (default: 1e-5)
        The :math:`\delta` at which epsilon is reported, in (0, 1).
    accountant : str (default: "rdp")
        ``"rdp"`` (Rényi DP, Mironov 2017) or ``"prv"`` (privacy random
        variables, Gopi et al. 2021: tighter, slower).
    target_epsilon : float | None (default: None)
        The client's budget: a round that would take it past this epsilon is
        refused (:class:`PrivacyBudgetExhausted`). None: no budget.
    poisson_sampling : bool (default: True)
        Draw batches by Poisson sampling, which the accountants assume. False
        keeps the loader's own batches (the figure is then only indicative).
    fix_model : bool (default: False)
        Replace layers opacus cannot train privately (BatchNorm -> GroupNorm)
        with opacus' ``ModuleValidator.fix``. This changes the model's
        ``state_dict``: build the server's model with :func:`make_private_model`
        too. False: such a model is refused with the layer named.

    Raises
    ------
    ValueError
        If ``noise_multiplier`` is negative or not finite, ``clipping_norm``
        not > 0, ``delta`` outside (0, 1), ``accountant`` not ``"rdp"`` or
        ``"prv"``, ``target_epsilon`` not None or > 0, or ``target_epsilon``
        is set with ``noise_multiplier=0`` (naming the parameter).
    """

    noise_multiplier: float
    clipping_norm: float
    delta: float = 1e-5
    accountant: str = "rdp"
    target_epsilon: float | None = None
    poisson_sampling: bool = True
    fix_model: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(
                f"noise_multiplier must be a finite number >= 0, "
                f"got {self.noise_multiplier!r}"
            )
        if not (math.isfinite(self.clipping_norm) and self.clipping_norm > 0):
            raise ValueError(f"clipping_norm must be > 0, got {self.clipping_norm!r}")
        if not (0 < self.delta < 1):
            raise ValueError(f"delta must be in (0, 1), got {self.delta!r}")
        if self.accountant not in ACCOUNTANT_NAMES:
            raise ValueError(
                f"accountant must be one of {list(ACCOUNTANT_NAMES)}, "
                f"got {self.accountant!r}"
            )
        if self.target_epsilon is not None and not (
            math.isfinite(self.target_epsilon) and self.target_epsilon > 0
        ):
            raise ValueError(
                f"target_epsilon must be None or > 0, got {self.target_epsilon!r}"
            )
        if self.target_epsilon is not None and self.noise_multiplier == 0:
            raise ValueError(
                "target_epsilon needs noise_multiplier > 0: without noise no "
                "finite epsilon is ever reached"
            )


def unsupported_layers(model: nn.Module) -> list[str]:
    """Name every layer opacus cannot train privately, with opacus' reason."""
    require_opacus()
    from opacus.validators import ModuleValidator

    problems = []
    for name, module in model.named_modules():
        validator = ModuleValidator.VALIDATORS.get(type(module))
        for error in validator(module) if validator is not None else []:
            reason = str(error).split(". ")[0]
            problems.append(f"'{name}' ({type(module).__name__}): {reason}")
    return problems


def make_private_model(model: nn.Module, dp: DPSGD | None) -> nn.Module:
    """Return ``model`` ready for DP-SGD: checked, and fixed when ``dp.fix_model``.

    Clients call it on their model; call it on the server's initial model too
    when ``fix_model`` is set, so both hold the same layers.

    Parameters
    ----------
    model : torch.nn.Module
        The model.
    dp : DPSGD | None
        The client's DP-SGD settings; None returns ``model`` unchanged.

    Returns
    -------
    torch.nn.Module
        ``model``; with ``dp.fix_model``, what opacus'
        ``ModuleValidator.fix`` makes of it (BatchNorm replaced by GroupNorm).

    Raises
    ------
    ValueError
        Naming each layer opacus cannot handle, when ``fix_model`` is False.
    ImportError
        If ``dp`` is given and opacus is not installed (the ``[dp]`` extra).
    """
    if dp is None:
        return model
    require_opacus()
    from opacus.validators import ModuleValidator

    if dp.fix_model:
        model = ModuleValidator.fix(model)
    problems = unsupported_layers(model)
    if problems:
        raise ValueError(
            "DP-SGD cannot train this model: "
            + "; ".join(problems)
            + ". Pass DPSGD(fix_model=True) (Hydra: privacy.dp.fix_model=true) to "
            "replace them with opacus' ModuleValidator.fix, on the server's model too."
        )
    return model


class PrivacyLedger:
    """A client's accountant, kept in its cross-round state."""

    def __init__(self, dp: DPSGD, state: ClientState) -> None:
        self.dp = dp
        self.state = state

    def accountant(self) -> IAccountant:
        """Return an accountant holding every step spent so far."""
        accountant = _accountant(self.dp.accountant)
        saved = self.state.get(_HISTORY)
        if saved:
            accountant.history = [
                (float(sigma), float(rate), int(steps))
                for sigma, rate, steps in saved[0]
            ]
        return accountant

    def save(self, accountant: IAccountant) -> None:
        """Commit the accountant's history and its epsilon (never rolled back)."""
        rows = np.asarray(accountant.history, dtype=np.float64).reshape(-1, 3)
        self.state.set(_HISTORY, [rows])
        self.state.set_scalar(_SPENT, self.epsilon(accountant))

    def spent(self) -> float:
        """Epsilon spent so far (as computed when the steps were committed)."""
        return self.state.scalar(_SPENT, 0.0)

    def epsilon(self, accountant: IAccountant | None = None) -> float:
        """Epsilon at ``delta`` of ``accountant`` (this ledger's when None)."""
        accountant = accountant or self.accountant()
        if not accountant.history:
            return 0.0
        if any(sigma == 0 for sigma, _, _ in accountant.history):
            return math.inf
        return float(accountant.get_epsilon(delta=self.dp.delta))

    def projected(self, sample_rate: float, steps: int) -> float:
        """Epsilon after ``steps`` more noisy steps at ``sample_rate``."""
        accountant = self.accountant()
        if steps > 0:
            accountant.history.append(
                (self.dp.noise_multiplier, float(sample_rate), int(steps))
            )
        return self.epsilon(accountant)

    def check_round(self, loader: Any, steps: int) -> float:
        """Refuse ``steps`` more steps past the budget; return the epsilon spent."""
        self.check_budget(sample_rate_of(loader, self.dp)[0], steps)
        return self.spent()

    def report_round(
        self, client: str, server_round: int, loader: Any, before: float, steps: int
    ) -> dict[str, float]:
        """Log and return this round's DP-SGD spending (``before``: epsilon then)."""
        spent = self.spent()
        rate, _ = sample_rate_of(loader, self.dp)
        log_round(client, server_round, self.dp, steps, rate, spent)
        return epsilon_report(before, spent, self.dp)

    def check_budget(self, sample_rate: float, steps: int) -> None:
        """Refuse the round if it would take the client past ``target_epsilon``."""
        target = self.dp.target_epsilon
        if target is None:
            return
        after = self.projected(sample_rate, steps)
        if after > target:
            raise PrivacyBudgetExhausted(
                f"the client has spent epsilon={self.spent():.4g} (delta="
                f"{self.dp.delta:g}); this round's {steps} DP-SGD steps would bring "
                f"it to {after:.4g} > target_epsilon={target:g}, so it stops training"
            )


@functools.cache
def _dp_optimizer_with_term() -> type[Any]:
    """Return opacus' DPOptimizer subclass that adds the term after privatisation.

    Built on first use, so that importing this module does not import opacus.
    """
    require_opacus()
    from opacus.optimizers import DPOptimizer

    class DPOptimizerWithTerm(DPOptimizer):
        """opacus' DPOptimizer that adds the algorithm's term after privatisation."""

        def __init__(
            self,
            optimizer: torch.optim.Optimizer,
            *,
            term: GradientTerm | None,
            max_total_norm: float | None,
            **kwargs: Any,
        ) -> None:
            super().__init__(optimizer, **kwargs)
            self.term = term
            self.max_total_norm = max_total_norm

        def step(self, closure: Any = None) -> Any:
            """Clip per sample and add noise (opacus), then add the term, then step."""
            if closure is not None:
                with torch.enable_grad():
                    closure()
            if not self.pre_step():
                return None
            if self.term is not None:
                self.term.add_(self.params)
            if self.max_total_norm is not None:  # post-processing: no privacy cost
                torch.nn.utils.clip_grad_norm_(
                    self.params, max_norm=self.max_total_norm
                )
            return self.original_optimizer.step()

    return DPOptimizerWithTerm


@dataclass
class TrainingRun:
    """What a local solve trains with: plain, or wrapped by :func:`dp_sgd`."""

    model: nn.Module
    loader: Any
    optimizer: torch.optim.Optimizer
    term: GradientTerm | None
    max_grad_norm: float | None

    def untracked(self) -> AbstractContextManager[Any]:
        """Context in which forward/backward passes compute no per-sample grads."""
        opacus = sys.modules.get("opacus")  # not imported: no GradSampleModule
        if opacus is not None and isinstance(self.model, opacus.GradSampleModule):
            return _hooks_off(self.model)
        return nullcontext()


@contextmanager
def _hooks_off(model: GradSampleModule) -> Iterator[None]:
    model.disable_hooks()
    try:
        yield
    finally:
        model.enable_hooks()


def sample_rate_of(loader: Any, dp: DPSGD) -> tuple[float, int]:
    """Return (q, expected batch size) DP-SGD uses on ``loader``."""
    if not isinstance(loader, DataLoader) or loader.batch_size is None:
        raise ValueError(
            "DP-SGD needs a torch DataLoader with a batch_size (it redraws its "
            "batches by Poisson sampling and needs the data set size)"
        )
    batches = len(loader)
    size = len(loader.dataset)  # type: ignore[arg-type]
    if dp.poisson_sampling:
        return 1.0 / batches, max(1, int(size / batches))
    return min(1.0, loader.batch_size / size), loader.batch_size


@contextmanager
def dp_sgd(
    model: nn.Module,
    loader: Any,
    optimizer: torch.optim.Optimizer,
    *,
    dp: DPSGD,
    ledger: PrivacyLedger,
    term: GradientTerm | None,
    max_grad_norm: float | None,
    seed: int | None = None,
) -> Iterator[TrainingRun]:
    """Wrap a local solve in opacus; on exit, commit the steps spent.

    ``model`` keeps its own parameters (the wrapper shares them) and loses the
    per-sample hooks on exit, so it is the plain model again for the reply.
    With ``seed``, the noise and the Poisson draws come from
    ``torch.Generator().manual_seed(seed)`` (noise first drawn for the first
    step, parameter by parameter): reproducible, and checkable by hand.
    """
    require_opacus()
    from opacus import GradSampleModule
    from opacus.data_loader import DPDataLoader

    sample_rate, expected_batch = sample_rate_of(loader, dp)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    private_model = GradSampleModule(model, loss_reduction="mean")
    private_loader = (
        DPDataLoader.from_data_loader(loader, generator=generator)
        if dp.poisson_sampling
        else loader
    )
    private_optimizer = _dp_optimizer_with_term()(
        optimizer,
        term=term,
        max_total_norm=max_grad_norm,
        noise_multiplier=dp.noise_multiplier,
        max_grad_norm=dp.clipping_norm,
        expected_batch_size=expected_batch,
        generator=generator,
    )
    accountant = ledger.accountant()
    private_optimizer.attach_step_hook(
        accountant.get_optimizer_hook_fn(sample_rate=sample_rate)
    )
    try:
        with warnings.catch_warnings():
            # opacus' hooks on a first layer whose input needs no gradient.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            yield TrainingRun(
                model=private_model,
                loader=private_loader,
                optimizer=private_optimizer,
                term=None,  # the optimiser adds it after privatisation
                max_grad_norm=None,
            )
    finally:
        ledger.save(accountant)
        private_model._close()
        for p in model.parameters():
            p.grad_sample = None  # type: ignore[attr-defined]


def epsilon_report(before: float, after: float, dp: DPSGD) -> dict[str, float]:
    """Return the metrics a DP-SGD client sends every round."""
    return {
        EPSILON_METRIC: after - before,
        EPSILON_TOTAL_METRIC: after,
        DELTA_METRIC: dp.delta,
    }


def log_round(
    client: str, server_round: int, dp: DPSGD, steps: int, q: float, total: float
) -> None:
    """Say what DP-SGD spent this round (Flower's logger)."""
    log(
        INFO,
        "%s: round %d: DP-SGD %d steps, sample rate %.4g, noise multiplier %.4g, "
        "clipping norm %.4g: epsilon %.4g at delta %g (%s accountant)%s",
        client,
        server_round,
        steps,
        q,
        dp.noise_multiplier,
        dp.clipping_norm,
        total,
        dp.delta,
        dp.accountant,
        "" if dp.target_epsilon is None else f", budget {dp.target_epsilon:g}",
    )


__all__: Sequence[str] = [
    "DPSGD",
    "PrivacyBudgetExhausted",
    "PrivacyLedger",
    "TrainingRun",
    "dp_sgd",
    "make_private_model",
    "unsupported_layers",
]

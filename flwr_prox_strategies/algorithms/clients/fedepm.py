"""FedEPM: the client side, the rule and the ``NumPyClient``.

The strategy, the wire keys and the docs of the algorithm are in
:mod:`..fedepm`; this half imports torch, which a ServerApp never needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from ...core.client.client import TorchClient
from ...core.client.rule import ClientRule
from ...core.client.training import (
    TrainReport,
    evaluate_model,
    full_gradient,
    trainable,
)
from ...core.contract.ledger import (
    DELTA_METRIC,
    EPSILON_METRIC,
    EPSILON_TOTAL_METRIC,
    spend_epsilon,
)
from ...ops.checks import (
    check_int,
    check_non_negative,
)
from ...ops.elastic_net import prox_linear_steps
from ...ops.privacy import add_laplace_noise
from ..fedepm import (
    ETA_KEY,
    FEDEPM_APPLIED_KEY,
    GROWTH_KEY,
    ITERATION_KEY,
    K0_KEY,
    LAMBDA_KEY,
    LOCAL_STATE,
    NOISE_KEY,
    R0_KEY,
)

#: ``f_i`` and its full gradient at the model's current point.
Objective = Callable[[], tuple[float, list[torch.Tensor]]]


class FedEPMRule(ClientRule):
    r"""FedEPM's client rule: k0 closed-form prox-linear steps, noisy upload.

    FedEPM takes no SGD steps, so it has no gradient term for a training loop:
    give :meth:`solve` your objective, a function returning :math:`f_i` and
    its full gradient at the model's current point (your loss, your data,
    any batch format), and it runs the round's iterations from the server
    point and the client's last local point (kept in the state), then adds
    the paper's Laplace noise to the upload::

        rule = FedEPMRule.from_message(msg, context, model, num_examples=n)
        rule.solve(lambda: my_loss_and_full_gradient(model))
        return rule.reply(num_examples=n)

    Parameters
    ----------
    num_examples : int
        :math:`d_i`, the local data size (the step scale :math:`\mu/d_i`).
    seed : int | None (default: None)
        Seeds the upload noise per (seed, client, round).
    *args, **kwargs
        As :class:`ClientRule` (``model``, ``config``, ``received``, ``state``,
        ``client_key``, ``relative_size``, ``base_lr``); build the rule with
        :meth:`ClientRule.from_message`, which passes them.

    Raises
    ------
    ValueError
        If ``num_examples`` is not an integer >= 1.
    ProtocolError
        If the train config lacks FedEPM's keys (the server is not running
        FedEPM).
    """

    protocol = "FedEPM"
    applied_metric = FEDEPM_APPLIED_KEY
    stateful = True
    keeps_privacy_ledger = True  # the Laplace release's epsilon, spent is spent
    state_names = (LOCAL_STATE,)

    def __init__(
        self, *args: Any, num_examples: int, seed: int | None = None, **kwargs: Any
    ) -> None:
        check_int("num_examples", num_examples, 1)
        self.num_examples = int(num_examples)
        self.seed = seed
        self.round_metrics: dict[str, Any] = {}
        super().__init__(*args, **kwargs)

    def setup(self) -> None:
        """Read the round's iteration counter, k0 and the penalty settings."""
        self.first = int(self.required(ITERATION_KEY))
        self.k0 = int(self.required(K0_KEY))
        self.r0 = float(self.required(R0_KEY))
        self.growth = float(self.required(GROWTH_KEY))
        self.epsilon = float(self.required(NOISE_KEY))
        return None

    def solve(self, objective: Objective) -> TrainReport:
        """Run the k0 closed-form iterations and build the noisy upload.

        Parameters
        ----------
        objective : callable
            ``objective() -> (f_i, gradient)``: the local objective's value and
            its full gradient (one tensor per trainable parameter) at the
            model's current point, which the rule sets to the server point.

        Returns
        -------
        TrainReport
            What the round did (``steps`` is ``k0``, ``mean_loss`` is
            :math:`f_i` at the server point); the model now holds the noisy
            upload.
        """
        lam = float(self.required(LAMBDA_KEY))
        eta = float(self.required(ETA_KEY))
        d = self.num_examples
        value, grads = objective()
        with torch.no_grad():
            x = [p.detach().clone() for p in self.params]
            local = self.state.get_tensors(LOCAL_STATE, self.params)
            if self.state.get(LOCAL_STATE) is None:
                local = [v.clone() for v in x]
            local, mu = prox_linear_steps(
                x,
                local,
                grads,
                range(self.first, self.first + self.k0),
                lam=lam,
                eta=eta,
                r0=self.r0,
                growth=self.growth,
                size=d,
            )
            self.state.set_pending(LOCAL_STATE, local, self.server_round)
            for p, value_now in zip(self.params, local, strict=True):
                p.copy_(value_now)
        self.round_metrics = {"fedepm-mu": mu, **self.noisy_upload(value, grads, mu)}
        self.took_steps(self.k0)
        return TrainReport(epochs=0, steps=self.k0, examples_seen=d, mean_loss=value)

    def noisy_upload(
        self, value: float, grads: list[torch.Tensor], mu: float
    ) -> dict[str, Any]:
        r"""Release the model, calibrated as the paper: :math:`\Delta = 2\|g\|_1/\mu`.

        ``grads`` is the gradient at the server point; returns the round's
        metrics (objective there, :math:`\|g\|_1`, and what :meth:`release` spent).
        """
        grad_l1 = sum(float(g.abs().sum()) for g in grads)
        return {
            "fedepm-objective": value,
            "fedepm-grad-l1": grad_l1,
            **self.release(2 * grad_l1 / mu, self.epsilon),
        }

    def release(self, sensitivity: float, epsilon: float) -> dict[str, Any]:
        r"""Add Laplace(:math:`\Delta/\varepsilon`) noise to the model, count epsilon.

        ``epsilon = 0`` releases the model as it is. Privacy is spent at release,
        whether or not the server then uses the upload.
        """
        if epsilon == 0:
            return {}
        scale = sensitivity / epsilon
        rng = np.random.default_rng(
            None
            if self.seed is None
            else [self.seed, self.client_key % (1 << 31), self.server_round]
        )
        noisy = add_laplace_noise(
            [p.detach().cpu().numpy() for p in self.params], scale, rng
        )
        with torch.no_grad():
            for p, upload in zip(self.params, noisy, strict=True):
                p.copy_(torch.as_tensor(upload))
        return {
            "laplace-scale": scale,
            EPSILON_METRIC: epsilon,
            EPSILON_TOTAL_METRIC: spend_epsilon(self.state.records, epsilon),
            DELTA_METRIC: 0.0,  # pure epsilon-DP
        }

    def finish(
        self, steps: int, lr: float
    ) -> tuple[dict[str, list[NDArray]], dict[str, Any]]:
        """Report f_i at the server point, the noise scale and epsilon spent."""
        return {}, dict(self.round_metrics)


class FedEPMClient(TorchClient):
    r"""FedEPM client: k0 closed-form prox-linear steps from one gradient, noisy upload.

    Runs :class:`FedEPMRule` on the client's objective :math:`f_i`: the mean
    loss of any torch model over the local data, plus the ridge term (the
    paper: logistic loss, :math:`\beta = 10^{-3}`).

    Parameters
    ----------
    *args, **kwargs
        As :class:`FedAvgClient` (``seed`` also seeds the noise per round; the
        learning rate is not used; ``dp`` is refused).
    ridge : float (default: 0.0)
        :math:`\beta \ge 0`: :math:`f_i` is the mean loss plus
        :math:`\beta/(2 d_i)\lVert x\rVert^2` (the paper uses :math:`10^{-3}`).

    Raises
    ------
    ValueError
        If ``dp`` is given (FedEPM privatises its upload with its own Laplace
        mechanism), ``ridge`` is negative, or a keyword argument of
        :class:`FedAvgClient` is out of range.
    """

    protocol = "FedEPM"
    rule_class = FedEPMRule

    def __init__(self, *args: Any, ridge: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.dp is not None:
            raise ValueError(
                f"dp: {type(self).__name__} takes full-gradient steps and privatises "
                "its upload with the paper's Laplace mechanism (the strategy's "
                "noise-epsilon, reported as dp-epsilon like DP-SGD's); DP-SGD does "
                "not apply to it"
            )
        check_non_negative("ridge", ridge)
        self.ridge = float(ridge)

    def objective_and_gradient(
        self, *, with_value: bool = True
    ) -> tuple[float, list[torch.Tensor]]:
        r"""Return :math:`f_i(x)` (NaN unless ``with_value``), :math:`\nabla f_i(x)`."""
        d = self.num_train_examples()
        params = trainable(self.model)
        loss = math.nan
        if with_value:
            loss, _, _ = evaluate_model(
                self.model, self.train_loader, self.loss_fn, device=self.device
            )
        grads = full_gradient(
            self.model, self.train_loader, self.loss_fn, device=self.device
        )
        with torch.no_grad():
            value = loss + self.ridge / (2 * d) * sum(
                float((p.double() ** 2).sum()) for p in params
            )
            grads = [
                g + (self.ridge / d) * p for g, p in zip(grads, params, strict=True)
            ]
        return value, grads

    def rule_options(self, config: dict[str, Any]) -> dict[str, Any]:
        """Give the rule :math:`d_i` and the noise seed."""
        return {"num_examples": self.num_train_examples(), "seed": self.seed}

    def local_solve(
        self, config: dict[str, Any], *, epochs: int, steps: int | None
    ) -> TrainReport:
        """Run the rule's iterations on this client's objective."""
        rule = self.make_rule(config)
        assert isinstance(rule, FedEPMRule)
        return rule.solve(self.objective_and_gradient)

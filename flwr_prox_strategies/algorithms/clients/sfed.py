"""SFedAvg and SFedProx: the client side, the rule and the ``NumPyClient``.

The strategy, the wire keys and the docs of the algorithm are in
:mod:`..sfed`; this half imports torch, which a ServerApp never needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...core.client.training import TrainReport
from ...core.docstrings import inherit_parameters
from ..sfed import (
    INNER_STEPS_KEY,
    PROX_MU_KEY,
    SFEDAVG_APPLIED_KEY,
    SFEDPROX_APPLIED_KEY,
    step_size,
)
from .fedepm import FedEPMClient, FedEPMRule, Objective


class SFedRule(FedEPMRule):
    r"""The client rule of SFedAvg and SFedProx: k0 x l full-gradient steps.

    Each step :math:`x \leftarrow x - \gamma(\nabla f_i(x) + \mu(x - x_t))`
    (:math:`\mu = 0` for SFedAvg), then FedEPM's Laplace upload. :meth:`solve`
    takes your objective (value and full gradient at the model's current
    point); ``gradient`` (the gradient alone, cheaper) serves the later steps
    when given. It reports both strategies' ``-applied`` metrics: one client
    serves both::

        rule = SFedRule.from_message(msg, context, model, num_examples=n)
        rule.solve(lambda: my_loss_and_full_gradient(model))
        return rule.reply(num_examples=n)

    Parameters
    ----------
    *args, **kwargs
        As :class:`ClientRule` (``model``, ``config``, ``received``, ``state``,
        ``client_key``, ``relative_size``, ``base_lr``); build the rule with
        :meth:`ClientRule.from_message`, which passes them.
    num_examples : int
        :math:`d_i`, the local data size (the step size :math:`\gamma_i^k`
        grows with it), required.
    seed : int | None (default: None)
        Seeds the upload noise per (seed, client, round).

    Raises
    ------
    ValueError
        If ``num_examples`` is not an integer >= 1.
    ProtocolError
        If the train config lacks the keys SFedAvg and SFedProx send.
    """

    protocol = "SFedAvg/SFedProx"
    applied_metric = SFEDAVG_APPLIED_KEY
    stateful = False

    def setup(self) -> None:
        """Read the iteration counter, k0, l, mu and the noise settings."""
        super().setup()
        self.inner = int(self.required(INNER_STEPS_KEY))
        self.mu = float(self.required(PROX_MU_KEY))

    def metrics(self) -> dict[str, Any]:
        """Say that both SFedAvg's and SFedProx's rule were applied."""
        metrics = super().metrics()
        return {**metrics, SFEDPROX_APPLIED_KEY: metrics[self.applied_metric]}

    def solve(
        self,
        objective: Objective,
        gradient: Callable[[], list[torch.Tensor]] | None = None,
    ) -> TrainReport:
        """Run k0 iterations of l full-gradient steps from the server model.

        Parameters
        ----------
        objective : callable
            ``objective() -> (f_i, gradient)`` at the model's current point.
        gradient : callable | None (default: None)
            ``gradient() -> gradient`` alone, for the steps after the first;
            None: ``objective``'s.

        Returns
        -------
        TrainReport
            What the round did (``steps`` is ``k0 * l``); the model now holds
            the noisy upload.
        """
        gradient = gradient or (lambda: objective()[1])
        d = self.num_examples
        value, received_grads = objective()
        grads = received_grads
        for iteration in range(self.first, self.first + self.k0):
            gamma = step_size(d, iteration, self.k0)
            for step in range(self.inner):
                if not (iteration == self.first and step == 0):
                    grads = gradient()
                with torch.no_grad():
                    for p, g, a in zip(self.params, grads, self.anchor, strict=True):
                        p.sub_(gamma * (g + self.mu * (p - a)))
        noise_mu = self.r0 * self.growth ** (self.first + self.k0)
        self.round_metrics = self.noisy_upload(value, received_grads, noise_mu)
        self.took_steps(self.k0 * self.inner)
        return TrainReport(epochs=0, steps=self.steps, examples_seen=d, mean_loss=value)


@inherit_parameters(FedEPMClient)
class SFedAvgClient(FedEPMClient):
    r"""Client of SFedAvg and SFedProx: :class:`SFedRule` on this client's data.

    ``SFedProxClient`` is the same class: the strategy's config says which
    method to run. Its parameters are :class:`FedEPMClient`'s.
    """

    protocol = "SFedAvg/SFedProx"
    rule_class = SFedRule

    def local_solve(
        self, config: dict[str, Any], *, epochs: int, steps: int | None
    ) -> TrainReport:
        """Run the rule's k0 x l steps on this client's objective."""
        rule = self.make_rule(config)
        assert isinstance(rule, SFedRule)
        return rule.solve(
            self.objective_and_gradient,
            lambda: self.objective_and_gradient(with_value=False)[1],
        )


#: The client of SFedProx: the same class as SFedAvg's.
SFedProxClient = SFedAvgClient
SFedClient = SFedAvgClient  # the class's former name

"""SCAFFOLD: the client side, the rule and the ``NumPyClient``.

The strategy, the wire keys and the docs of the algorithm are in
:mod:`..scaffold`; this half imports torch, which a ServerApp never needs.
"""

from __future__ import annotations

from typing import Any

import torch
from numpy.typing import NDArray

from ...core.client.client import TorchClient
from ...core.client.rule import ClientRule, arrays_from_params
from ...core.client.training import GradientTerm
from ...core.docstrings import inherit_parameters
from ...ops.proximal import ProximalTerm
from ..scaffold import (
    CONTROL_DELTA_RECORD,
    CONTROL_LR_KEY,
    CONTROL_RECORD,
    CONTROL_STATE,
    SCAFFOLD_APPLIED_KEY,
)


@inherit_parameters(ClientRule)
class ScaffoldRule(ClientRule):
    r"""SCAFFOLD's client rule: corrected steps, option-II update of :math:`c_i`.

    Adds the correction :math:`c - c_i` to every step's gradient; after the
    round, :math:`c_i^+ = c_i - c + (x - y)/(K\eta_l)` (pending until the
    server confirms the reply; :math:`x` is where training started, the
    received model unless the user restored part of it after
    :meth:`~ClientRule.from_message`) and the reply carries
    :math:`\Delta c_i` (``control-delta``). Option II assumes plain SGD steps:
    :meth:`ClientRule.attach` refuses momentum and other optimisers. With a
    step size that changes within the round, :math:`K\eta_l` is the sum of the
    steps' sizes, the same formula's exact generalisation; with
    ``scaffold-control-lr`` ``"base"`` in the config, :math:`K` times the
    undecayed rate (the official codes). It reports ``scaffold-applied``.

    Build it with :meth:`ClientRule.from_message`, which loads the received
    model and passes the parameters below.
    """

    protocol = "Scaffold"
    applied_metric = SCAFFOLD_APPLIED_KEY
    stateful = True
    state_names = (CONTROL_STATE,)
    plain_sgd = True
    path_estimate = True
    needs_lr = True

    def setup(self) -> GradientTerm:
        """Return the correction :math:`c - c_i` (a constant gradient shift)."""
        self.c = self.received_params(CONTROL_RECORD)
        self.ci = self.state.get_tensors(CONTROL_STATE, self.anchor)
        shift = [c - ci for c, ci in zip(self.c, self.ci, strict=True)]
        return ProximalTerm(0.0, self.anchor, shift, copy=False)

    def finish(
        self, steps: int, lr: float
    ) -> tuple[dict[str, list[NDArray]], dict[str, Any]]:
        r"""Apply option II, :math:`c_i^+ = c_i - c + (x - y)/(K\eta_l)`."""
        if steps == 0:
            delta = [torch.zeros_like(p) for p in self.params]
        else:
            if self.config.get(CONTROL_LR_KEY, "round") == "base":
                lr = self.undecayed_lr(lr)
            scale = 1.0 / (steps * lr)
            new_ci = [
                ci - c + (x - p.detach()) * scale
                for ci, c, x, p in zip(
                    self.ci, self.c, self.start, self.params, strict=True
                )
            ]
            delta = [n - ci for n, ci in zip(new_ci, self.ci, strict=True)]
            self.state.set_pending(CONTROL_STATE, new_ci, self.server_round)
        return {CONTROL_DELTA_RECORD: arrays_from_params(self.model, delta)}, {}


class ScaffoldClient(TorchClient):
    r"""SCAFFOLD client: :class:`ScaffoldRule` in the pack's training loop.

    Keeps :math:`c_i` in ``context.state`` (one model). With ``dp``, the correction
    :math:`c - c_i` is added after DP-SGD's clipping and noise, and :math:`c_i`
    (option II) is built from the private iterates.

    Parameters
    ----------
    *args, **kwargs
        As :class:`FedAvgClient`; ``momentum`` must be 0.

    Raises
    ------
    ValueError
        If ``momentum`` is not 0 (option II assumes plain SGD), or a keyword
        argument of :class:`FedAvgClient` is out of range.
    """

    protocol = "Scaffold"
    rule_class = ScaffoldRule

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.momentum != 0.0:
            raise ValueError(
                "momentum must be 0: SCAFFOLD's option II assumes plain SGD"
            )

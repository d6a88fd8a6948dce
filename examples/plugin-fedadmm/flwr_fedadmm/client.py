r"""FedADMM's client half: the augmented Lagrangian's local steps and dual update.

The strategy, the wire keys and the numpy maths are in :mod:`flwr_fedadmm.fedadmm`,
which the ServerApp imports without torch; the registry names these classes by
their dotted paths, so that only a client process loads this module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from flwr_prox_strategies.extend import ClientRule, TorchClient

from .fedadmm import (
    DUAL_STATE,
    FEDADMM_APPLIED_KEY,
    FEDADMM_DELTA_RECORD,
    FEDADMM_RHO_KEY,
    U_STATE,
    difference,
)


class AugmentedLagrangianGradient:
    r"""Adds :math:`\lambda_i + \rho(w - \theta^t)` to each parameter's gradient.

    The gradient of FedADMM's local term
    :math:`\langle\lambda_i, w - \theta^t\rangle +
    \frac{\rho}{2}\lVert w - \theta^t\rVert^2`, computed in the precision of
    the anchor (float32 at least) and added in the gradient's.

    Parameters
    ----------
    rho : float
        The penalty :math:`\rho > 0`.
    anchor : Sequence[torch.Tensor]
        :math:`\theta^t`, one tensor per trainable parameter.
    dual : Sequence[torch.Tensor]
        :math:`\lambda_i`, shaped as ``anchor``.
    """

    def __init__(
        self,
        rho: float,
        anchor: Sequence[torch.Tensor],
        dual: Sequence[torch.Tensor],
    ) -> None:
        self.rho = float(rho)
        self.anchor = [a.detach().clone() for a in anchor]
        self.dual = [d.detach().clone() for d in dual]

    def add_(self, params: Sequence[torch.Tensor]) -> None:
        """Add the term's gradient to each ``p.grad`` in place."""
        with torch.no_grad():
            for p, a, d in zip(params, self.anchor, self.dual, strict=True):
                if p.grad is None:  # no data gradient: the term still pulls
                    p.grad = torch.zeros_like(p)
                term = (p.detach().to(a.dtype) - a).mul_(self.rho).add_(d)
                p.grad.add_(term.to(p.grad.dtype))

    def value(self, params: Sequence[torch.Tensor]) -> float:
        r"""Return the term's value at ``params`` (a closure-based step adds it).

        Parameters
        ----------
        params : Sequence[torch.Tensor]
            The model's trainable parameters :math:`w`.

        Returns
        -------
        float
            :math:`\langle\lambda_i, w - \theta^t\rangle
            + \frac{\rho}{2}\lVert w - \theta^t\rVert^2`.
        """
        total = 0.0
        for p, a, d in zip(params, self.anchor, self.dual, strict=True):
            gap = p.detach().to(a.dtype) - a
            total += float((d * gap).sum()) + 0.5 * self.rho * float((gap**2).sum())
        return total


class FedADMMRule(ClientRule):
    r"""FedADMM's client rule: the augmented Lagrangian's term, then the dual step.

    Reads ``fedadmm-rho`` and the client's committed :math:`\lambda_i` (zero
    when it holds none); adds :math:`\lambda_i + \rho(w - \theta^t)` at every
    step. After training it sets pending
    :math:`\lambda_i + \rho(w_i - \theta^t)` and
    :math:`u_i = w_i + \lambda_i/\rho` (the model's buffers at its other
    entries), and replies with ``fedadmm-delta`` :math:`= u_i - u_i^{old}`,
    :math:`u_i^{old}` being the committed :math:`u_i`, or zero when the
    client holds no committed state. Any optimiser runs it (the term is a
    gradient; the local problem is solved inexactly by whatever steps the
    client takes). In your own ClientApp:
    ``rule = FedADMMRule.from_message(msg, context, model)``,
    ``rule.attach(optimizer)``, your loop, then ``rule.reply(num_examples=n)``.

    Parameters
    ----------
    *args, **kwargs
        As :class:`~flwr_prox_strategies.extend.ClientRule`.

    Raises
    ------
    ProtocolError
        If the train config has no ``fedadmm-rho`` (the server is not running
        FedADMM).
    ValueError
        If the received ``fedadmm-rho`` is not a finite number > 0, or the
        saved state does not fit the model.
    """

    protocol = "FedADMM"
    applied_metric = FEDADMM_APPLIED_KEY
    stateful = True
    state_names = (DUAL_STATE, U_STATE)

    def setup(self) -> AugmentedLagrangianGradient:
        r"""Read ``fedadmm-rho`` and :math:`\lambda_i`; return the round's term.

        Returns
        -------
        AugmentedLagrangianGradient
            :math:`\lambda_i + \rho(w - \theta^t)`, :math:`\lambda_i` the
            committed dual (zero for a client without state).
        """
        rho = float(self.required(FEDADMM_RHO_KEY))
        if not (math.isfinite(rho) and rho > 0):
            raise ValueError(
                f"received {FEDADMM_RHO_KEY}={rho!r}; it must be finite and > 0"
            )
        self.rho = rho
        self.dual = self.state.get_tensors(DUAL_STATE, self.anchor)
        return AugmentedLagrangianGradient(rho, self.anchor, self.dual)

    def finish(
        self, steps: int, lr: float
    ) -> tuple[dict[str, list[NDArray]], dict[str, Any]]:
        r"""Take the dual step; set :math:`\lambda_i` and :math:`u_i` pending.

        Returns
        -------
        tuple[dict[str, list[NDArray]], dict[str, Any]]
            ``fedadmm-delta`` (:math:`u_i - u_i^{old}`, the model's layout);
            no metrics of its own.
        """
        trained = [
            p.detach().to(a.dtype)
            for p, a in zip(self.params, self.anchor, strict=True)
        ]
        dual = [
            d + self.rho * (w - a)
            for d, w, a in zip(self.dual, trained, self.anchor, strict=True)
        ]
        u_params = [w + d / self.rho for w, d in zip(trained, dual, strict=True)]
        # The full layout: u at a buffer is the model's buffer after training.
        u_new = self.to_reply_layout(u_params, buffers="model")
        u_old = self.committed_u(u_new)
        delta = [difference(n, o) for n, o in zip(u_new, u_old, strict=True)]
        self.state.set_pending(DUAL_STATE, dual, self.server_round)
        self.state.set_pending(U_STATE, u_new, self.server_round)
        return {FEDADMM_DELTA_RECORD: delta}, {}

    def committed_u(self, like: Sequence[NDArray]) -> list[NDArray]:
        r"""Return the committed :math:`u_i`, or zeros when the client holds none.

        Parameters
        ----------
        like : Sequence[NDArray]
            This round's :math:`u_i` (the reply layout), for the zeros and
            the shape check.

        Returns
        -------
        list[NDArray]
            One array per ``state_dict`` entry. Zeros for a client without
            committed state: it cannot know :math:`\theta^0`, and its
            ``state-round`` (-1) tells the server to subtract it.

        Raises
        ------
        ValueError
            If the saved :math:`u_i` does not match the model's layout.
        """
        saved = self.state.get(U_STATE)
        if saved is None:
            return [np.zeros_like(a) for a in like]
        if len(saved) != len(like) or any(
            s.shape != a.shape for s, a in zip(saved, like, strict=True)
        ):
            raise ValueError(
                f"client state '{U_STATE}' does not match the model's layout"
            )
        return saved


class FedADMMClient(TorchClient):
    r"""FedADMM client: :class:`FedADMMRule` in the pack's training loop.

    Local SGD (or Adam) on the augmented Lagrangian, however many steps its
    epochs or the server's ``local-steps`` give it, then the dual step; it
    keeps :math:`\lambda_i` and :math:`u_i` in ``context.state`` (mirrored to
    ``state_dir`` when given).

    Parameters
    ----------
    *args, **kwargs
        As :class:`~flwr_prox_strategies.extend.TorchClient`.

    Raises
    ------
    ValueError
        If a keyword argument of the base is out of range.
    """

    protocol = "FedADMM"
    rule_class = FedADMMRule


__all__ = ["AugmentedLagrangianGradient", "FedADMMClient", "FedADMMRule"]

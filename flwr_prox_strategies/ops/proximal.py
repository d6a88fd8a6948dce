"""Proximal terms: the gradient of ``(mu/2) ||w - w_anchor||^2``.

The FedProx penalty is *squared*: its gradient ``mu (w - w_anchor)`` vanishes at
the anchor and grows linearly away from it. (Libraries that write
``(mu/2) ||w - w_anchor||`` without the square get a gradient of constant norm
``mu/2`` that never vanishes and does not define the proximal operator.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def proximal_value(
    params: Sequence[torch.Tensor], anchor: Sequence[torch.Tensor], mu: float
) -> float:
    """Return ``(mu/2) * sum ||p - a||^2``."""
    total = sum(
        float(((p.detach() - a) ** 2).sum())
        for p, a in zip(params, anchor, strict=True)
    )
    return 0.5 * mu * total


def _kept(tensors: Sequence[torch.Tensor], copy: bool) -> list[torch.Tensor]:
    return [t.detach().clone() if copy else t.detach() for t in tensors]


class ProximalTerm:
    r"""Gradient of :math:`\frac{\mu}{2}\lVert w - a\rVert^2 + \langle s, w\rangle`.

    One term serves the proximal family: FedProx (``shift=None``), FedDyn
    (anchor :math:`\theta_t`, shift :math:`\mu\lambda_k`), FedDC (anchor
    :math:`w - h_i`, shift :math:`c - c_i`) and SCAFFOLD (``mu=0``, shift
    :math:`c - c_i`).

    Parameters
    ----------
    mu : float
        Penalty constant, >= 0.
    anchor : Sequence[torch.Tensor]
        The centre :math:`a`, aligned with the trainable parameters.
    shift : Sequence[torch.Tensor] | None
        The constant linear part :math:`s` of the gradient (None: zero).
    decoupled : bool
        When True the :math:`\mu w` part is left out because the optimiser's
        weight decay carries it (the official FedDyn code does this; it keeps that
        part out of gradient clipping).
    copy : bool (default: True)
        Keep copies of ``anchor`` and ``shift``. False keeps the tensors
        given, detached, and saves two model-sized copies: for a caller that
        never changes them in place afterwards (the pack's rules, whose anchor
        and shift are their own, computed once a round).
    """

    def __init__(
        self,
        mu: float,
        anchor: Sequence[torch.Tensor],
        shift: Sequence[torch.Tensor] | None = None,
        *,
        decoupled: bool = False,
        copy: bool = True,
    ) -> None:
        if not mu >= 0:
            raise ValueError(f"mu must be >= 0, got {mu!r}")
        self.mu = float(mu)
        self.anchor = _kept(anchor, copy)
        self.shift = None if shift is None else _kept(shift, copy)
        self.decoupled = decoupled

    def add_(self, params: Sequence[torch.Tensor]) -> None:
        """Add ``mu (p - anchor) + shift`` to each ``p.grad`` in place."""
        if self.mu == 0.0 and self.shift is None:
            return  # exactly FedAvg's step, bit for bit
        shifts: list[torch.Tensor | None] = (
            list(self.shift) if self.shift is not None else [None] * len(self.anchor)
        )
        for p, a, s in zip(params, self.anchor, shifts, strict=True):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.mu != 0.0:
                if self.decoupled:
                    p.grad.add_(a, alpha=-self.mu)
                else:
                    p.grad.add_(p.detach() - a, alpha=self.mu)
            if s is not None:
                p.grad.add_(s)

    def value(self, params: Sequence[torch.Tensor]) -> float:
        """Return the penalty ``(mu/2) ||p - anchor||^2 + <shift, p>``."""
        total = proximal_value(params, self.anchor, self.mu)
        if self.shift is not None:
            total += sum(
                float((p.detach() * s).sum())
                for p, s in zip(params, self.shift, strict=True)
            )
        return total

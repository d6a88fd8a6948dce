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


class ProximalTerm:
    """Gradient term ``mu (w - w_anchor)`` of the squared proximal penalty.

    Parameters
    ----------
    mu : float
        Penalty constant, >= 0.
    anchor : Sequence[torch.Tensor]
        The centre ``w_anchor`` (FedProx: the global model of the round),
        detached copies aligned with the trainable parameters.
    """

    def __init__(self, mu: float, anchor: Sequence[torch.Tensor]) -> None:
        if not mu >= 0:
            raise ValueError(f"mu must be >= 0, got {mu!r}")
        self.mu = float(mu)
        self.anchor = [a.detach().clone() for a in anchor]

    def add_(self, params: Sequence[torch.Tensor]) -> None:
        """Add ``mu (p - anchor)`` to each ``p.grad`` in place."""
        if self.mu == 0.0:
            return  # exactly FedAvg's step, bit for bit
        for p, a in zip(params, self.anchor, strict=True):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.add_(p.detach() - a, alpha=self.mu)

    def value(self, params: Sequence[torch.Tensor]) -> float:
        """Return the penalty ``(mu/2) ||p - anchor||^2``."""
        return proximal_value(params, self.anchor, self.mu)

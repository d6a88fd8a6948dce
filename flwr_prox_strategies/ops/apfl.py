r"""APFL's maths (Deng et al., 2020): mixture, personal step, alpha, averages.

The update and the weighted final models: ``docs/algorithms/apfl.md``. Pure
functions on tensors (or numpy arrays on the server): they return new values and
leave their arguments untouched. Torch is imported by the functions that need it,
so that the server's averages load without it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:  # the server's averages need no torch: imported where used
    import torch
    from torch import nn

T = TypeVar("T", float, "torch.Tensor")


def averaging_weight(step: int, a: float) -> float:
    r"""Return :math:`p_t = (t + a)^2`, the weight of step :math:`t` (from 1)."""
    return (step + a) ** 2


def averaging_weight_sum(first: int, last: int, a: float) -> float:
    r"""Return :math:`\sum_{t=first}^{last}(t + a)^2` (0 when ``last < first``)."""
    if last < first:
        return 0.0
    if first < 1:
        raise ValueError(f"steps are counted from 1, got first={first}")

    def squares(n: int) -> int:  # 1^2 + ... + n^2, exact in integers
        return n * (n + 1) * (2 * n + 1) // 6

    def naturals(n: int) -> int:
        return n * (n + 1) // 2

    count = last - first + 1
    return float(
        squares(last)
        - squares(first - 1)
        + 2 * a * (naturals(last) - naturals(first - 1))
        + count * a * a
    )


def average_offset(condition_number: float, sync_gap: int) -> float:
    r"""Return :math:`a = \max(128\kappa, \tau)`, the offset in :math:`\eta_t, p_t`."""
    return max(128.0 * condition_number, float(sync_gap))


def add_weighted(
    total: Mapping[str, NDArray] | None, mean: Mapping[str, NDArray], weight: float
) -> dict[str, NDArray]:
    r"""Return ``total + weight * mean`` in float64 (``total=None``: from zero).

    The server's :math:`\sum_t p_t\,\mathrm{mean}_S\theta_k^t`, one round's
    :math:`p`-weighted mean (``mean``, weighted by the round's
    :math:`\sum p_t`) at a time.
    """
    if total is None:
        new = {key: np.zeros(value.shape, np.float64) for key, value in mean.items()}
    else:
        new = {key: np.array(value, copy=True) for key, value in total.items()}
    for key, value in mean.items():
        new[key] += weight * value
    return new


def decay_rate(step: int, mu: float, a: float) -> float:
    r"""Return the APFL paper's decaying rate :math:`\eta_t = 16/(\mu(t + a))`."""
    return 16.0 / (mu * (step + a))


def mix(alpha: float | torch.Tensor, personal: T, shared: T) -> T:
    r"""Return :math:`\alpha\,personal + (1-\alpha)\,shared` (parameters or outputs).

    ``alpha`` may be a tensor that requires grad: output mixing learns
    :math:`\alpha` through this product.
    """
    return alpha * personal + (1 - alpha) * shared  # type: ignore[return-value]


def mixture(
    alpha: float, omega: Sequence[torch.Tensor], theta: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    r"""Return :math:`\bar\omega = \alpha\omega + (1-\alpha)\theta`, parameter-wise."""
    return [mix(alpha, w, th) for w, th in zip(omega, theta, strict=True)]


def personal_gradient(
    mixture_grads: Sequence[torch.Tensor], alpha: float, form: str
) -> list[torch.Tensor]:
    r"""Return :math:`\omega`'s gradient from :math:`\nabla f(\bar\omega)`.

    ``"mixture"``: :math:`\nabla f(\bar\omega)` itself (the gradient at the mixture);
    ``"chain"``: :math:`\nabla_\omega f(\bar\omega) = \alpha\nabla f(\bar\omega)`.
    """
    if form not in ("mixture", "chain"):
        raise ValueError(f"personal gradient form must be mixture or chain: {form!r}")
    scale = 1.0 if form == "mixture" else alpha
    return [scale * g for g in mixture_grads]


def gradient_at_mixture(
    model: nn.Module,
    names: Sequence[str],
    point: Sequence[torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    untracked: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    r"""Return :math:`f(\bar\omega)` on the batch and :math:`\nabla f(\bar\omega)`.

    ``model`` is evaluated with its trainable parameters ``names`` set to
    ``point`` (:math:`\bar\omega`, which is made to require grad), inside
    ``untracked()`` (no per-sample gradients under DP-SGD).
    """
    import torch  # a client's maths: the server's averages above need none

    mixed = {name: p.requires_grad_() for name, p in zip(names, point, strict=True)}
    with untracked():
        out = torch.func.functional_call(model, mixed, (inputs,))
        loss = loss_fn(out, targets)
        return loss, torch.autograd.grad(loss, list(mixed.values()))


def alpha_gradient(
    omega: Sequence[torch.Tensor],
    theta: Sequence[torch.Tensor],
    mixture_grads: Sequence[torch.Tensor],
) -> float:
    r"""Return :math:`\langle\omega - \theta, \nabla f(\bar\omega)\rangle`.

    The derivative of :math:`f(\bar\omega)` in :math:`\alpha`, at the mixture.
    """
    return sum(
        float(((w.detach() - th.detach()) * g).sum())
        for w, th, g in zip(omega, theta, mixture_grads, strict=True)
    )


def alpha_update(alpha: float, lr: float, grad: float) -> float:
    r"""Return :math:`\alpha - \eta\,\partial_\alpha f`, clipped to :math:`[0, 1]`."""
    return min(1.0, max(0.0, alpha - lr * grad))


def normalised(
    sums: Sequence[torch.Tensor], total: float, like: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    r"""Return :math:`\sum_t p_t x^t / \sum_t p_t`, each in the dtype of ``like``."""
    return [(s / total).to(x.dtype) for s, x in zip(sums, like, strict=True)]


def caught_up(
    sums: Sequence[torch.Tensor], omega: Sequence[torch.Tensor], idle: float
) -> list[torch.Tensor]:
    r"""Return :math:`\sum_t p_t\omega^t` plus ``idle`` :math:`\cdot\,\omega`.

    Steps a client was not sampled for count with its unchanged :math:`\omega`;
    ``idle`` is their :math:`\sum p_t`. The sums are float64.
    """
    return [
        acc + idle * w.detach().double() for acc, w in zip(sums, omega, strict=True)
    ]


def personal_sum(
    saved: Sequence[Any] | None,
    last: int,
    omega: Sequence[torch.Tensor],
    up_to: int,
    a: float,
) -> list[torch.Tensor]:
    r"""Return :math:`\sum_{t\le up\_to} p_t\omega^t`, from ``saved`` (to ``last``).

    ``saved=None``: from zero (``last`` is then 0); the steps after ``last``
    count with the unchanged :math:`\omega` (:func:`caught_up`).
    """
    import torch

    if saved is None:
        total = [torch.zeros_like(w, dtype=torch.float64) for w in omega]
    else:
        total = [torch.as_tensor(s, dtype=torch.float64) for s in saved]
    return caught_up(total, omega, averaging_weight_sum(last + 1, up_to, a))

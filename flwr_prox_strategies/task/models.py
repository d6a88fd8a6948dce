"""Small classifiers used by the experiments (PyTorch).

Every model is built from keyword arguments only, so that a Hydra config can
instantiate it with ``_target_``, and returns raw logits (no softmax) so that it
pairs with :class:`torch.nn.CrossEntropyLoss`. Parameters are float32 whatever
the torch default dtype, and initialisation draws only from torch's global
generator, so ``torch.manual_seed`` before construction makes it reproducible.
No model uses batch normalisation, which keeps them usable with per-sample
gradient tools such as Opacus.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..ops.checks import check_int

__all__ = ["CNN", "MLP", "LogisticRegression", "PaperLogistic"]

_DTYPE = torch.float32


class LogisticRegression(nn.Module):
    """Multinomial logistic regression: one linear layer producing logits.

    Parameters
    ----------
    in_features : int, default 64
        Number of input features (64 for the 8x8 digits images).
    num_classes : int, default 10
        Number of output logits.

    Raises
    ------
    ValueError
        If ``in_features`` or ``num_classes`` is not an integer >= 1.
    """

    def __init__(self, *, in_features: int = 64, num_classes: int = 10) -> None:
        super().__init__()
        self.in_features = check_int("in_features", in_features, 1)
        self.num_classes = check_int("num_classes", num_classes, 1)
        self.linear = nn.Linear(self.in_features, self.num_classes, dtype=_DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``(N, num_classes)`` for any ``(N, ...)`` input."""
        return self.linear(x.flatten(1))


class MLP(nn.Module):
    """Fully connected ReLU network.

    The default is the 784-200-200-10 network of the FedAvg and FedProx papers;
    with ``in_features=64`` it is the same architecture for the digits data.

    Parameters
    ----------
    in_features : int, default 784
        Number of input features.
    hidden : Sequence[int]
        Width of each hidden layer; an empty sequence gives a linear model.
        Default ``(200, 200)``.
    num_classes : int, default 10
        Number of output logits.

    Raises
    ------
    ValueError
        If ``in_features``, ``num_classes`` or a width of ``hidden`` is not an
        integer >= 1, or ``hidden`` is not a sequence.

    References
    ----------
    H. B. McMahan et al., "Communication-Efficient Learning of Deep Networks
    from Decentralized Data", AISTATS 2017 (the 2NN); T. Li et al.,
    "Federated Optimization in Heterogeneous Networks", MLSys 2020.
    """

    def __init__(
        self,
        *,
        in_features: int = 784,
        hidden: Sequence[int] = (200, 200),
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        self.in_features = check_int("in_features", in_features, 1)
        self.num_classes = check_int("num_classes", num_classes, 1)
        if isinstance(hidden, str | bytes) or not isinstance(hidden, Sequence):
            # The pack reports every bad argument as ValueError naming it.
            raise ValueError(f"hidden must be a sequence of ints, got {hidden!r}")
        # Hydra hands over a ListConfig; a plain tuple keeps the module picklable.
        self.hidden = tuple(check_int("hidden", h, 1) for h in hidden)
        layers: list[nn.Module] = []
        width = self.in_features
        for size in self.hidden:
            layers += [nn.Linear(width, size, dtype=_DTYPE), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, self.num_classes, dtype=_DTYPE))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``(N, num_classes)`` for any ``(N, ...)`` input."""
        return self.net(x.flatten(1))


class CNN(nn.Module):
    """The FedAvg paper's CNN: two 5x5 conv + ReLU + 2x2 max-pool blocks.

    The blocks have 32 and 64 channels and "same" padding, followed by a
    512-unit ReLU layer and a linear layer to the logits (1,663,370 parameters
    for 28x28 grey images).

    Parameters
    ----------
    in_channels : int, default 1
        Number of image channels.
    num_classes : int, default 10
        Number of output logits.
    image_size : int, default 28
        Height and width of the (square) input images; at least 4 so that
        both poolings keep a non-empty feature map.

    Raises
    ------
    ValueError
        If ``in_channels`` or ``num_classes`` is not an integer >= 1, or
        ``image_size`` is below 4.

    References
    ----------
    H. B. McMahan et al., "Communication-Efficient Learning of Deep Networks
    from Decentralized Data", AISTATS 2017. https://arxiv.org/abs/1602.05629
    """

    def __init__(
        self, *, in_channels: int = 1, num_classes: int = 10, image_size: int = 28
    ) -> None:
        super().__init__()
        self.in_channels = check_int("in_channels", in_channels, 1)
        self.num_classes = check_int("num_classes", num_classes, 1)
        self.image_size = check_int("image_size", image_size, 1)
        if self.image_size < 4:
            raise ValueError(f"image_size must be at least 4, got {image_size!r}")
        self.features = nn.Sequential(
            nn.Conv2d(self.in_channels, 32, kernel_size=5, padding=2, dtype=_DTYPE),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=5, padding=2, dtype=_DTYPE),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        side = self.image_size // 2 // 2
        self.classifier = nn.Sequential(
            nn.Linear(64 * side * side, 512, dtype=_DTYPE),
            nn.ReLU(),
            nn.Linear(512, self.num_classes, dtype=_DTYPE),
        )

    def _as_images(self, x: torch.Tensor) -> torch.Tensor:
        """Reshape flat ``(N, C*H*W)`` or channel-less ``(N, H, W)`` input."""
        size = self.image_size
        if x.dim() == 4:
            return x
        if x.dim() == 3 and self.in_channels == 1:
            return x.unsqueeze(1)
        if x.dim() == 2 and x.shape[1] == self.in_channels * size * size:
            return x.reshape(x.shape[0], self.in_channels, size, size)
        raise ValueError(
            f"x must have shape (N, {self.in_channels}, {size}, {size}) or "
            f"(N, {self.in_channels * size * size}), got {tuple(x.shape)}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``(N, num_classes)``."""
        return self.classifier(self.features(self._as_images(x)).flatten(1))


class PaperLogistic(nn.Module):
    r"""The FedEPM paper's model: binary logistic regression without an intercept.

    One weight vector :math:`x \in \mathbb{R}^n`, no bias, started at 0 (the
    official code's :math:`x^0`). The forward pass returns the two logits
    :math:`(0, \langle a, x\rangle)`, so the pack's cross-entropy is exactly the
    paper's loss :math:`\ln(1 + e^{\langle a, x\rangle}) - b\langle a,
    x\rangle` and the argmax is its sign rule.

    Why not ``model=logreg``
    (:class:`~flwr_prox_strategies.task.models.LogisticRegression`) for FedEPM
    on Adult: FedEPM's default :math:`\eta` (about :math:`10^{-5}`) and
    :math:`r_0` make a local step :math:`1/(\mu_i/d_i + \eta)` of order
    :math:`10^4`-:math:`10^5` on the mean loss, tuned for these unit-length
    feature columns, whose curvature is of order :math:`1/d`. The intercept's
    feature is the constant 1 (curvature about 0.2, thousands of times more), so
    the bias jumps by thousands and the model is a constant predictor flipping
    sign every round. Without the bias, the two-logit softmax still
    doubles the step on the logit difference (and its noise by :math:`2\sqrt2`),
    which alone makes the iterates oscillate.

    Parameters
    ----------
    in_features : int
        :math:`n` (14 on Adult).
    num_classes : int (default: 2)
        Must be 2 (accepted so that the ``model=logreg`` keys compose).
    """

    def __init__(self, *, in_features: int, num_classes: int = 2) -> None:
        super().__init__()
        check_int("in_features", in_features, 1)
        if num_classes != 2:
            raise ValueError(
                f"PaperLogistic is a binary classifier: num_classes must be 2, "
                f"got {num_classes!r}"
            )
        self.in_features = int(in_features)
        self.weight = nn.Parameter(torch.zeros(1, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r"""Return the logits :math:`(0, \langle a, x\rangle)`, shape ``(N, 2)``."""
        z = x.flatten(1) @ self.weight.T
        return torch.cat([torch.zeros_like(z), z], dim=1)

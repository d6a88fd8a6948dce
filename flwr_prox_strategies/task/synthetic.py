"""The FedProx paper's synthetic federations, synthetic(alpha, beta) and IID.

T. Li et al., "Federated Optimization in Heterogeneous Networks" (MLSys 2020),
Section 5.1, generated as the authors' ``generate_synthetic.py`` does (the
generative model: ``docs/howto/partitions.md``). Random numbers are drawn from one
``numpy.random.RandomState(seed)`` in the official script's order, so that its
draws under ``np.random.seed(seed)`` are these; the shuffles come after, from the
same stream (the official script shuffled with Python's unseeded ``random``).
"""

from __future__ import annotations

import numpy as np

from ..ops.checks import check_int, check_non_negative
from .datasets import ArrayDataset, TrainTest

__all__ = ["client_sizes", "load_synthetic"]

# The official generator's constants.
_SIZE_MEAN, _SIZE_SIGMA, _SIZE_FLOOR = 4.0, 2.0, 50
_COVARIANCE_DECAY = 1.2


def client_sizes(rng: np.random.RandomState, num_clients: int) -> np.ndarray:
    """Draw the clients' sample counts: ``floor(LogNormal(4, 2)) + 50`` each."""
    sizes = rng.lognormal(_SIZE_MEAN, _SIZE_SIGMA, num_clients).astype(np.int64)
    return sizes + _SIZE_FLOOR


def load_synthetic(
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    iid: bool = False,
    num_clients: int = 30,
    dimension: int = 60,
    num_classes: int = 10,
    train_fraction: float = 0.9,
    seed: int = 0,
) -> TrainTest:
    """Generate one synthetic federation of the FedProx paper.

    Parameters
    ----------
    alpha : float, default 1.0
        Spread of the clients' local models (``u_k ~ N(0, alpha)``), >= 0.
    beta : float, default 1.0
        Spread of the clients' input means (``B_k ~ N(0, beta)``), >= 0.
    iid : bool, default False
        One model for all clients and input means ``B_k`` in every coordinate:
        the paper's synthetic-IID with ``alpha = beta = 0``.
    num_clients : int, default 30
        Clients (the paper's 30).
    dimension : int, default 60
        Features per sample (the paper's 60).
    num_classes : int, default 10
        Classes (the paper's 10), >= 2.
    train_fraction : float, default 0.9
        Share of each client's samples in its training split (``int(n * f)``
        samples), in (0, 1).
    seed : int, default 0
        Seed of every draw; the same seed gives the same federation.

    Returns
    -------
    TrainTest
        Pooled train and test splits, client by client, with ``train_owners``
        and ``test_owners`` naming each sample's client (``partition=natural``).

    Raises
    ------
    ValueError
        If an argument is out of range, naming it.
    """
    alpha = check_non_negative("alpha", alpha)
    beta = check_non_negative("beta", beta)
    num_clients = check_int("num_clients", num_clients, 1)
    dimension = check_int("dimension", dimension, 1)
    num_classes = check_int("num_classes", num_classes, 2)
    seed = check_int("seed", seed, 0)
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction!r}")

    rng = np.random.RandomState(seed)
    sizes = client_sizes(rng, num_clients)
    model_means = rng.normal(0.0, alpha, num_clients)  # u_k, for W_k and b_k
    input_shifts = rng.normal(0.0, beta, num_clients)  # B_k
    covariance = np.diag(np.arange(1, dimension + 1, dtype=np.float64) ** -1.2)
    if iid:
        input_means = np.outer(input_shifts, np.ones(dimension))
        shared_w = rng.normal(0.0, 1.0, (dimension, num_classes))
        shared_b = rng.normal(0.0, 1.0, num_classes)
    else:
        input_means = np.stack([rng.normal(s, 1.0, dimension) for s in input_shifts])

    samples = []
    for k in range(num_clients):
        # Drawn in IID mode too (then replaced), as the official script does.
        w = rng.normal(model_means[k], 1.0, (dimension, num_classes))
        b = rng.normal(model_means[k], 1.0, num_classes)
        if iid:
            w, b = shared_w, shared_b
        x = rng.multivariate_normal(input_means[k], covariance, int(sizes[k]))
        # argmax of the logits = argmax of the official softmax (monotone).
        samples.append((x, np.argmax(x @ w + b, axis=1)))

    train_x, train_y, test_x, test_y, train_owner, test_owner = ([] for _ in range(6))
    for k, (x, y) in enumerate(samples):
        order = rng.permutation(len(x))
        x, y = x[order], y[order]
        cut = int(train_fraction * len(x))
        train_x.append(x[:cut])
        train_y.append(y[:cut])
        test_x.append(x[cut:])
        test_y.append(y[cut:])
        train_owner.append(np.full(cut, k, dtype=np.int64))
        test_owner.append(np.full(len(x) - cut, k, dtype=np.int64))

    name = "synthetic-iid" if iid else f"synthetic({alpha:g},{beta:g})"
    return TrainTest(
        train=ArrayDataset(
            np.concatenate(train_x), np.concatenate(train_y), num_classes
        ),
        test=ArrayDataset(np.concatenate(test_x), np.concatenate(test_y), num_classes),
        name=name,
        num_features=dimension,
        num_classes=num_classes,
        train_owners=np.concatenate(train_owner),
        test_owners=np.concatenate(test_owner),
    )

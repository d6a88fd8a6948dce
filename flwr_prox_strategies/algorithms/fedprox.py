r"""FedProx (Li et al., MLSys 2020), as the paper defines it.

T. Li, A. K. Sahu, M. Zaheer, M. Sanjabi, A. Talwalkar and V. Smith,
"Federated Optimization in Heterogeneous Networks", MLSys 2020
(arXiv:1812.06127); official code: github.com/litian96/FedProx. The update as
implemented, the :math:`\gamma` stop, the stragglers, the dissimilarity and the
deviations: the pack's FedProx page (``docs/algorithms/fedprox.md``).
"""

from __future__ import annotations

from typing import Any

from ..core.contract.validation import resolve_alias
from ..core.server.strategy import ValidatedFedAvg
from ..ops.checks import check_non_negative

#: The train-config key of :math:`\mu` (Flower's own FedProx sends the same key).
PROXIMAL_MU_KEY = "proximal-mu"
#: Reported by clients that add the proximal term (FedProxRule).
PROXIMAL_MU_APPLIED_KEY = "proximal-mu-applied"


class FedProx(ValidatedFedAvg):
    r"""FedProx strategy: FedAvg's server plus ``proximal-mu`` for the clients.

    Each sampled client approximately minimises the paper's local objective
    :math:`h_k(\theta; \theta_t) = f_k(\theta) + \frac{\mu}{2}\lVert\theta -
    \theta_t\rVert^2` (Li et al., 2020, Section 3); the server averages the
    models (by sample counts, as the official code; ``weighting="uniform"`` is
    the paper's Algorithm 2). Stragglers (``drop_percent``) keep their partial
    work. With ``mu=0`` and no stragglers it equals :class:`FedAvg` bit for bit.

    Parameters
    ----------
    mu : float | None (default: None)
        Proximal penalty constant :math:`\mu \ge 0`; None: 0.01. 0 gives FedAvg.
    proximal_mu : float | None (default: None)
        Flower's name for ``mu`` (``flwr.serverapp.strategy.FedProx``); give
        one of the two.
    **kwargs
        Keyword arguments of :class:`FedAvg` (``fraction_train``,
        ``weighting``, ``local_epochs``, ``drop_percent``, ``seed``,
        ``monitor_dissimilarity``, ...).

    Raises
    ------
    ValueError
        If ``mu`` is negative or not finite, or a keyword argument of
        :class:`FedAvg` is out of range (naming it).
    TypeError
        If both ``mu`` and ``proximal_mu`` are given, or a keyword is unknown.

    Notes
    -----
    The client side of the contract (:class:`FedProxClient` implements it)::

        mu = config["proximal-mu"]
        loss.backward()
        for p, p_global in zip(params, global_params):
            p.grad += mu * (p - p_global)     # gradient of (mu/2)||w - w_t||^2
        optimizer.step()

    and reports ``proximal-mu-applied`` in its reply's metrics, the number of
    its steps whose update held the term (measured, beside ``local-steps``):
    replies without it, or with fewer applied steps than local steps, are
    named in a warning (once per run), or rejected with ``strict=True``.

    References
    ----------
    T. Li, A. K. Sahu, M. Zaheer, M. Sanjabi, A. Talwalkar and V. Smith,
    "Federated Optimization in Heterogeneous Networks", MLSys 2020.
    https://arxiv.org/abs/1812.06127; official code:
    https://github.com/litian96/FedProx
    """

    straggler_policy = "keep-partial"
    rule_metric = PROXIMAL_MU_APPLIED_KEY
    rule_name = "FedProx's proximal term"
    settings = ("mu", "weighting", "seed")

    def __init__(
        self,
        *,
        mu: float | None = None,
        proximal_mu: float | None = None,
        **kwargs: Any,
    ) -> None:
        mu = resolve_alias(
            type(self).__name__, "mu", mu, "proximal_mu", proximal_mu, 0.01
        )
        check_non_negative("mu", mu)
        super().__init__(**kwargs)
        self.mu = float(mu)

    def train_config(self, server_round: int) -> dict[str, Any]:
        """Send ``proximal-mu`` every round."""
        return {PROXIMAL_MU_KEY: self.mu}


#: The configurations the conformance checks run (``flwr_prox_strategies.testing``),
#: name -> factory taking the number of nodes; together they set every state field.
CASES = {
    "default": lambda n: FedProx(mu=0.1, min_available_nodes=n),
    "monitor": lambda n: FedProx(
        mu=0.1, min_available_nodes=n, monitor_dissimilarity=True
    ),
}


__all__ = ["PROXIMAL_MU_APPLIED_KEY", "PROXIMAL_MU_KEY", "FedProx"]

r"""Distributed DP under SecAgg+: the settings, each round's encoding, the account.

:class:`DistributedDP` is what a user gives
:class:`~flwr_prox_strategies.SecAggPlus` (``distributed_dp=``): every client
clips the concatenation of every record the strategy sums, adds its share of
discrete noise to its integer upload, and the server sees only the noisy sum
(Kairouz, Liu & Steinke, ICML 2021; Agarwal, Kairouz & Liu, NeurIPS 2021). For
each round it picks the finest granularity whose modular sum cannot wrap
(:meth:`DistributedDP.encoding`) and charges the round's Renyi DP, with the
fewest contributors the reconstruction threshold allows, to the run's
:class:`Account`. The maths: :mod:`flwr_prox_strategies.ops.privacy`; the
trust model and the table of the pack's four kinds of DP: the privacy page.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from flwr.serverapp.strategy import Result
from numpy.typing import NDArray

from ...ops.checks import (
    check_choice,
    check_int,
    check_positive,
    check_probability,
)
from ...ops.privacy.accounting import (
    DEFAULT_ORDERS,
    ddg_rdp,
    integer_l1_bound,
    rdp_to_epsilon,
    skellam_rdp,
)
from ...ops.privacy.encoding import DDPSettings, check_bits
from ...ops.privacy.quantise import smallest_safe_bits
from ..server.outcome import EveryClientRetiredError
from ..transport.ddp import sensitivity

#: Masks are 32-bit words: distributed DP's modulus is at most 2**32.
MAX_BITS = 32


@dataclass(frozen=True, kw_only=True)
class DistributedDP:
    r"""User-level DP against the server: each client noises its share of the sum.

    Give it to :class:`~flwr_prox_strategies.SecAggPlus`
    (``SecAggPlus(strategy, distributed_dp=DistributedDP(...))``). Each client
    clips the concatenation of every record the strategy sums (the model's
    change, SCAFFOLD's and FedDC's control deltas, FedDyn's drift) to L2 norm
    ``l2_clip``, rotates it with a randomised Hadamard transform seeded per
    round, scales and rounds it to integers (conditional randomised
    rounding), adds discrete Gaussian (or Skellam) noise of variance
    :math:`(z\,C/\gamma)^2/n` (:math:`n` = ``expected_clients``) and masks
    it modulo :math:`2^b`; the server unmasks the sum, rotates back and
    rescales, so the rule sees noisy sums only. The privacy of every round is
    charged with the fewest contributors the threshold allows (a dropped
    client's noise is missing) and composed over the run (RDP).

    Parameters
    ----------
    noise_multiplier : float
        :math:`z > 0`: the sum's noise standard deviation over ``l2_clip``
        when ``expected_clients`` contribute (TFF's ``noise_multiplier``).
    l2_clip : float
        :math:`C > 0`: the L2 bound of one client's whole upload, every
        record together.
    expected_clients : int
        :math:`n \geq 1`: the clients a round samples; the noise is split
        over them.
    bits : int (default: 20)
        :math:`b \in [2, 32]`: the sum is masked modulo :math:`2^b`. Fewer
        bits mean a coarser granularity (each round picks the finest that
        cannot wrap) and a larger sensitivity.
    mechanism : str (default: "gaussian")
        ``"gaussian"``, the distributed discrete Gaussian, or ``"skellam"``,
        the Skellam mechanism.
    delta : float (default: 1e-5)
        :math:`\delta \in (0, 1)` of the reported :math:`(\varepsilon,
        \delta)`.
    target_epsilon : float | None (default: None)
        The run's budget: a round that would take :math:`\varepsilon` past it
        is not started (:class:`PrivacyBudgetSpentError`). None: no budget.
    denominator : str (default: "contributors")
        What a mean divides the noisy sum by: ``"contributors"``, the
        round's (unbiased when clients drop), or ``"expected"``,
        ``expected_clients`` (TFF's fixed denominator). Means are uniform: a
        weighted mean would let a client's weight scale its sensitivity, so
        the strategy must weigh uniformly.
    colluding : int (default: 0)
        :math:`k \geq 0`: clients assumed to give the server their own noise
        (or to add none); each round is charged with :math:`t - k` noisy
        contributors, :math:`t` the reconstruction threshold. A round whose
        threshold is not above :math:`k` is not started.
    beta : float, optional
        :math:`\beta \in (0, 1)` of the conditional rounding; by default
        :math:`e^{-1/2}`, as in Kairouz, Liu & Steinke (2021).

    Raises
    ------
    ValueError
        A parameter out of range (named), or ``bits`` too small for
        ``expected_clients`` even at the coarsest granularity (the message
        names the smallest width that works).
    """

    noise_multiplier: float
    l2_clip: float
    expected_clients: int
    bits: int = 20
    mechanism: Literal["gaussian", "skellam"] = "gaussian"
    delta: float = 1e-5
    target_epsilon: float | None = None
    denominator: Literal["contributors", "expected"] = "contributors"
    colluding: int = 0
    beta: float = math.exp(-0.5)

    def __post_init__(self) -> None:
        """Refuse a parameter out of range, naming it."""
        check_positive("noise_multiplier", self.noise_multiplier)
        check_positive("l2_clip", self.l2_clip)
        check_int("expected_clients", self.expected_clients, 1)
        check_int("bits", self.bits, 2)
        if self.bits > MAX_BITS:
            raise ValueError(
                f"bits must be <= {MAX_BITS} (SecAgg+ masks 32-bit words), "
                f"got {self.bits}"
            )
        check_choice("mechanism", self.mechanism, ("gaussian", "skellam"))
        check_probability("delta", self.delta)
        if self.target_epsilon is not None:
            check_positive("target_epsilon", self.target_epsilon)
        check_choice("denominator", self.denominator, ("contributors", "expected"))
        check_int("colluding", self.colluding, 0)
        check_probability("beta", self.beta)
        # At the coarsest granularity each client's coordinate is a rounded
        # zero (|x| <= 1) with almost no noise: below this width nothing fits.
        least = smallest_safe_bits(
            num_clients=int(self.expected_clients), linf_bound=1.0, noise_stddev=1.0
        )
        if self.bits < least:
            raise ValueError(
                f"bits={self.bits} is too small for expected_clients="
                f"{self.expected_clients}: their sum wraps around at any "
                f"granularity; the smallest width that works is bits={least}"
            )

    def encoding(self, dim: int, sampled: int) -> DDPSettings:
        r"""Return the round's encoding: the finest granularity that cannot wrap.

        The granularity :math:`\gamma` is the smallest (to 0.1 %) for which
        ``sampled`` uploads of length ``dim``, with their noise, sum without
        wrapping modulo :math:`2^b`
        (:func:`~flwr_prox_strategies.ops.privacy.encoding.check_bits`).

        Raises
        ------
        ValueError
            No granularity fits ``sampled`` clients in ``bits`` (more clients
            than ``expected_clients`` may not fit): the message says how many do.
        """
        check_int("dim", dim, 1)
        check_int("sampled", sampled, 1)

        def at(granularity: float) -> DDPSettings:
            step = float(self.noise_multiplier) * float(self.l2_clip) / granularity
            return DDPSettings(
                l2_clip=float(self.l2_clip),
                bits=int(self.bits),
                beta=float(self.beta),
                noise=self.mechanism,
                local_variance=step**2 / int(self.expected_clients),
                granularity=granularity,
                num_clients=int(sampled),
            )

        def fits(granularity: float) -> bool:
            try:
                check_bits(at(granularity), dim)
            except ValueError:
                return False
            return True

        # log2 of gamma / C: coarse enough that a value rounds to 0 or +-1.
        coarse = math.log2(math.sqrt(dim)) + 4
        if not fits(float(self.l2_clip) * 2.0**coarse):
            raise ValueError(
                f"bits={self.bits} cannot sum {sampled} uploads of dim {dim} "
                f"(expected_clients={self.expected_clients}) at any granularity: "
                "raise bits or sample fewer clients"
            )
        fine = coarse - 64
        while coarse - fine > 1e-3:  # bisect log2(gamma / C)
            middle = (coarse + fine) / 2
            if fits(float(self.l2_clip) * 2.0**middle):
                coarse = middle
            else:
                fine = middle
        return at(float(self.l2_clip) * 2.0**coarse)

    def round_rdp(
        self, settings: DDPSettings, padded_dim: int, contributors: int
    ) -> NDArray[np.float64]:
        """Return one round's RDP at :data:`DEFAULT_ORDERS`, ``contributors`` noisy.

        ``contributors`` is the fewest clients whose noise the revealed sum
        holds (``ops.privacy.accounting.smallest_contributors``).
        """
        l2 = sensitivity(settings, padded_dim)
        l1 = integer_l1_bound(l2, padded_dim)
        variance = float(settings.local_variance)
        if self.mechanism == "gaussian":
            return ddg_rdp(
                DEFAULT_ORDERS,
                l2_sensitivity=l2,
                l1_sensitivity=l1,
                sigma2=variance,
                num_clients=int(contributors),
                dim=int(padded_dim),
            )
        return skellam_rdp(
            DEFAULT_ORDERS,
            l2_sensitivity=l2,
            l1_sensitivity=l1,
            mu=int(contributors) * variance,
        )


@dataclass
class Account:
    """The run's Renyi DP so far, composed round by round (user level).

    Every client is charged every round (a client may be sampled in each), at
    :data:`~flwr_prox_strategies.ops.privacy.accounting.DEFAULT_ORDERS`.
    """

    delta: float
    rdp: NDArray[np.float64] = field(
        default_factory=lambda: np.zeros(len(DEFAULT_ORDERS))
    )
    rounds: int = 0

    def epsilon(self, more: NDArray[np.float64] | None = None) -> float:
        """Return epsilon at ``delta`` now, or after one more round of RDP ``more``."""
        total = self.rdp if more is None else self.rdp + more
        if not total.any():
            return 0.0
        return rdp_to_epsilon(DEFAULT_ORDERS, total, self.delta)

    def charge(self, rdp: NDArray[np.float64], rounds: int = 1) -> None:
        """Add ``rounds`` rounds of RDP ``rdp``."""
        self.rdp = self.rdp + rounds * np.asarray(rdp, dtype=np.float64)
        self.rounds += rounds


class PrivacyBudgetSpentError(EveryClientRetiredError):
    """The next round would take the run past its distributed-DP budget.

    Raised by :class:`~flwr_prox_strategies.SecAggPlus`'s ``configure_train``
    before any key leaves for that round; the pack's ServerApp records it as
    the end of training (``results.json``'s ``stopped-early``), as it does when
    every DP-SGD client has retired.

    Parameters
    ----------
    message : str
        The round, the epsilon it would reach and the budget.
    result : Result
        The run so far: ``result.arrays`` is the model the round would have
        trained.
    stopped_at : int
        The round that was not started.
    """

    def __init__(self, message: str, result: Result, stopped_at: int) -> None:
        super().__init__(message, result, stopped_at)

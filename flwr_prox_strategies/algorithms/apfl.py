r"""APFL: adaptive personalised federated learning (Deng et al., 2020).

Y. Deng, M. M. Kamani and M. Mahdavi, "Adaptive Personalized Federated
Learning", 2020 (arXiv:2003.13461), Algorithm 1; official code:
github.com/MLOPTPSU/FedTorch.

Each client :math:`k` keeps a local copy :math:`\theta_k` of the global model, a
personal model :math:`\omega_k` and a mixture weight :math:`\alpha_k`; both
models take each local step from their values at :math:`t` (the maths:
``flwr_prox_strategies.ops.apfl``). One Flower round is one synchronisation
period of :math:`\tau` steps (``sync_gap``), then the server averages the
:math:`\theta_k`. The update as implemented, the weighted final models, the
state, the wire keys and the deviations from the paper and FedTorch: the pack's
APFL page (``docs/algorithms/apfl.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import ArrayRecord
from numpy.typing import NDArray

from ..core.contract.fields import RoundUpdate
from ..core.contract.validation import ValidReply
from ..core.server.strategy import ValidatedFedAvg
from ..core.transport.records import RecordSpec, dict_to_record, record_to_dict
from ..ops import apfl as maths
from ..ops.aggregate import divided_like
from ..ops.apfl import averaging_weight_sum as averaging_weight_sum
from ..ops.checks import check_choice, check_fraction, check_int, check_positive

APFL_ALPHA_KEY = "apfl-alpha"
APFL_ADAPTIVE_KEY = "apfl-adaptive-alpha"
APFL_MIXING_KEY = "apfl-mixing"
APFL_GRADIENT_KEY = "apfl-personal-gradient"
APFL_FIRST_STEP_KEY = "apfl-first-step"
APFL_AVERAGE_A_KEY = "apfl-average-a"
APFL_LR_MU_KEY = "apfl-lr-mu"
APFL_LR_A_KEY = "apfl-lr-a"
APFL_STEP_KEY = "apfl-step"
#: Reported by clients that apply APFL's rule (APFLRule).
APFL_APPLIED_KEY = "apfl-applied"
WEIGHTED_THETA_RECORD = "apfl-weighted-theta"
AVERAGE_MODEL_RECORD = "apfl-average-model"

MIXINGS = ("parameters", "outputs")
PERSONAL_GRADIENTS = ("mixture", "chain")

PERSONAL_STATE = "apfl-personal"
PERSONAL_SUM_STATE = "apfl-personal-sum"
ALPHA_STATE = "apfl-alpha"
LAST_STEP_STATE = "apfl-last-step"
LR_SCHEDULES = ("constant", "decay")


class APFL(ValidatedFedAvg):
    r"""APFL strategy: FedAvg of the clients' global copies every ``sync_gap`` steps.

    Each local step trains the client's copy :math:`\theta_k` of the global
    model and its personal model :math:`\omega_k` at the mixture
    :math:`\bar\omega_k = \alpha_k\omega_k + (1-\alpha_k)\theta_k` (Deng et
    al., 2020, Algorithm 1); the clients evaluate the personalised model beside
    the global one. Its clients are :class:`APFLClient` or your own loop with
    :class:`APFLRule`.

    Parameters
    ----------
    alpha : float (default: 0.5)
        Initial (or fixed) mixture weight :math:`\alpha \in [0, 1]`; 0 gives
        FedAvg, 1 purely local personal models.
    adaptive_alpha : bool (default: False)
        Each client learns its own :math:`\alpha_k` by gradient descent.
    sync_gap : int (default: 10)
        :math:`\tau`: local steps (mini-batches) per round, i.e. between two
        aggregations.
    mixing : str (default: "parameters")
        ``"parameters"`` (the paper) or ``"outputs"`` (the official code
        FedTorch, and FL4Health): what the personalised model mixes.
    personal_gradient : str | None (default: None)
        ``"mixture"`` (the gradient at the mixture,
        :math:`\nabla f_k(\bar\omega)`) or ``"chain"`` (the paper's Eq. (10):
        :math:`\alpha\nabla f_k(\bar\omega)`); both have the same fixed
        points. None picks "mixture" for parameter mixing and "chain" (the
        only defined one) for output mixing.
    lr_schedule : str (default: "constant")
        ``"constant"``: the clients' learning rate (times ``lr-scale``);
        ``"decay"``: :math:`\eta_t = 16/(\mu(t + a))`, the rate of the
        paper's convergence analysis.
    strong_convexity : float | None (default: None)
        :math:`\mu`, required by ``lr_schedule="decay"``.
    condition_number : float (default: 1.0)
        :math:`\kappa = L/\mu`; :math:`a = \max(128\kappa, \tau)` sets the decay
        and the averaging weights :math:`p_t = (t + a)^2`.
    weighted_average : bool (default: True)
        Keep the :math:`p_t`-weighted averages of the global and the
        personalised models that the paper's analysis returns (costs one
        more model per upload).
    **kwargs
        Keyword arguments of :class:`FedAvg` (not ``local_epochs``,
        ``local_steps`` or ``drop_percent``: APFL counts its local work in
        steps, ``sync_gap``). Here ``weighting`` defaults to ``"uniform"``
        (the paper's plain mean over the sampled clients); ``"num-examples"``
        weights by sample counts.

    Raises
    ------
    ValueError
        If ``alpha`` is outside ``[0, 1]``, ``sync_gap`` is not an integer
        >= 1, ``mixing``, ``personal_gradient`` or ``lr_schedule`` is not one
        of its choices, ``personal_gradient="mixture"`` is asked with
        ``mixing="outputs"``, ``lr_schedule="decay"`` lacks
        ``strong_convexity`` (or it is not > 0), ``condition_number`` is not
        > 0, ``local_epochs``, ``local_steps`` or ``drop_percent`` is given,
        or a keyword argument of :class:`FedAvg` is out of range.
    TypeError
        If a keyword is unknown.

    Notes
    -----
    Clients report ``apfl-applied`` (their steps that held the rule's term)
    beside ``local-steps``; replies without it are named in a warning once per
    run (rejected with ``strict=True``). Evaluation metrics: ``personal``,
    ``accuracy`` (the global model), ``personal-avg`` and ``global-avg``.

    References
    ----------
    Y. Deng, M. M. Kamani and M. Mahdavi, "Adaptive Personalized Federated
    Learning", 2020. https://arxiv.org/abs/2003.13461; official code:
    https://github.com/MLOPTPSU/FedTorch
    """

    default_weighting = "uniform"
    rule_metric = APFL_APPLIED_KEY
    rule_name = "APFL's personalised mixture"
    #: :math:`\sum_t p_t\,\mathrm{mean}_S\theta_k^t` and :math:`S_T`, over the
    #: aggregated rounds.
    #: The model is a positive combination of the replies' (NaN/inf reach it).
    model_linear_in_replies = True
    state_fields = ("average_sum", "average_weight")
    #: ``sync_gap`` numbers the steps (``apfl-first-step``).
    resume_settings = ("sync_gap", "alpha")
    settings = (
        "alpha",
        "adaptive_alpha",
        "sync_gap",
        "mixing",
        "personal_gradient",
        "lr_schedule",
        "weighted_average",
    )

    def __init__(
        self,
        *,
        alpha: float = 0.5,
        adaptive_alpha: bool = False,
        sync_gap: int = 10,
        mixing: str = "parameters",
        personal_gradient: str | None = None,
        lr_schedule: str = "constant",
        strong_convexity: float | None = None,
        condition_number: float = 1.0,
        weighted_average: bool = True,
        **kwargs: Any,
    ) -> None:
        check_fraction("alpha", alpha)
        check_int("sync_gap", sync_gap, 1)
        check_choice("mixing", mixing, MIXINGS)
        if personal_gradient is None:
            personal_gradient = "mixture" if mixing == "parameters" else "chain"
        check_choice("personal_gradient", personal_gradient, PERSONAL_GRADIENTS)
        if mixing == "outputs" and personal_gradient == "mixture":
            raise ValueError(
                "personal_gradient='mixture' is defined for mixing='parameters' "
                "only; output mixing's gradient is the chain-rule one ('chain')"
            )
        check_choice("lr_schedule", lr_schedule, LR_SCHEDULES)
        if lr_schedule == "decay":
            if strong_convexity is None:
                raise ValueError("lr_schedule='decay' needs strong_convexity (mu)")
            check_positive("strong_convexity", strong_convexity)
        check_positive("condition_number", condition_number)
        for name in ("local_epochs", "local_steps", "drop_percent"):
            if kwargs.get(name):
                raise ValueError(
                    f"APFL runs sync_gap local steps per round; {name} is not used "
                    f"(got {name}={kwargs[name]!r})"
                )
            kwargs.pop(name, None)
        super().__init__(local_steps=sync_gap, **kwargs)
        self.alpha = float(alpha)
        self.adaptive_alpha = bool(adaptive_alpha)
        self.sync_gap = sync_gap
        self.mixing = mixing
        self.personal_gradient = personal_gradient
        self.lr_schedule = lr_schedule
        self.strong_convexity = strong_convexity
        self.condition_number = float(condition_number)
        self.a = maths.average_offset(self.condition_number, sync_gap)
        self.weighted_average = bool(weighted_average)
        self.average_sum: dict[str, NDArray] | None = None
        self.average_weight = 0.0

    def first_step(self, server_round: int) -> int:
        """Global step counter :math:`t` at the start of ``server_round``."""
        return (server_round - 1) * self.sync_gap

    def train_config(self, server_round: int) -> dict[str, Any]:
        """Send the mixture settings, the step counter and the schedule."""
        config: dict[str, Any] = {
            APFL_ALPHA_KEY: self.alpha,
            APFL_ADAPTIVE_KEY: self.adaptive_alpha,
            APFL_MIXING_KEY: self.mixing,
            APFL_GRADIENT_KEY: self.personal_gradient,
            APFL_FIRST_STEP_KEY: self.first_step(server_round),
        }
        if self.weighted_average:
            config[APFL_AVERAGE_A_KEY] = self.a
        if self.lr_schedule == "decay":
            assert self.strong_convexity is not None
            config[APFL_LR_MU_KEY] = self.strong_convexity
            config[APFL_LR_A_KEY] = self.a
        return config

    def expected_train_arrays(self, server_round: int) -> dict[str, RecordSpec]:
        """Expect the model, plus its p-weighted mean over the round's steps."""
        expected = super().expected_train_arrays(server_round)
        if self.weighted_average:
            expected[WEIGHTED_THETA_RECORD] = expected[self.arrayrecord_key]
        return expected

    def secure_sums(self) -> dict[str, tuple[str, ...]]:
        r"""Declare the weighted means of the :math:`\theta_k` (and of the averages)."""
        sums: dict[str, tuple[str, ...]] = {self.arrayrecord_key: ("mean",)}
        if self.weighted_average:
            sums[WEIGHTED_THETA_RECORD] = ("mean",)
        return sums

    def server_update(
        self, server_round: int, state: Mapping[str, Any], replies: list[ValidReply]
    ) -> RoundUpdate:
        r"""Return the weighted mean of the :math:`\theta_k`; add the round's steps.

        With ``weighted_average``, the round's steps :math:`t = (r-1)\tau + 1,
        \dots, r\tau` weigh the mean of the uploaded :math:`p`-weighted means by
        their :math:`\sum p_t` into :math:`\hat\theta`'s sum and weight. The
        clients' smallest and largest :math:`\alpha_k` are the round's metrics.
        """
        new_state: dict[str, Any] = {}
        if self.weighted_average:
            mean = self.weighted_mean(replies, WEIGHTED_THETA_RECORD)
            first = self.first_step(server_round)
            weight = averaging_weight_sum(first + 1, first + self.sync_gap, self.a)
            new_state = {
                "average_sum": maths.add_weighted(state["average_sum"], mean, weight),
                "average_weight": state["average_weight"] + weight,
            }
        alphas = [
            float(v)
            for r in replies
            if isinstance(v := r.metrics.get("apfl-alpha"), (int, float))
        ]
        metrics: dict[str, Any] = (
            {"apfl-alpha-min": min(alphas), "apfl-alpha-max": max(alphas)}
            if alphas
            else {}
        )
        return RoundUpdate(
            dict_to_record(self.weighted_mean(replies)), new_state, metrics
        )

    def average_model(self) -> ArrayRecord | None:
        r"""Return :math:`\hat\theta`, the weighted global model (or None)."""
        if self.average_sum is None or self.global_arrays is None:
            return None
        model = record_to_dict(self.global_arrays)
        return dict_to_record(
            divided_like(model, self.average_sum, self.average_weight)
        )

    def central_models(self) -> dict[str, ArrayRecord]:
        """Evaluate the weighted average of the global model too."""
        model = self.average_model()
        return {} if model is None else {"central-average": model}

    def evaluate_config(self, server_round: int) -> dict[str, Any]:
        """Tell clients the mixture settings and the step count T so far."""
        config: dict[str, Any] = {
            APFL_ALPHA_KEY: self.alpha,
            APFL_MIXING_KEY: self.mixing,
            APFL_STEP_KEY: server_round * self.sync_gap,
        }
        if self.weighted_average:
            config[APFL_AVERAGE_A_KEY] = self.a
        return config

    def evaluate_records(self, server_round: int) -> dict[str, ArrayRecord]:
        r"""Send :math:`\hat\theta` so clients can evaluate :math:`\hat\omega_k`."""
        model = self.average_model()
        return {} if model is None else {AVERAGE_MODEL_RECORD: model}


#: The configurations the conformance checks run (``flwr_prox_strategies.testing``),
#: name -> factory taking the number of nodes; together they set every state field.
CASES = {
    "default": lambda n: APFL(alpha=0.5, min_available_nodes=n),
    "last-iterate": lambda n: APFL(
        alpha=0.5, adaptive_alpha=True, weighted_average=False, min_available_nodes=n
    ),
}

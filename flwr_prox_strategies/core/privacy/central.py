"""Central (user-level) DP: Flower's fixed-clipping wrappers around our strategies.

Flower's ``DifferentialPrivacyServerSideFixedClipping`` and
``DifferentialPrivacyClientSideFixedClipping`` wrap any strategy: updates are
clipped and Gaussian noise is added to the aggregated model. The subclasses here
add two things: :class:`ServerSideFixedClipping` and
:class:`ClientSideFixedClipping` hand Flower only the replies the wrapped strategy
accepts (Flower's server-side clipping would otherwise crash on, or reshape, a
malformed reply), and the constructor logs what the wrapper's epsilon does not
cover (:func:`dp_caveats`: the records replies carry besides the model, and the
strategy's declared ``central_dp_caveat``). Why, and the table of what each
strategy leaves uncovered: the documentation's privacy guide.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import WARNING
from typing import Any

from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)

from ..contract.validation import ReplyRejected
from ..docstrings import inherit_parameters
from ..server.outcome import ReplyTally
from ..server.screening import reply_node
from ..server.strategy import ValidatedFedAvg
from ..transport.keys import BUDGET_EXHAUSTED_REASON
from ..wrapper import WrappedRun

# The client half lives with the other ClientApp mods, which the ClientApp loads
# without this module's server machinery (torch through the base strategy).
from .uploads import clip_when_asked


def extra_reply_records(strategy: ValidatedFedAvg) -> list[str]:
    """Name the ArrayRecords a train reply carries besides the model."""
    return sorted(set(strategy.expected_train_arrays(1)) - {strategy.arrayrecord_key})


def dp_caveats(strategy: ValidatedFedAvg) -> list[str]:
    """Say what central DP's noise on the aggregated model does not cover.

    Flower's fixed-clipping wrappers clip each update and noise the
    aggregate; anything else a client uploads, or the server keeps from
    un-noised aggregates (the strategy's ``central_dp_caveat``), is outside
    their epsilon.
    """
    caveats = []
    if extra := extra_reply_records(strategy):
        caveats.append(
            f"replies also carry {extra}, which central DP neither clips as "
            "updates nor noises; its epsilon covers the model only"
        )
    if strategy.central_dp_caveat is not None:
        caveats.append(strategy.central_dp_caveat)
    return caveats


def screen_replies(
    strategy: ValidatedFedAvg, server_round: int, replies: Iterable[Message]
) -> list[Message]:
    """Return the replies ``strategy.aggregate_train`` would use, and error replies.

    For wrappers that read replies before this strategy does (Flower's
    central-DP wrappers, below): malformed replies are rejected
    and logged here; error replies are passed on for the wrapper's own
    policy; a client out of privacy budget is retired (absent).
    """
    errors: list[Message] = []
    others: list[Message] = []
    tally = ReplyTally()
    sent_to = strategy.screen.sent_nodes("train")
    error_nodes: set[int] = set()
    for message in replies:
        passed_on = message.has_error() and not str(message.error.reason).startswith(
            BUDGET_EXHAUSTED_REASON
        )
        (errors if passed_on else others).append(message)
        if passed_on:  # counted here: the wrapper skips the round unseen
            node_id = reply_node(message, sent_to)
            error_nodes.add(node_id)
            tally.add(node_id, ReplyRejected("error-reply", str(message.error.reason)))
    sampled = strategy.train_nodes
    valid, *_ = strategy.collect_replies(
        server_round + strategy.round_offset,
        others,
        expected_arrays=strategy.expected_train_arrays(
            server_round + strategy.round_offset
        ),
        sampled=None if sampled is None else sampled - error_nodes,
        phase="screen_train",
        tally=tally,
    )
    passed = errors + [r.message for r in valid if r.message is not None]
    # What was screened out is counted here: aggregate_train, which sees
    # only what is passed on, must not count those nodes again as silent.
    strategy.train_nodes = {reply_node(m, sent_to) for m in passed}
    return passed


class _ValidatedReplies(WrappedRun):
    """Mixin for Flower's DP wrappers: validate replies first, name what's uncovered.

    Placed before the Flower wrapper in the bases, so ``super()`` is Flower's.
    The wrappers' constructor is this one: its sections below are theirs.

    Parameters
    ----------
    strategy : Strategy
        The strategy to wrap: one of the pack's (its replies are validated
        first, and what the wrapper's epsilon does not cover is logged) or any
        Flower strategy (then Flower's wrapper alone).
    *args, **kwargs
        The rest of Flower's parameters: ``noise_multiplier`` (float, the
        Gaussian mechanism's), ``clipping_norm`` (float),
        ``num_sampled_clients`` (int, the clients sampled per round), and in
        recent Flower releases an optional ``accountant``.

    Raises
    ------
    ValueError
        As Flower's wrapper, for a negative ``noise_multiplier`` or
        ``clipping_norm`` or a non-positive ``num_sampled_clients``.
    NoRoundAggregatedError
        From ``start()``, when no round was aggregated (as the wrapped
        strategy's own ``start()``).
    """

    strategy: Strategy

    def __init__(self, strategy: Strategy, *args: Any, **kwargs: Any) -> None:
        super().__init__(strategy, *args, **kwargs)  # type: ignore[call-arg]
        if isinstance(strategy, ValidatedFedAvg):
            for caveat in dp_caveats(strategy):
                log(
                    WARNING,
                    "%s(%s): %s",
                    type(self).__name__,
                    type(strategy).__name__,
                    caveat,
                )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Drop the replies the wrapped strategy rejects, then let Flower's run."""
        if isinstance(self.strategy, ValidatedFedAvg):
            replies = screen_replies(self.strategy, server_round, replies)
        # super() is the Flower wrapper after this mixin in the bases.
        return super().aggregate_train(server_round, replies)  # type: ignore[safe-super]


@inherit_parameters(_ValidatedReplies)
class ServerSideFixedClipping(
    _ValidatedReplies, DifferentialPrivacyServerSideFixedClipping
):
    """Flower's server-side fixed-clipping wrapper, fed validated replies only.

    Central (user-level) DP: Flower's
    ``DifferentialPrivacyServerSideFixedClipping`` clips every model update on
    the server and adds Gaussian noise to the aggregate. Flower's wrapper clips
    every reply before the wrapped strategy can validate it (a reply with a
    missing key crashes the round; one with a broadcastable wrong shape is
    reshaped and averaged in); this subclass hands it only the replies the
    wrapped strategy accepts. Use ``participation="fixed"`` (the noise is
    divided by ``num_sampled_clients``).
    """


@inherit_parameters(_ValidatedReplies)
class ClientSideFixedClipping(
    _ValidatedReplies, DifferentialPrivacyClientSideFixedClipping
):
    """Flower's client-side fixed-clipping wrapper, fed validated replies only.

    Central (user-level) DP with the clipping done by the clients: Flower's
    ``DifferentialPrivacyClientSideFixedClipping`` sends the clipping norm and
    noises the aggregate; the clients need Flower's ``fixedclipping_mod``
    among their ClientApp's mods. This subclass hands Flower's wrapper only
    the replies the wrapped strategy accepts.
    """


WRAPPERS = {"server": ServerSideFixedClipping, "client": ClientSideFixedClipping}


def central_dp(
    strategy: Strategy,
    *,
    clipping: str,
    noise_multiplier: float,
    clipping_norm: float,
    num_sampled_clients: int,
) -> Strategy:
    """Wrap ``strategy`` for central DP, clipping on the ``"server"`` or ``"client"``.

    ``"client"`` needs :func:`clip_when_asked` (or Flower's ``fixedclipping_mod``)
    among the ClientApp's mods.
    """
    if clipping not in WRAPPERS:
        raise ValueError(
            f"clipping must be one of {sorted(WRAPPERS)}, got {clipping!r}"
        )
    if not isinstance(strategy, ValidatedFedAvg):
        raise ValueError(
            f"central DP wraps one global model; {type(strategy).__name__} is not a "
            "single-model strategy of the pack (P-FedAvg keeps one model per server)"
        )
    if strategy.participation != "fixed":
        raise ValueError(
            "central DP needs participation='fixed': Flower's fixed-clipping wrapper "
            "divides the noise by num_sampled_clients, a count that "
            f"participation={strategy.participation!r} changes every round"
        )
    return WRAPPERS[clipping](
        strategy,
        noise_multiplier=noise_multiplier,
        clipping_norm=clipping_norm,
        num_sampled_clients=num_sampled_clients,
    )


__all__ = [
    "ClientSideFixedClipping",
    "ServerSideFixedClipping",
    "central_dp",
    "clip_when_asked",
]

"""Central (user-level) DP: Flower's fixed-clipping wrappers around our strategies.

Flower's ``DifferentialPrivacyServerSideFixedClipping`` and
``DifferentialPrivacyClientSideFixedClipping`` wrap any strategy: the model
updates are clipped (on the server, or on the clients by Flower's
``fixedclipping_mod``) and Gaussian noise is added to the aggregated model. The
pack's strategies run inside them unchanged. Two things the wrappers do not do,
and the subclasses here add:

* **Validation first.** The server-side wrapper clips every ArrayRecord of every
  reply *before* the wrapped strategy sees it. A reply with a missing key or an
  undecodable array then crashes the round inside Flower's clipping, and a reply
  with a wrongly shaped array can come out of the clipping broadcast to the
  right shape and pass every later check. :class:`ServerSideFixedClipping` and
  :class:`ClientSideFixedClipping` hand Flower only the replies the wrapped
  strategy accepts (error replies included: Flower's policy skips such rounds),
  so a malformed reply is rejected and logged, as everywhere else in the pack.
* **Saying what is not covered.** The wrappers noise the aggregated model only.
  Where a strategy uploads more than the model (SCAFFOLD's and FedDC's control
  variates, APFL's weighted average) or keeps server state built from the
  un-noised aggregate (FedDyn's h, SCAFFOLD's c), the wrapper's epsilon does not
  cover everything released; the constructor logs a warning naming it
  (:meth:`~.strategy.ValidatedFedAvg.central_dp_caveats`).
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

from .strategy import ValidatedFedAvg


def _screened(
    strategy: Strategy, server_round: int, replies: Iterable[Message]
) -> list[Message]:
    if isinstance(strategy, ValidatedFedAvg):
        return strategy.screen_replies(server_round, replies)
    return list(replies)


def _warn_caveats(wrapper: str, strategy: Strategy) -> None:
    if isinstance(strategy, ValidatedFedAvg):
        for caveat in strategy.central_dp_caveats():
            log(WARNING, "%s(%s): %s", wrapper, type(strategy).__name__, caveat)


class ServerSideFixedClipping(DifferentialPrivacyServerSideFixedClipping):
    """Flower's server-side fixed-clipping wrapper, fed validated replies only.

    Parameters are those of Flower's
    ``DifferentialPrivacyServerSideFixedClipping``.
    """

    def __init__(self, strategy: Strategy, *args: Any, **kwargs: Any) -> None:
        super().__init__(strategy, *args, **kwargs)
        _warn_caveats(type(self).__name__, strategy)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Drop malformed replies, then clip, aggregate and noise (Flower)."""
        return super().aggregate_train(
            server_round, _screened(self.strategy, server_round, replies)
        )


class ClientSideFixedClipping(DifferentialPrivacyClientSideFixedClipping):
    """Flower's client-side fixed-clipping wrapper, fed validated replies only.

    Parameters are those of Flower's
    ``DifferentialPrivacyClientSideFixedClipping``; clients need Flower's
    ``fixedclipping_mod`` (``to_client_app(client_fn, mods=[fixedclipping_mod])``).
    """

    def __init__(self, strategy: Strategy, *args: Any, **kwargs: Any) -> None:
        super().__init__(strategy, *args, **kwargs)
        _warn_caveats(type(self).__name__, strategy)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Drop malformed replies, then aggregate and noise (Flower)."""
        return super().aggregate_train(
            server_round, _screened(self.strategy, server_round, replies)
        )


__all__ = ["ClientSideFixedClipping", "ServerSideFixedClipping"]

r"""What you need to write a new algorithm: the extension points of the pack.

``flwr_prox_strategies`` holds what a *user* of the algorithms imports (the
strategies, their clients and rules, the adapter, the privacy pieces). This
namespace holds what a *contributor* subclasses and calls; ``core``, where most
of it lives, is internal and may move. Read one algorithm module alongside
(``algorithms/feddyn.py`` uses every hook below).

The server side: subclass :class:`ValidatedFedAvg`
--------------------------------------------------
Replies reach your code validated (shapes, dtypes, finite values, a positive
``num-examples``; a bad one is logged with its node and dropped), sampling is
seeded, a round without a valid reply keeps the model, rounds in a row that
aggregate nothing stop the run from inside ``aggregate_train`` (whoever owns the
loop), and a run that aggregated no round at all raises
:class:`NoRoundAggregatedError` (with the counted reasons, a :class:`ReplyTally`).
Eight names do the work:
``server_update`` (returning a :class:`RoundUpdate`), ``state_fields`` (with
``resume_settings`` and ``settings``), ``train_config``, ``train_records`` /
``node_train_records``, ``expected_train_arrays``, ``expected_train_metrics``,
``check_reply`` and
``grown_state``; a rule reads ``self.global_arrays`` (the model this round
sent), ``self.num_clients`` (N) and may call ``self.weighted_mean(replies,
record)`` and, with stateful clients, ``self.client_held_state(reply)`` (False
when the client held no committed state: its ``STATE_ROUND_METRIC`` was -1).
Override only the hooks you need, and extend the base's (``super()``) where it
does work; each is documented on :class:`ValidatedFedAvg`. ``server_update``
receives the round's :class:`ValidReply`\ s; it may run twice in a round (a reply
found non-finite is dropped and the rule re-run), so it depends on its arguments
and ``self.global_arrays`` only, and its ``state`` is read-only.
``expected_train_arrays`` declares records, name -> :data:`RecordSpec` (array key
-> :class:`ArraySpec`), ``expected_train_metrics`` metrics, name ->
:class:`MetricSpec`: a reply without them is rejected before your code sees it;
``check_reply`` raises ``ReplyRejected(kind, reason)`` to drop one more.

Class attributes declare the rest: ``state_fields`` (the server state that
``state_dict()`` saves, ``server_update`` receives and replaces; no hand-written
``state_dict`` or ``__repr__``), ``resume_settings`` (compared on restore),
``settings`` (shown by ``repr()``), ``rule_metric``, ``model_linear_in_replies``,
``stateful_clients``, ``requires_num_clients``, ``central_dp_caveat`` and more,
each documented where :class:`ValidatedFedAvg` declares it.

Constructors are keyword-only and check their arguments with
:func:`check_int`, :func:`check_positive`, :func:`check_non_negative`,
:func:`check_fraction` and :func:`check_choice` (a ``ValueError`` naming the
parameter); they pass the rest to ``super().__init__(**kwargs)``, and an
unknown keyword is a ``TypeError`` naming the closest accepted one
(``ValidatedFedAvg.accepted_kwargs()``). Models move as dicts of arrays:
:func:`record_to_dict` and :func:`dict_to_record`.

A coordinate-wise median, smoothed over rounds::

    import numpy as np

    from flwr_prox_strategies.extend import (
        RoundUpdate,
        ValidatedFedAvg,
        check_fraction,
        dict_to_record,
    )


    class SmoothedMedian(ValidatedFedAvg):
        model_linear_in_replies = False  # a median can hide an inf
        state_fields = ("smoothed",)
        resume_settings = ("beta",)
        settings = ("beta", "seed")

        def __init__(self, *, beta: float = 0.5, **kwargs):
            check_fraction("beta", beta)
            super().__init__(**kwargs)
            self.beta = float(beta)
            self.smoothed = None

        def server_update(self, server_round, state, replies):
            models = [reply.arrays[self.arrayrecord_key] for reply in replies]
            median = {
                key: np.median([m[key] for m in models], axis=0)
                for key in models[0]
            }
            old = state["smoothed"] or median
            new = {
                key: (self.beta * old[key] + (1 - self.beta) * median[key]).astype(
                    models[0][key].dtype
                )
                for key in median
            }
            return RoundUpdate(dict_to_record(new), {"smoothed": new})

The client side: a :class:`ClientRule` and a :class:`TorchClient`
-----------------------------------------------------------------
A :class:`ClientRule` subclass is the algorithm's client half, usable in any
training loop: ``protocol`` (the strategy's name, for errors),
``applied_metric`` (the strategy's ``rule_metric``), ``stateful`` and
``state_names`` (its records in ``context.state``); ``setup()`` reads this
round's values (``self.required(key)``, ``self.received_params(name)``,
``self.state``, a :class:`ClientState`) and returns a :class:`GradientTerm`
(an object whose ``add_(params)`` adds its gradient to each ``p.grad`` in
place) or None; ``finish(steps, lr)`` advances the state and returns the extra
reply records and metrics. State the server sums over is saved with
``self.state.set_pending(name, arrays, self.server_round)`` (committed once
the server aggregates the reply; ``personal_state`` names what the client
keeps whatever the server does); reply records hold one array per
``state_dict`` entry, buffers included: build them with
``self.to_reply_layout(tensors)`` and read them with
``self.from_reply_layout(arrays)``. The base counts the optimiser steps and whether
each update held the term (``rule.counts``, a :class:`StepCounts`; the
reply's ``applied_metric`` is its ``applied``); a rule that computes its own
update calls ``took_steps(n)``. A :class:`TorchClient` subclass runs it in the
pack's training loop: set ``protocol`` and ``rule_class`` (and
``rule_options(config)`` for the rule's own keywords).

A feature of the round
----------------------
A feature that is not an algorithm (a learning-rate schedule, a monitor of the
replies) is a :class:`RoundPiece`, passed as ``pieces=[...]`` to any strategy:
its ``train_config(server_round)`` adds values to every train config,
``expected_arrays(model)`` records every train reply must carry, and
``metrics(replies, weight)`` metrics of the round's valid replies. The pack's
own, :class:`LearningRateDecay` and :class:`DissimilarityMonitor`, are what the
``lr_decay`` and ``monitor_dissimilarity`` keywords build; the FedProx paper's
stragglers are the sampler's :class:`Stragglers` (``drop_percent``).

Wrapping a strategy
-------------------
A feature that changes how any strategy's rounds travel (secure aggregation,
a robust aggregator, tracking) is a :class:`StrategyWrapper`: it forwards
Flower's five hooks, the run and every other attribute to the strategy it
holds, so a subclass overrides only what it changes (``configure_train``,
``aggregate_train``...) and calls ``super()`` for the rest. Every strategy of
the pack runs Flower's loop through one ``start()``
(:meth:`RunLifecycle.start`); what a run needs before and after it goes in
``begin_run(initial_arrays, num_rounds)``, ``end_run(result, num_rounds)``
and ``close_run(failed)``, which a wrapper forwards to its strategy, so the
pack's checks (a run that aggregated nothing fails) hold around any wrapper.

Registering it
--------------
One line in :data:`ALGORITHMS` (an :class:`Algorithm` of strategy, client and
rule, with the configurations the conformance kit checks as ``cases``),
``conf/strategy/<name>.yaml``, the exports of ``flwr_prox_strategies``, a test
of the algorithm's mathematics and a README row: ``tests/test_algorithms.py``
fails until they agree (the documentation's guide to adding an algorithm walks
through the five places). A package of its own registers it through an entry
point instead, and runs :func:`flwr_prox_strategies.testing.conformance_checks`
in its tests: the strategy's checks and its own client's against it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .algorithms import ALGORITHMS as _ALGORITHMS
from .algorithms import Algorithm
from .core.contract.fields import RoundUpdate
from .core.contract.validation import MetricSpec, ReplyRejected, ValidReply
from .core.server.outcome import NoRoundAggregatedError, ReplyTally
from .core.server.pieces import DissimilarityMonitor, LearningRateDecay, RoundPiece
from .core.server.sampling import Stragglers
from .core.server.strategy import ValidatedFedAvg
from .core.transport.keys import STATE_ROUND_METRIC as _STATE_ROUND_METRIC
from .core.transport.records import ArraySpec, dict_to_record, record_to_dict
from .core.transport.records import RecordSpec as _RecordSpec
from .core.wrapper import RunLifecycle, StrategyWrapper
from .ops.checks import (
    check_choice,
    check_fraction,
    check_int,
    check_non_negative,
    check_positive,
)

if TYPE_CHECKING:  # loaded on first use (__getattr__ below); type checkers see them
    from .core.client.client import TorchClient
    from .core.client.rule import ClientRule
    from .core.client.state import ClientState
    from .core.client.steps import StepCounts
    from .core.client.training import GradientTerm

# The client half's names need torch. A plugin's strategy module imports this
# namespace inside the ServerApp, which loads no torch unless it evaluates
# centrally: these load the first time they are read.
_CLIENT_SOURCES = {
    "TorchClient": ".core.client.client",
    "ClientRule": ".core.client.rule",
    "ClientState": ".core.client.state",
    "StepCounts": ".core.client.steps",
    "GradientTerm": ".core.client.training",
}


def __getattr__(name: str) -> Any:
    """Load a client-side name from its module on first use."""
    if name in _CLIENT_SOURCES:
        value = getattr(
            importlib.import_module(_CLIENT_SOURCES[name], __package__), name
        )
        globals()[name] = value  # the next lookup finds it without this hook
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """Return the module's names, the client-side ones not yet loaded included."""
    return sorted({*globals(), *__all__})


ALGORITHMS = _ALGORITHMS
"""Every algorithm of the pack by its configuration name, name -> :class:`Algorithm`.

The name is ``conf/strategy/<name>.yaml``'s (``strategy=<name>`` on the
command line). The conf tree, the exports of ``flwr_prox_strategies`` and the
tests are checked against this table.
"""

STATE_ROUND_METRIC = _STATE_ROUND_METRIC
"""The metric of a stateful rule's reply that names the round of its committed state.

-1 when the client holds none (:meth:`ValidatedFedAvg.client_held_state`
reads it). Declare it in ``expected_train_metrics`` when the server rule
depends on it.
"""

RecordSpec = _RecordSpec
"""The layout a reply's ArrayRecord must have, array key -> :class:`ArraySpec`.

An ordered ``dict``: the order is the ``NumPyClient``'s list order (the model's
``state_dict`` order). :meth:`ValidatedFedAvg.expected_train_arrays` returns
one per ArrayRecord a train reply must carry; an empty one checks the record's
presence only (the model's before the first round).
"""

__all__ = [
    "ALGORITHMS",
    "STATE_ROUND_METRIC",
    "Algorithm",
    "ArraySpec",
    "ClientRule",
    "ClientState",
    "DissimilarityMonitor",
    "GradientTerm",
    "LearningRateDecay",
    "MetricSpec",
    "NoRoundAggregatedError",
    "RecordSpec",
    "ReplyRejected",
    "ReplyTally",
    "RoundPiece",
    "RoundUpdate",
    "RunLifecycle",
    "StepCounts",
    "Stragglers",
    "StrategyWrapper",
    "TorchClient",
    "ValidReply",
    "ValidatedFedAvg",
    "check_choice",
    "check_fraction",
    "check_int",
    "check_non_negative",
    "check_positive",
    "dict_to_record",
    "record_to_dict",
]

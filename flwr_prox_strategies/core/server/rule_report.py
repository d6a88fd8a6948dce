"""What a reply says of the client rule, and the texts that explain a problem with it.

A strategy's clients report how many of their steps held the rule's term
(:func:`reports_rule`, :func:`term_shortfall`). A reply without the rule, or
whose term missed steps, is explained here: what the client did instead, why
and the fix (:func:`protocol_problem`, :func:`shortfall_problem`,
:func:`records_problem`), in the warnings :class:`.screening.ReplyScreen` gives
once per run (:func:`warn_rule_not_applied`, :func:`warn_term_shortfall`) and
in the rejections of ``strict=True``. Every text names the rule as
:class:`RuleNames` says.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from logging import WARNING
from typing import Any, ClassVar

from flwr.app import Message
from flwr.common.logger import log

from ..contract.steps import shortfall_text
from ..contract.validation import ValidReply
from ..transport.keys import LOCAL_STEPS_METRIC, TERM_LOST_METRIC, TERM_MISSING_METRIC


def pack_class(cls: type) -> type:
    """Return the first class of ``cls``'s MRO that the pack defines.

    A user's subclass (``class CustomFedAvg(FedProx)``) is skipped, so messages
    name classes that exist (``FedProxRule``, not ``CustomFedAvgRule``). An
    algorithm built on the pack's base itself (a plugin's ``FedNova``) is its
    own: the base's name (``ValidatedFedAvgRule``) names nothing.
    """
    below_base = cls
    for klass in cls.__mro__:
        if klass.__module__.startswith("flwr_prox_strategies.algorithms."):
            return klass
        if klass.__module__.startswith("flwr_prox_strategies."):
            return below_base
        below_base = klass
    return cls


def rule_pieces_of(strategy: Any) -> tuple[str, str]:
    """Return the pack's ``(client, rule)`` class names that serve ``strategy``."""
    name = pack_class(type(strategy)).__name__
    return strategy.rule_pieces or (f"{name}Client", f"{name}Rule")


@dataclass(frozen=True)
class RuleNames:
    """How the texts name a strategy's client rule, and the strategy that warns.

    Parameters
    ----------
    owner : str
        The strategy's class, which the warnings name (a user's subclass too).
    server : str
        The pack's class that serves it (:func:`pack_class`).
    metric : str | None
        The metric its clients report (``rule_metric``); None: any client will do.
    name : str
        What the rule is called (``rule_name``).
    client, rule : str
        The pack's client and rule classes that apply it (:func:`rule_pieces_of`).
    """

    owner: str
    server: str
    metric: str | None
    name: str
    client: str
    rule: str

    @classmethod
    def of(cls, strategy: Any) -> RuleNames:
        """Return the names of ``strategy``'s rule, read from its declarations.

        Parameters
        ----------
        strategy : ValidatedFedAvg
            A strategy of the pack (its ``rule_metric``, ``rule_name`` and
            ``rule_pieces``).

        Returns
        -------
        RuleNames
            The names, as the strategy declares them now.
        """
        client, rule = rule_pieces_of(strategy)
        return cls(
            owner=type(strategy).__name__,
            server=pack_class(type(strategy)).__name__,
            metric=strategy.rule_metric,
            name=strategy.rule_name,
            client=client,
            rule=rule,
        )


def _count(value: Any) -> int | float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return None


def reports_rule(reply: ValidReply | Mapping[str, Any], metric: str | None) -> bool:
    """Return True when the reply (or its metrics) reports ``metric`` (or none is due).

    The metric is the count of steps whose update held the rule's term (0
    for a client that took no step); a reply without it comes from a client
    that did not run the rule's :meth:`~flwr_prox_strategies.ClientRule.reply`.
    """
    if metric is None:
        return True
    metrics = reply if isinstance(reply, Mapping) else reply.metrics
    value = _count(metrics.get(metric))
    return value is not None and value >= 0


def term_shortfall(reply: ValidReply, metric: str | None) -> tuple[int, int] | None:
    """Return ``(applied, steps)`` when the rule's term missed some of the steps.

    ``metric`` counts the steps whose update held the term, ``local-steps``
    all the client's steps; None when every step held it (or the reply does
    not say: an earlier client's flag of 1 without ``local-steps``).
    """
    if metric is None:
        return None
    applied = _count(reply.metrics.get(metric))
    steps = _count(reply.metrics.get(LOCAL_STEPS_METRIC))
    if applied is None or steps is None or applied >= steps:
        return None
    return int(applied), int(steps)


def shortfall_problem(
    names: RuleNames, reply: ValidReply, *, counted: bool = True
) -> str:
    """Say in how many steps a client's term reached the update, why not, the fix.

    ``counted=False`` leaves the numbers out (one line for many replies).
    """
    shortfall = term_shortfall(reply, names.metric)
    assert shortfall is not None
    applied, steps = shortfall
    lost = int(_count(reply.metrics.get(TERM_LOST_METRIC)) or 0)
    missing = int(_count(reply.metrics.get(TERM_MISSING_METRIC)) or 0)
    if not (lost or missing):
        missing = steps - applied
    if not counted:
        return f"{names.name} missed updates: " + shortfall_text(
            lost, missing, names.rule, counted=False
        )
    return (
        f"{names.name} reached the update in {applied} of the client's "
        f"{steps} local steps: {shortfall_text(lost, missing, names.rule)}"
    )


class DeclaresRule:
    """A strategy that names the client rule its clients run.

    :class:`~.hooks.AlgorithmHooks` documents the two attributes; they live
    here so that :func:`declared_rules` finds every strategy that declares them.
    """

    rule_metric: ClassVar[str | None] = None
    rule_pieces: ClassVar[tuple[str, str] | None] = None


def declared_rules() -> dict[str, set[str]]:
    """Return the pack's client rules by name, each with its ``*-applied`` metrics.

    As the pack's strategies declare them (``rule_metric``, and the rule's name
    from ``rule_pieces``), so that a ServerApp knows every rule without
    importing the clients' torch code. SFedAvg and SFedProx share
    ``SFedRule``, which reports both metrics.
    """
    rules: dict[str, set[str]] = {}
    pending = list(DeclaresRule.__subclasses__())
    while pending:
        strategy = pending.pop(0)
        pending.extend(strategy.__subclasses__())
        metric = strategy.rule_metric
        if metric is None or not strategy.__module__.startswith(
            "flwr_prox_strategies."
        ):
            continue
        pieces = strategy.rule_pieces
        rule = pieces[1] if pieces else f"{strategy.__name__}Rule"
        rules.setdefault(rule, set()).add(metric)
    return rules


def rules_applied(metrics: Mapping[str, Any]) -> list[str]:
    """Return the pack's rules a reply's metrics say were run (their ``*-applied``)."""
    return sorted(
        rule
        for rule, applied in declared_rules().items()
        if any(reports_rule(metrics, metric) for metric in applied)
    )


def protocol_problem(names: RuleNames, reply: ValidReply | Mapping[str, Any]) -> str:
    """Say what the client did instead of applying the strategy's rule, and the fix.

    Either it applied another algorithm's rule (naming both), or its reply
    carries none of the records :meth:`ClientRule.reply` adds (a ClientApp
    that builds its own reply, or Flower's own client). Takes a reply or its
    metrics.
    """
    client, rule = names.client, names.rule
    metrics = reply if isinstance(reply, Mapping) else reply.metrics
    others = [name for name in rules_applied(metrics) if name != rule]
    if others:
        return (
            f"the client applies {' and '.join(others)}, but this server runs "
            f"{names.server}, whose clients apply {rule}: build {rule} in your "
            f"@app.train instead (or use the pack's {client})"
        )
    return (
        f"the reply carries none of {rule}'s records (a reply built without "
        f"rule.reply, which says in how many steps the term was applied): in "
        f"your @app.train, build {rule}.from_message(msg, context, model) and "
        f"return rule.reply(...) instead of a reply of your own (or use the "
        f"pack's {client})"
    )


def records_problem(names: RuleNames, message: Message) -> str:
    """Say why a train reply lacks the records the strategy expects, and the fix.

    Empty unless the strategy's clients run a rule and the reply does not
    report it (a reply of the user's own, or another algorithm's rule).
    """
    if names.metric is None:
        return ""
    records = list(message.content.metric_records.values())
    metrics: Mapping[str, Any] = records[0] if len(records) == 1 else {}
    if reports_rule(metrics, names.metric):
        return ""
    return protocol_problem(names, metrics)


def warn_term_shortfall(
    names: RuleNames, server_round: int, short: list[ValidReply]
) -> bool:
    """Warn, naming the nodes of ``short``, replies whose term missed steps.

    Their clients ran the rule, but its term did not reach every update (a
    closure-based step wiped it, or the optimiser that stepped was not the
    one attached): the message says in how many steps, why, and the fix.
    Returns whether there were any.
    """
    if not short:
        return False
    log(
        WARNING,
        "%s: round %d: nodes %s: %s. Their updates are averaged in as they are; "
        "strict=True rejects such replies. (Given once per run, repeated at the "
        "run's end and counted in the 'replies-term-incomplete' metric.)",
        names.owner,
        server_round,
        sorted(r.node_id for r in short),
        shortfall_problem(names, short[0]),
    )
    return True


def warn_rule_not_applied(
    names: RuleNames, server_round: int, lacking: list[ValidReply]
) -> bool:
    """Warn, naming the nodes of ``lacking``, replies without the rule metric.

    Their clients are not applying the algorithm's rule: the message says what
    they do instead and what to change. Returns whether there were any.
    """
    if not lacking:
        return False
    log(
        WARNING,
        "%s: round %d: nodes %s do not report '%s', so nothing says their "
        "clients apply %s; their updates are averaged in as they are: %s. "
        "strict=True rejects such replies. (Given once per run, repeated at "
        "the run's end and counted in the 'replies-rule-missing' metric.)",
        names.owner,
        server_round,
        sorted(r.node_id for r in lacking),
        names.metric,
        names.name,
        protocol_problem(names, lacking[0]),
    )
    return True

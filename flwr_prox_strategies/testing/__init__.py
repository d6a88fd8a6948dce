"""The conformance kit: the checks the pack's algorithms pass, for yours too.

A strategy of your own (a :class:`~flwr_prox_strategies.extend.ValidatedFedAvg`
subclass) and its client get the same safety net as the pack's, in your own
tests::

    import pytest
    from flwr_prox_strategies import testing
    from my_plugin import FEDNOVA  # an extend.Algorithm

    CHECKS = testing.conformance_checks(FEDNOVA)

    @pytest.mark.parametrize("name", sorted(CHECKS))
    def test_fednova_conforms(name):
        CHECKS[name]()

What is checked, for every configuration in the algorithm's ``cases``:

* every kind of bad reply (:data:`BAD_REPLIES`: errors, missing or extra
  records and keys, wrong shapes and dtypes, NaN and inf, lying payloads,
  hostile ``num-examples``, duplicates, unsampled nodes, a declared metric
  missing or out of range) leaves the model, the metrics and the state
  bit-identical to the same round without that reply;
* a round of bad replies, or of none, keeps the model; ``accept_failures``;
* ``state_dict`` round trip, and a restored strategy continues bit for bit;
* the server rule is pure (the same update twice, nothing stashed);
* a reply without the rule metric is warned about once, or rejected with
  ``strict=True``;

and for the algorithm: its cases together set every state field, and its rule
and client, sent another strategy's message, raise ``ProtocolError`` naming the
strategy they need. :class:`LeastSquares` is a federation with a known
minimiser to check convergence on, over the :class:`InProcessGrid`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from ..core.client.rule import ClientRule
from ..core.transport.inprocess import InProcessGrid
from .checks import NUM_NODES as _NUM_NODES
from .checks import STRATEGY_CHECKS as _STRATEGY_CHECKS
from .checks import Factory as _Factory
from .checks import (
    assert_same_value,
    check_bad_reply,
    check_cases_set_every_state_field,
    check_client_refuses_another_strategys_message,
    check_rule_refuses_another_strategys_message,
    fedavg_message,
    first_round,
    sampling_grid,
)
from .clients import CLIENT_CHECKS as _CLIENT_CHECKS
from .clients import (
    ClientRun,
    buffered_model,
    check_frozen_part,
    client_app_of,
    initial_model,
    run_clients,
    runs_client,
)
from .federation import LeastSquares, half_sse
from .replies import BAD_REPLIES as _BAD_REPLIES
from .replies import (
    bad_reply_kinds,
    error_reply,
    model_arrays,
    record,
    reply,
    valid_reply,
)

NUM_NODES = _NUM_NODES
"""How many nodes the checks' grid has (node ids ``1001`` to ``1005``)."""

Factory = _Factory
"""A configuration to check: ``make(num_nodes) -> strategy``, a fresh one per call."""

STRATEGY_CHECKS = _STRATEGY_CHECKS
"""The checks of one configuration besides the bad replies, name -> ``check(make)``."""

CLIENT_CHECKS = _CLIENT_CHECKS
"""The checks of an algorithm's own client, name -> ``check(run)``.

Each asserts on one :class:`ClientRun` (:func:`run_clients`): the client
trained; its replies carry the records the strategy expects and pass its
screening; a reply the server rejected left the client's committed state as
it was; every committed state is recognised next round (nothing retired, N
unchanged, nothing saved outside the two-phase commit); the rule's term
reached every update.
"""

BAD_REPLIES = _BAD_REPLIES
"""Every kind of bad reply, name -> ``(strategy, message sent) -> reply``.

Each must leave the round exactly as if that node had not replied; the
``declared-metric-*`` kinds apply to a strategy that declares metrics.
"""


def default_case(strategy_cls: type) -> Factory:
    """Return the factory of a strategy with its defaults, sized for the grid.

    Parameters
    ----------
    strategy_cls : type
        A :class:`~flwr_prox_strategies.extend.ValidatedFedAvg` subclass.

    Returns
    -------
    Callable[[int], Any]
        ``num_nodes -> strategy_cls(num_clients=num_nodes)`` when the rule
        divides by N (``requires_num_clients``), else
        ``strategy_cls(min_available_nodes=num_nodes)``.
    """
    if getattr(strategy_cls, "requires_num_clients", False):
        return lambda n: strategy_cls(num_clients=n)
    return lambda n: strategy_cls(min_available_nodes=n)


def cases_of(algorithm: Any) -> dict[str, Factory]:
    """Return an algorithm's configurations, name -> factory.

    Parameters
    ----------
    algorithm : Algorithm
        An entry of the algorithm table
        (:class:`~flwr_prox_strategies.extend.Algorithm`).

    Returns
    -------
    dict[str, Callable[[int], Any]]
        Its ``cases``, or ``{"default": default_case(strategy)}``.
    """
    return dict(algorithm.cases) or {"default": default_case(algorithm.strategy)}


def conformance_checks(algorithm: Any) -> dict[str, Callable[[], None]]:
    """Return every check of an algorithm, name -> a call that runs it.

    For ``pytest.mark.parametrize``: names are ``<case>/<check>`` and
    ``<case>/bad-reply/<kind>``, plus the algorithm-wide ones.

    Parameters
    ----------
    algorithm : Algorithm
        Strategy, client and rule (:class:`~flwr_prox_strategies.extend.Algorithm`),
        with the configurations to check in ``cases``.

    Returns
    -------
    dict[str, Callable[[], None]]
        Each raises ``AssertionError`` saying what broke.
    """
    cases = cases_of(algorithm)
    checks: dict[str, Callable[[], None]] = {}
    for case, make in cases.items():
        if runs_client(algorithm):
            # One run of the algorithm's own client per configuration, shared
            # by its client checks (run by the first that needs it).
            run = functools.cache(functools.partial(run_clients, algorithm, make))
            for name, client_check in CLIENT_CHECKS.items():
                checks[f"{case}/{name}"] = _on_run(client_check, run)
            checks[f"{case}/client/frozen-part"] = functools.partial(
                check_frozen_part, algorithm, make
            )
        kinds = bad_reply_kinds(make(NUM_NODES))
        for kind in kinds:
            checks[f"{case}/bad-reply/{kind}"] = functools.partial(
                check_bad_reply, make, kind
            )
        for name, check in STRATEGY_CHECKS.items():
            checks[f"{case}/{name}"] = functools.partial(check, make)
    checks["cases-set-every-state-field"] = functools.partial(
        check_cases_set_every_state_field, cases
    )
    rule = algorithm.rule
    if rule is not None and rule is not ClientRule:  # FedAvg's needs nothing
        kwargs = (
            {"num_examples": 10}
            if "num_examples" in inspect.signature(rule.__init__).parameters
            else {}
        )
        checks["rule-refuses-another-strategys-message"] = functools.partial(
            check_rule_refuses_another_strategys_message, rule, **kwargs
        )
    client = algorithm.client
    if client is not None and getattr(client, "rule_class", None) is not ClientRule:
        checks["client-refuses-another-strategys-message"] = functools.partial(
            check_client_refuses_another_strategys_message, client
        )
    return checks


def _on_run(
    check: Callable[[ClientRun], None], run: Callable[[], ClientRun]
) -> Callable[[], None]:
    return lambda: check(run())


def check_algorithm(algorithm: Any) -> None:
    """Run every check of :func:`conformance_checks`; report all that fail.

    Parameters
    ----------
    algorithm : Algorithm
        The algorithm to check.

    Raises
    ------
    AssertionError
        Listing each failing check with its message.
    """
    failures = []
    for name, check in conformance_checks(algorithm).items():
        try:
            check()
        except Exception as err:  # every failure is reported, not the first
            failures.append(f"{name}: {type(err).__name__}: {err}")
    if failures:
        raise AssertionError(
            f"{len(failures)} conformance check(s) failed:\n" + "\n".join(failures)
        )


def check_converges(
    make: Callable[[], Any],
    client_cls: type,
    *,
    rounds: int,
    tolerance: float,
    problem: LeastSquares | None = None,
    **client_kwargs: Mapping[str, Any] | Any,
) -> float:
    """Run a strategy on :class:`LeastSquares` and check it reaches the minimiser.

    Parameters
    ----------
    make : Callable[[], Strategy]
        Returns the strategy to run.
    client_cls : type
        Its clients' ``NumPyClient`` class.
    rounds : int
        Rounds to run.
    tolerance : float
        The largest relative distance to the minimiser accepted.
    problem : LeastSquares | None (default: None)
        The federation; None: ``LeastSquares()`` (4 clients, dimension 5).
    **client_kwargs
        Keyword arguments of ``client_cls`` (``learning_rate``, ...).

    Returns
    -------
    float
        The relative distance reached.

    Raises
    ------
    AssertionError
        When it is above ``tolerance``.
    """
    problem = problem or LeastSquares()
    theta = problem.run(make(), client_cls, rounds, **client_kwargs)
    error = problem.relative_error(theta)
    assert error <= tolerance, (
        f"{rounds} rounds reached relative error {error:.3g} > {tolerance:g}"
    )
    return error


__all__ = [
    "BAD_REPLIES",
    "CLIENT_CHECKS",
    "NUM_NODES",
    "STRATEGY_CHECKS",
    "ClientRun",
    "InProcessGrid",
    "LeastSquares",
    "assert_same_value",
    "bad_reply_kinds",
    "buffered_model",
    "cases_of",
    "check_algorithm",
    "check_bad_reply",
    "check_cases_set_every_state_field",
    "check_client_refuses_another_strategys_message",
    "check_converges",
    "check_rule_refuses_another_strategys_message",
    "client_app_of",
    "conformance_checks",
    "default_case",
    "error_reply",
    "fedavg_message",
    "first_round",
    "half_sse",
    "initial_model",
    "model_arrays",
    "record",
    "reply",
    "run_clients",
    "runs_client",
    "sampling_grid",
    "valid_reply",
]

"""Mount a ``NumPyClient`` on a Message-API ``ClientApp``: :func:`to_client_app`.

What it translates is in its docstring. An exception in client code becomes an
error reply carrying its message (``CLIENT_APP_RAISED_EXCEPTION``; a
:class:`ProtocolError` gives ``MOD_FAILED_PRECONDITION``, as does a client whose
privacy budget is spent: :class:`PrivacyBudgetExhausted`), never a dead node.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from logging import DEBUG, ERROR, WARNING
from typing import TYPE_CHECKING, Any

from flwr.app import (
    ArrayRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

from ..transport.flower import MOD_FAILED_PRECONDITION
from ..transport.keys import NUM_EXAMPLES_KEY
from ..transport.records import to_ndarrays, to_record
from .secagg import SecAggPlusMod

if TYPE_CHECKING:
    from .message import Received

# .rule and .dp (ProtocolError, read_message, PrivacyBudgetExhausted) import torch:
# they are imported in the functions that handle a message for the client, so
# loading the app, or answering a stage of secure aggregation, does without it.

ClientFn = Callable[[Context], NumPyClient]


def _metric_record(metrics: dict[str, Any], num_examples: int) -> MetricRecord:
    record = MetricRecord()
    for key, value in metrics.items():
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, (int, float)):
            record[key] = value
        else:
            # MetricRecord holds numbers only; strings and bytes stay local.
            log(DEBUG, "to_client_app: dropping non-numeric metric %r", key)
    if isinstance(num_examples, bool) or not isinstance(num_examples, (int, float)):
        raise TypeError(f"the client returned num_examples={num_examples!r}")
    if isinstance(num_examples, float) and not math.isfinite(num_examples):
        raise ValueError(f"the client returned num_examples={num_examples!r}")
    record[NUM_EXAMPLES_KEY] = num_examples
    return record


class ErrorLog:
    """Log a client exception's traceback once; repeats get one line.

    A setting the client refuses fails the same way on every node in every
    round: the log shows its traceback once per ClientApp process, not once
    per message. (The server counts every such error reply either way.)
    """

    def __init__(self, limit: int = 1000) -> None:
        self.shown: set[str] = set()
        self.limit = limit

    def __call__(self, reason: str) -> None:
        """Log one client exception (inside its ``except`` block)."""
        if reason in self.shown:
            log(ERROR, "ClientApp: %s (again; its traceback was logged)", reason)
            return
        if len(self.shown) < self.limit:
            self.shown.add(reason)
        log(ERROR, "ClientApp: %s\n%s", reason, traceback.format_exc())


def _error_reply(
    message: Message, err: Exception, errors: ErrorLog | None = None
) -> Message:
    from .dp import PrivacyBudgetExhausted
    from .rule import ProtocolError

    code = (
        MOD_FAILED_PRECONDITION
        if isinstance(err, (ProtocolError, PrivacyBudgetExhausted))
        else ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    )
    reason = f"{type(err).__name__}: {err}"
    if isinstance(err, PrivacyBudgetExhausted):  # expected: no traceback
        log(WARNING, "ClientApp: %s", reason)
    else:
        (errors or ErrorLog())(reason)
    return Message(Error(code=code, reason=reason), reply_to=message)


def _build(client_fn: ClientFn, context: Context) -> NumPyClient:
    client = client_fn(context)
    if not isinstance(client, NumPyClient):
        raise TypeError(
            f"client_fn must return a NumPyClient, got {type(client).__name__}"
        )
    # Flower's NumPyClient has no context in 1.42: give it the node's own.
    client.context = context  # type: ignore[attr-defined]
    return client


def _give_extra_records(client: NumPyClient, extra: dict[str, list[Any]]) -> None:
    # The server's extra ArrayRecords (all but the model) for clients that read them.
    if hasattr(client, "received_arrays"):
        client.received_arrays = extra


def _answer(
    client_fn: ClientFn,
    message: Message,
    context: Context,
    errors: ErrorLog | None,
    run: Callable[[NumPyClient, Received], RecordDict],
) -> Message:
    """Build the client for ``message``, ``run`` it, and reply (or error reply)."""
    from .rule import read_message

    try:
        received = read_message(message)
        client = _build(client_fn, context)
        _give_extra_records(client, received.extra)
        return Message(run(client, received), reply_to=message)
    except Exception as err:
        return _error_reply(message, err, errors)


def handle_train(
    client_fn: ClientFn,
    message: Message,
    context: Context,
    errors: ErrorLog | None = None,
) -> Message:
    """Run ``fit`` for one train message and build the reply (or error reply)."""

    def fit(client: NumPyClient, received: Received) -> RecordDict:
        keys = list(received.arrays.keys())
        new_arrays, num_examples, metrics = client.fit(
            to_ndarrays(received.arrays), received.config
        )

        def record(arrays: list[Any]) -> ArrayRecord:
            # The received keys, when the client kept the model's layout.
            return to_record(arrays, keys if len(keys) == len(arrays) else None)

        reply = RecordDict({"arrays": record(new_arrays)})
        for name, extra in getattr(client, "reply_arrays", {}).items():
            reply[name] = record(extra)
        reply["metrics"] = _metric_record(metrics, num_examples)
        return reply

    return _answer(client_fn, message, context, errors, fit)


def handle_evaluate(
    client_fn: ClientFn,
    message: Message,
    context: Context,
    errors: ErrorLog | None = None,
) -> Message:
    """Run ``evaluate`` for one evaluate message and build the reply."""

    def evaluate(client: NumPyClient, received: Received) -> RecordDict:
        loss, num_examples, metrics = client.evaluate(
            to_ndarrays(received.arrays), received.config
        )
        record = _metric_record({"loss": float(loss), **metrics}, num_examples)
        return RecordDict({"metrics": record})

    return _answer(client_fn, message, context, errors, evaluate)


def handle_query(message: Message, context: Context) -> Message:
    """Answer a query with the node's numeric ``node_config`` entries.

    P-FedAvg asks every node once for its ``server-id`` / ``partition-id``, so
    the assignment of nodes to servers comes from the SuperNodes' own config.
    """
    record = MetricRecord()
    for key, value in context.node_config.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            record[str(key)] = value
    return Message(RecordDict({"node-config": record}), reply_to=message)


def to_client_app(
    client_fn: ClientFn,
    *,
    mods: list[Callable[..., Message]] | None = None,
    secure_aggregation: bool = True,
) -> ClientApp:
    """Mount a ``NumPyClient`` factory on a Message-API ``ClientApp``.

    Flower 1.42's ``NumPyClient`` does not work with Message-API strategies as
    is; this adapter translates: the ``ArrayRecord`` becomes the list of
    arrays ``fit`` and ``evaluate`` take (in the record's key order, and back
    with the same keys), the ``ConfigRecord`` a ``dict``; the node's
    ``Context`` is given to the client (``client.context``), so
    ``context.state`` keeps per-client state across rounds; the train reply
    carries the model (``"arrays"``), the extra ArrayRecords the client put
    in ``client.reply_arrays`` and one ``MetricRecord`` (``"metrics"``) with
    ``num-examples``. It works with any ``NumPyClient``, the pack's or your
    own.

    Parameters
    ----------
    client_fn : Callable[[Context], NumPyClient]
        Builds the node's client from its ``Context`` (``context.node_config``
        says which partition it holds; ``context.state`` persists across rounds).
    mods : list | None (default: None)
        Flower mods wrapped around every message (e.g. Flower's ``LocalDpMod``
        or the pack's :class:`~flwr_prox_strategies.LaplaceUploadMod`).
    secure_aggregation : bool (default: True)
        Put :class:`~flwr_prox_strategies.SecAggPlusMod` first among the mods
        (it masks the reply the others made), so the app answers a server
        running :class:`~flwr_prox_strategies.SecAggPlus`; it lets every
        other message pass untouched.

    Returns
    -------
    ClientApp
        With ``@app.train()``, ``@app.evaluate()`` and ``@app.query()``
        registered (the query answers P-FedAvg's question for the node's
        numeric ``node_config`` entries).

    Notes
    -----
    An exception in client code never kills the node: it becomes an error
    reply carrying ``"<ExceptionType>: <message>"``, with code
    ``CLIENT_APP_RAISED_EXCEPTION``, or ``MOD_FAILED_PRECONDITION`` for a
    :class:`ProtocolError` (the server runs another algorithm) or a
    :class:`PrivacyBudgetExhausted` client. The pack's strategies log and
    count these replies; its traceback is logged once per ClientApp process.

    Examples
    --------
    >>> def client_fn(context):
    ...     pid = int(context.node_config["partition-id"])
    ...     return FedProxClient(Net(), load_train(pid), load_test(pid))
    >>> app = to_client_app(client_fn)
    """
    if secure_aggregation:
        # Outermost: it masks the reply the other mods (DP noise, clipping) made.
        mods = [SecAggPlusMod(), *(mods or [])]
    app = ClientApp(mods=mods)  # type: ignore[arg-type]
    errors = ErrorLog()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        return handle_train(client_fn, message, context, errors)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        return handle_evaluate(client_fn, message, context, errors)

    @app.query()
    def query(message: Message, context: Context) -> Message:
        return handle_query(message, context)

    return app

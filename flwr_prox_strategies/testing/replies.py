"""Replies built by hand: valid ones from a strategy's declarations, and bad ones.

A valid reply carries every ``ArrayRecord`` the strategy declares
(``expected_train_arrays``), every metric it declares (``expected_train_metrics``,
at :meth:`MetricSpec.example`), the rule metric its clients report and a client
key, so a strategy of your own needs no hand-written reply to be checked.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)

from ..core.client.rule import accepted_round
from ..core.transport.inprocess import node_unavailable_reply
from ..core.transport.keys import STATE_ROUND_METRIC

#: The model every check sends: two arrays, so a bad reply can miss one.
MODEL_KEYS = ("w", "b")


def model_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """Return the checks' model: ``w`` (4, 3) and ``b`` (3,), float32.

    Parameters
    ----------
    seed : int (default: 0)
        Seeds the values.

    Returns
    -------
    dict[str, numpy.ndarray]
        Array key -> array.
    """
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(size=(4, 3)).astype(np.float32),
        "b": rng.normal(size=(3,)).astype(np.float32),
    }


def record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Return an ``ArrayRecord`` holding ``arrays`` (copied, C order).

    Parameters
    ----------
    arrays : Mapping[str, numpy.ndarray]
        Array key -> array.

    Returns
    -------
    ArrayRecord
        The record, keys in ``arrays``' order.
    """
    rec = ArrayRecord()
    for key, value in arrays.items():
        rec[key] = Array(np.array(value, order="C", copy=None))
    return rec


def reply(
    to: Message,
    arrays: Mapping[str, np.ndarray] | None,
    num_examples: Any = 10,
    *,
    extra_records: Mapping[str, ArrayRecord] | None = None,
    metrics: Mapping[str, Any] | None = None,
) -> Message:
    """Return a reply to ``to`` with the given model, records and metrics.

    Parameters
    ----------
    to : Message
        The message replied to.
    arrays : Mapping[str, numpy.ndarray] | None
        The model (record ``arrays``); None: no model record.
    num_examples : Any (default: 10)
        The ``num-examples`` metric, whatever its type; None: left out.
    extra_records : Mapping[str, ArrayRecord] | None (default: None)
        More records, by name.
    metrics : Mapping[str, Any] | None (default: None)
        The metrics besides ``num-examples``; None: ``{"train-loss": 1.0}``.

    Returns
    -------
    Message
        The reply.
    """
    content = RecordDict()
    if arrays is not None:
        content["arrays"] = record(arrays)
    for name, rec in (extra_records or {}).items():
        content[name] = rec
    values = dict(metrics or {"train-loss": 1.0})
    if num_examples is not None:
        values["num-examples"] = num_examples
    content["metrics"] = MetricRecord(values)
    return Message(content, reply_to=to)


def error_reply(to: Message, reason: str = "boom") -> Message:
    """Return an error reply to ``to`` (code 2, as a ClientApp exception).

    Parameters
    ----------
    to : Message
        The message replied to.
    reason : str (default: "boom")
        The error's reason.

    Returns
    -------
    Message
        The reply.
    """
    return Message(Error(code=2, reason=reason), reply_to=to)


def servers_of(strategy: Any) -> list[Any]:
    """Return the strategies that screen replies: a composite's inner ones, else itself.

    Parameters
    ----------
    strategy : Strategy
        A strategy, or a composite holding them in ``inner`` (P-FedAvg).

    Returns
    -------
    list
        The screening strategies.
    """
    return list(getattr(strategy, "inner", [strategy]))


def valid_content(strategy: Any, i: int) -> dict[str, dict[str, np.ndarray]]:
    """Return arrays for every record the strategy declares, distinct per ``i``.

    Parameters
    ----------
    strategy : Strategy
        After ``configure_train`` (the model's layout is known then).
    i : int
        Makes the values of one node differ from another's.

    Returns
    -------
    dict[str, dict[str, numpy.ndarray]]
        Record name -> array key -> array.
    """
    return {
        name: {
            key: np.full(spec.shape, i + 1 + 10 * k, dtype=spec.dtype)
            + np.arange(int(np.prod(spec.shape)), dtype=spec.dtype).reshape(spec.shape)
            for k, (key, spec) in enumerate(specs.items())
        }
        for name, specs in strategy.expected_train_arrays(1).items()
    }


def valid_metrics(strategy: Any, to: Message) -> dict[str, Any]:
    """Return the metrics a valid reply to ``to`` carries.

    A train loss, the client key (node id minus 1000), the rule metric the
    strategy's clients report, for a strategy with stateful clients the
    ``state-round`` of a client in step with it (the round the message
    confirms), and each declared metric at its example value.

    Parameters
    ----------
    strategy, to
        As in :func:`valid_reply`: the strategy and the message it sent.

    Returns
    -------
    dict[str, Any]
        Metric name -> value (``num-examples`` not included).
    """
    key = to.metadata.dst_node_id - 1000
    values: dict[str, Any] = {"train-loss": 1.0, "client-key": key}
    server = servers_of(strategy)[0]
    if (rule := getattr(server, "rule_metric", None)) is not None:
        values[rule] = 1
    if getattr(server, "stateful_clients", False):
        # A client in step with the server: its committed state is from the
        # last round the server confirmed to it.
        config = dict(to.content.config_records.get(server.configrecord_key, {}))
        confirmed = accepted_round(config, key)
        values[STATE_ROUND_METRIC] = -1 if confirmed is None else confirmed
    values.update({name: spec.example() for name, spec in _declared(strategy).items()})
    return values


def _declared(strategy: Any) -> Mapping[str, Any]:
    """Return the metrics the strategy's replies must carry (none if foreign)."""
    server = servers_of(strategy)[0]
    return getattr(server, "expected_train_metrics", lambda _: {})(1)


def valid_reply(
    strategy: Any,
    to: Message,
    content: Mapping[str, Mapping[str, np.ndarray]] | None = None,
    *,
    num_examples: Any = 10,
    metrics: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> Message:
    """Return a valid train reply to ``to``, built from the strategy's declarations.

    Parameters
    ----------
    strategy : Strategy
        The strategy that sent ``to``.
    to : Message
        The message replied to.
    content : Mapping | None (default: None)
        Record name -> arrays; None: ``valid_content`` with ``seed``.
    num_examples : Any (default: 10)
        The ``num-examples`` metric.
    metrics : Mapping[str, Any] | None (default: None)
        The metrics; None: ``valid_metrics``.
    seed : int (default: 0)
        Distinguishes the arrays of one reply from another's.

    Returns
    -------
    Message
        The reply.
    """
    records = {
        name: dict(arrays)
        for name, arrays in (content or valid_content(strategy, seed)).items()
    }
    model = records.pop("arrays", None)
    return reply(
        to,
        model,
        num_examples,
        extra_records={name: record(a) for name, a in records.items()},
        metrics=valid_metrics(strategy, to) if metrics is None else metrics,
    )


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def _with_model(strategy: Any, to: Message, change: Callable[[dict], Any]) -> Message:
    content = valid_content(strategy, 7)
    change(content["arrays"])
    return valid_reply(strategy, to, content)


def _edited(strategy: Any, to: Message, edit: Callable[[Message], Any]) -> Message:
    msg = valid_reply(strategy, to, seed=7)
    edit(msg)
    return msg


def _lying(msg: Message) -> None:
    wrong = np.zeros((3, 4), np.float32)  # same size, another shape than declared
    msg.content.array_records["arrays"]["w"] = Array(
        "float32", (4, 3), "numpy.ndarray", _npy(wrong)
    )


def _truncated(msg: Message) -> None:
    data = _npy(np.zeros((4, 3), np.float32))[:-8]
    msg.content.array_records["arrays"]["w"] = Array(
        "float32", (4, 3), "numpy.ndarray", data
    )


def _too_large(msg: Message) -> None:
    size = 2**20 + 4096  # above the default limit: the payload is never decoded
    msg.content.array_records["arrays"]["junk"] = Array(
        "float32", (size // 4,), "numpy.ndarray", b"\0" * size
    )


def _foreign(to: Message) -> Message:
    """Return a message as if sent to a node that was not sampled."""
    return Message(
        RecordDict(), dst_node_id=424242, message_type=to.metadata.message_type
    )


def _declared_metric(strategy: Any) -> str | None:
    return next(iter(_declared(strategy)), None)


def _the_declared_metric(strategy: Any) -> str:
    name = _declared_metric(strategy)
    assert name is not None, "the strategy declares no metric"
    return name


def _without_metric(strategy: Any, to: Message) -> Message:
    metrics = valid_metrics(strategy, to)
    del metrics[_the_declared_metric(strategy)]
    return valid_reply(strategy, to, seed=7, metrics=metrics)


def _metric_out_of_range(strategy: Any, to: Message) -> Message:
    name = _the_declared_metric(strategy)
    spec = _declared(strategy)[name]
    metrics = valid_metrics(strategy, to)
    metrics[name] = (
        spec.minimum - 1
        if spec.minimum is not None
        else spec.maximum + 1
        if spec.maximum is not None
        else float("nan")
    )
    return valid_reply(strategy, to, seed=7, metrics=metrics)


BadReply = Callable[[Any, Message], Message]

#: Every kind of bad reply, name -> (strategy, message sent) -> the reply. Each
#: must leave the round exactly as if that node had not replied.
BAD_REPLIES: dict[str, BadReply] = {
    "error-reply": lambda s, m: error_reply(m),
    "no-arrays": lambda s, m: reply(m, None, 10),
    "extra-record": lambda s, m: valid_reply(
        s, m, {**valid_content(s, 7), "junk": {"x": np.zeros(2, np.float32)}}
    ),
    "two-metric-records": lambda s, m: _edited(
        s, m, lambda msg: msg.content.__setitem__("more", MetricRecord({"a": 3}))
    ),
    "config-record": lambda s, m: _edited(
        s, m, lambda msg: msg.content.__setitem__("cfg", ConfigRecord({"a": 1}))
    ),
    "missing-key": lambda s, m: _with_model(s, m, lambda a: a.pop("b")),
    "extra-key": lambda s, m: _with_model(
        s, m, lambda a: a.update(c=np.zeros(2, np.float32))
    ),
    "wrong-shape": lambda s, m: _with_model(
        s, m, lambda a: a.update(w=np.zeros((3, 4), np.float32))
    ),
    "wrong-dtype": lambda s, m: _with_model(
        s, m, lambda a: a.update(w=a["w"].astype(np.float64))
    ),
    "broadcastable-shape": lambda s, m: _with_model(
        s, m, lambda a: a.update(b=np.zeros((1,), np.float32))
    ),
    "nan": lambda s, m: _with_model(s, m, lambda a: a["w"].__setitem__((0, 0), np.nan)),
    "inf": lambda s, m: _with_model(s, m, lambda a: a["b"].__setitem__(1, -np.inf)),
    # +inf: an elastic-net centre (FedEPM) turns it into the others' minimum.
    "plus-inf": lambda s, m: _with_model(
        s, m, lambda a: a["w"].__setitem__((1, 2), np.inf)
    ),
    "too-large": lambda s, m: _edited(s, m, _too_large),
    # The SuperLink's reply for a node that died, from node 1 (Flower's code).
    "dead-node": lambda s, m: node_unavailable_reply(m),
    "num-examples-missing": lambda s, m: valid_reply(s, m, seed=7, num_examples=None),
    "num-examples-zero": lambda s, m: valid_reply(s, m, seed=7, num_examples=0),
    "num-examples-negative": lambda s, m: valid_reply(s, m, seed=7, num_examples=-5),
    "num-examples-nan": lambda s, m: valid_reply(
        s, m, seed=7, num_examples=float("nan")
    ),
    "num-examples-inf": lambda s, m: valid_reply(
        s, m, seed=7, num_examples=float("inf")
    ),
    "num-examples-list": lambda s, m: valid_reply(s, m, seed=7, num_examples=[1, 2]),
    "payload-lies": lambda s, m: _edited(s, m, _lying),
    "payload-truncated": lambda s, m: _edited(s, m, _truncated),
    # A second, different reply from the same node, after its first one.
    "duplicate": lambda s, m: valid_reply(s, m, seed=9, num_examples=50),
    "unsampled-node": lambda s, m: valid_reply(s, _foreign(m), seed=7),
    # Only for a strategy that declares metrics (expected_train_metrics).
    "declared-metric-missing": _without_metric,
    "declared-metric-out-of-range": _metric_out_of_range,
}


def bad_reply_kinds(strategy: Any) -> list[str]:
    """Return the kinds of :data:`BAD_REPLIES` that apply to ``strategy``.

    Parameters
    ----------
    strategy : Strategy
        The strategy checked.

    Returns
    -------
    list[str]
        Every kind, the declared-metric ones only when it declares a metric.
    """
    declared = _declared_metric(strategy) is not None
    return sorted(k for k in BAD_REPLIES if declared or "declared-metric" not in k)

"""Checks that decide whether a client's reply may be aggregated.

Every check either returns the parsed reply or raises :class:`ReplyRejected`
with a reason a user can act on. Nothing here mutates strategy state, so a
rejected reply leaves a round exactly as if it had never arrived.
"""

from __future__ import annotations

import difflib
import inspect
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from numpy.typing import NDArray

from ..transport.keys import BUDGET_EXHAUSTED_REASON, NUM_EXAMPLES_KEY
from ..transport.records import RecordSpec, array_view

# Names of Flower's legacy strategies (flwr.server.strategy) -> the Message
# API's (and the pack's) name of the same parameter.
LEGACY_NAMES = {
    "fraction_fit": "fraction_train",
    "min_fit_clients": "min_train_nodes",
    "min_evaluate_clients": "min_evaluate_nodes",
    "min_available_clients": "min_available_nodes",
    "fit_metrics_aggregation_fn": "train_metrics_aggr_fn",
    "evaluate_metrics_aggregation_fn": "evaluate_metrics_aggr_fn",
}


def reject_unknown_kwargs(
    owner: str, unknown: Mapping[str, Any], accepted: Iterable[str]
) -> None:
    """Raise ``TypeError`` naming ``owner``, the bad keyword and the closest name.

    ``owner`` is the class the user called (not the base whose ``__init__``
    happened to receive the keyword). Flower's legacy names point to their
    Message-API names; others to the closest accepted name, if any.
    """
    if not unknown:
        return
    names = sorted(set(accepted))
    bad = sorted(unknown)
    hints = []
    for name in bad:
        if LEGACY_NAMES.get(name) in names:
            hints.append(f"{name!r} (Flower's legacy name: use {LEGACY_NAMES[name]!r})")
            continue
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        hints.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    raise TypeError(
        f"{owner}() got unexpected keyword argument(s) {', '.join(hints)}; "
        f"{owner} accepts: {', '.join(names)}"
    )


def resolve_alias(
    owner: str, name: str, value: Any, alias: str, alias_value: Any, default: Any
) -> Any:
    """Return the value of a parameter that also has a Flower name (``alias``).

    None means "not given" for both; giving both is an error naming both.
    """
    if value is not None and alias_value is not None:
        raise TypeError(
            f"{owner}() got both {name}={value!r} and {alias}={alias_value!r}; "
            f"they are the same parameter ({alias} is Flower's name): give one"
        )
    if value is not None:
        return value
    return default if alias_value is None else alias_value


# Flower's error text for an exception raised in a ClientApp:
# "<class 'ValueError'>:<'message'>". The simulation wraps every exception in
# its ClientAppException (whose message starts on a new line), and Ray wraps
# that in "RayTaskError(ClientAppException)" with the actor's traceback.
_FLOWER_ERROR = re.compile(r"^<class '([^']+)'>:<'(.*)'>$", re.DOTALL)
_SIMULATION_WRAPPER = "Exception ClientAppException occurred. Message: "


def client_error_text(reason: str) -> str:
    """Return a ClientApp's error reply as the user's exception reads.

    Flower's ``<class 'ValueError'>:<'msg'>`` becomes ``ValueError: msg``. The
    simulation's ``ClientAppException`` wrapper, and Ray's
    ``RayTaskError(ClientAppException)`` with its traceback around it, hide
    the original type: they become ``the ClientApp raised: msg``. Other texts
    are returned as they are.

    Parameters
    ----------
    reason : str
        ``message.error.reason`` of an error reply.

    Returns
    -------
    str
        The exception's type and whole message.
    """
    text = str(reason).strip()
    match = _FLOWER_ERROR.match(text)
    if not match:
        return text
    kind, message = match.group(1).rsplit(".", 1)[-1], match.group(2)
    if _SIMULATION_WRAPPER in message:
        return (
            "the ClientApp raised: " + message.rsplit(_SIMULATION_WRAPPER, 1)[1].strip()
        )
    if "ClientAppException" in kind:
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        return "the ClientApp raised: " + (lines[-1] if lines else "")
    return f"{kind}: {message.strip()}"


class ReplyRejected(Exception):
    """A reply failed validation: raise it to drop the reply.

    Raised by the pack's checks, and by a strategy's
    :meth:`~flwr_prox_strategies.extend.ValidatedFedAvg.check_reply`, on a
    reply that must not be aggregated. The strategy logs it with the node and
    counts it by ``kind`` (``replies-rejected`` in the round's metrics); the
    round goes on as if the reply had never arrived.

    Parameters
    ----------
    kind : str
        A short machine-readable label (``"shape"``, ``"non-finite"``,
        ``"client-key"``, ...), the key replies are counted under.
    reason : str
        What was wrong, for the log line (also the exception's message).
    """

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


@dataclass
class ValidReply:
    """A reply that passed validation, with zero-copy views of its arrays.

    What :meth:`~flwr_prox_strategies.extend.ValidatedFedAvg.server_update`
    and :meth:`~flwr_prox_strategies.extend.ValidatedFedAvg.check_reply`
    receive; the strategy builds them.

    Parameters
    ----------
    node_id : int
        The node that sent it.
    arrays : dict[str, dict[str, NDArray]]
        Record name -> array key -> read-only view, keys in the expected
        layout's order (:data:`~flwr_prox_strategies.extend.RecordSpec`).
    metrics : MetricRecord
        The reply's only ``MetricRecord``.
    num_examples : float
        The validated ``num-examples`` value (finite, > 0); after the strategy's
        cap (``max_weight_ratio``, ``max_num_examples``), the capped value.
    message : Message | None (default: None)
        The reply message itself.
    finite : bool (default: True)
        False once a deferred value check found this reply's model unusable
        (NaN, inf or huge values); such a reply is dropped.
    capped_from : float | None (default: None)
        The claimed ``num-examples`` when it was capped, else None.
    """

    node_id: int
    arrays: dict[str, dict[str, NDArray]]
    metrics: MetricRecord
    num_examples: float
    message: Message | None = field(default=None, repr=False)
    finite: bool = True
    capped_from: float | None = None

    def bad_value_keys(self, name: str) -> dict[str, str]:
        """Return the keys of record ``name`` holding NaN, inf or huge values."""
        found = {}
        for key, view in self.arrays[name].items():
            problem = value_problem(view)
            if problem is not None:
                found[f"{name}/{key}"] = problem
        return found


@dataclass(frozen=True)
class MetricSpec:
    """A metric every train reply must carry: its type and its range.

    What :meth:`~flwr_prox_strategies.extend.ValidatedFedAvg.expected_train_metrics`
    returns, metric name -> spec, as ``expected_train_arrays`` declares
    records: a reply without the metric, or with a value of another type, not
    finite or out of range, is rejected with a reason naming the metric.

    Parameters
    ----------
    kind : str (default: "float")
        ``"float"`` (an int or a float) or ``"int"`` (an int; a bool is
        neither).
    minimum : float | None (default: None)
        The smallest value allowed; None: no bound.
    maximum : float | None (default: None)
        The largest value allowed; None: no bound.
    """

    kind: str = "float"
    minimum: float | None = None
    maximum: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("float", "int"):
            raise ValueError(f"kind must be 'float' or 'int', got {self.kind!r}")
        low, high = self.minimum, self.maximum
        if low is not None and high is not None and low > high:
            raise ValueError(f"minimum {low!r} is above maximum {high!r}")

    def problem(self, value: object) -> str | None:
        """Return what is wrong with ``value``, or None when it is valid.

        Parameters
        ----------
        value : object
            The metric's value in a reply.

        Returns
        -------
        str | None
            The reason, without the metric's name.
        """
        number = (int,) if self.kind == "int" else (int, float)
        if isinstance(value, bool) or not isinstance(value, number):
            return f"is {value!r}, not {'an int' if self.kind == 'int' else 'a number'}"
        if not math.isfinite(value):
            return f"is not finite ({value!r})"
        if self.minimum is not None and value < self.minimum:
            return f"is {value!r}, below its minimum {self.minimum!r}"
        if self.maximum is not None and value > self.maximum:
            return f"is {value!r}, above its maximum {self.maximum!r}"
        return None

    def example(self) -> int | float:
        """Return a valid value (what the conformance kit puts in a reply).

        Returns
        -------
        int | float
            The minimum when there is one, else 1 (or the maximum, if below).
        """
        value: float = 1.0
        if self.minimum is not None:
            value = self.minimum
        elif self.maximum is not None:
            value = min(value, self.maximum)
        if self.kind == "int":
            return math.ceil(value)
        return float(value)


def check_metrics(metrics: MetricRecord, expected: Mapping[str, MetricSpec]) -> None:
    """Reject a reply whose metrics do not meet ``expected`` (kind ``metric``).

    Raises
    ------
    ReplyRejected
        Naming the first metric missing or wrong.
    """
    for name, spec in expected.items():
        if name not in metrics:
            raise ReplyRejected(
                "metric", f"MetricRecord has no '{name}' (the strategy needs it)"
            )
        if (problem := spec.problem(metrics[name])) is not None:
            raise ReplyRejected("metric", f"metric '{name}' {problem}")


def check_weight(metrics: MetricRecord, key: str, kind: str = "num-examples") -> float:
    """Return ``metrics[key]`` if it is a finite number > 0; else reject (``kind``)."""
    if key not in metrics:
        raise ReplyRejected(kind, f"MetricRecord has no '{key}'")
    value = metrics[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReplyRejected(kind, f"'{key}' is {value!r}, not a number")
    if not math.isfinite(value):
        raise ReplyRejected(kind, f"'{key}' is not finite ({value!r})")
    if value <= 0:
        raise ReplyRejected(kind, f"'{key}' is {value!r}; it must be > 0")
    return float(value)


def _check_array_record(
    name: str, record: ArrayRecord, spec: RecordSpec, *, check_finite: bool = True
) -> dict[str, NDArray]:
    got, want = set(record.keys()), set(spec)
    if got != want:
        missing, extra = sorted(want - got), sorted(got - want)
        raise ReplyRejected(
            "array-keys",
            f"ArrayRecord '{name}' keys differ: missing {missing}, unexpected {extra}",
        )
    views: dict[str, NDArray] = {}
    for key, expected in spec.items():
        array = record[key]
        if str(array.dtype) != expected.dtype:
            raise ReplyRejected(
                "dtype",
                f"'{name}/{key}' has dtype {array.dtype}, expected {expected.dtype}"
                " (the global model's: a client training in another precision "
                "replies in the dtypes it received, as rule.reply does)",
            )
        if tuple(array.shape) != expected.shape:
            raise ReplyRejected(
                "shape",
                f"'{name}/{key}' has shape {tuple(array.shape)}, "
                f"expected {expected.shape}",
            )
        try:
            view = array_view(array)
        except ValueError as err:
            raise ReplyRejected("payload", f"'{name}/{key}': {err}") from err
        problem = value_problem(view) if check_finite else None
        if problem is not None:
            raise ReplyRejected(
                "non-finite" if problem == NON_FINITE else "out-of-range",
                f"'{name}/{key}' holds {problem}",
            )
        views[key] = view
    return views


# No honest model, update or control variate comes near this magnitude. A reply
# holding a larger value is rejected like one holding NaN, so that sums over
# up to 10^8 replies stay finite in float32 (max 3.4e38) and one finite upload
# can never make a round's model or state overflow for everyone.
MAX_ABS_VALUE = 1e30
NON_FINITE = "NaN or inf"
OUT_OF_RANGE = f"values beyond +-{MAX_ABS_VALUE:.0e}"


def value_problem(x: NDArray) -> str | None:
    """Return what is wrong with ``x``'s values (NaN/inf, out of range), or None."""
    if not np.issubdtype(x.dtype, np.inexact) or x.size == 0:
        return None
    if np.issubdtype(x.dtype, np.complexfloating):
        return None if np.isfinite(x).all() else NON_FINITE
    # Two streaming passes, no temporary; NaN propagates through min and max.
    low, high = x.min(), x.max()
    if low >= -MAX_ABS_VALUE and high <= MAX_ABS_VALUE:
        return None
    return OUT_OF_RANGE if np.isfinite(low) and np.isfinite(high) else NON_FINITE


def expected_bytes(expected_arrays: Mapping[str, RecordSpec]) -> int:
    """Bytes of the payloads an honest reply carries (``.npy`` headers excluded)."""
    return sum(
        int(np.prod(spec.shape, dtype=np.int64)) * np.dtype(spec.dtype).itemsize
        for specs in expected_arrays.values()
        for spec in specs.values()
    )


def split_records(
    message: Message,
) -> tuple[dict[str, ArrayRecord], dict[str, MetricRecord], list[str]]:
    """Return a message's ArrayRecords, MetricRecords and the names of the others.

    One pass over the content: Flower's ``array_records`` and
    ``metric_records`` each build a new synced dict, writing every record back
    into the ``RecordDict`` (some 5-10 us per reply and property).

    Parameters
    ----------
    message : Message
        A reply without an error.

    Returns
    -------
    tuple[dict[str, ArrayRecord], dict[str, MetricRecord], list[str]]
        Name -> ArrayRecord and name -> MetricRecord, in the content's order,
        and the names of the other records (ConfigRecords).
    """
    arrays: dict[str, ArrayRecord] = {}
    metrics: dict[str, MetricRecord] = {}
    others: list[str] = []
    for name, record in message.content.items():
        if isinstance(record, ArrayRecord):
            arrays[name] = record
        elif isinstance(record, MetricRecord):
            metrics[name] = record
        else:
            others.append(name)
    return arrays, metrics, others


def check_reply_size(
    message: Message,
    max_bytes: int,
    array_records: Mapping[str, ArrayRecord] | None = None,
) -> int:
    """Return the bytes of the reply's ArrayRecords; reject above ``max_bytes``.

    Reads only the stored payload lengths (``ArrayRecord.count_bytes``): no
    array is decoded. ``array_records``: the reply's, when the caller read
    them already (Flower builds a new dict at every read).
    """
    records = message.content.array_records if array_records is None else array_records
    size = sum(record.count_bytes() for record in records.values())
    if size > max_bytes:
        raise ReplyRejected(
            "too-large",
            f"ArrayRecords hold {size:,} bytes, above the limit of {max_bytes:,} "
            "(max_reply_bytes)",
        )
    return size


def validate_reply(
    message: Message,
    *,
    expected_arrays: Mapping[str, RecordSpec],
    weight_key: str = NUM_EXAMPLES_KEY,
    defer_finite: tuple[str, ...] = (),
    max_bytes: int | None = None,
) -> ValidReply:
    """Validate one reply and return its parsed content.

    Parameters
    ----------
    message : Message
        The reply.
    expected_arrays : Mapping[str, RecordSpec]
        Exactly the ArrayRecords the reply must carry, each with its layout. Empty
        for evaluation replies.
    weight_key : str
        Key of the sample count in the ``MetricRecord``.
    defer_finite : tuple[str, ...]
        Records whose NaN/inf check the caller does itself (after averaging).
    max_bytes : int | None
        Largest size of the reply's ArrayRecords, checked before anything
        else of the content is read (:func:`check_reply_size`); None: no limit.

    Raises
    ------
    ReplyRejected
        With a reason naming what is wrong.
    """
    node_id = message.metadata.src_node_id
    if message.has_error():
        reason = str(message.error.reason)
        kind = (
            "budget-exhausted"
            if reason.startswith(BUDGET_EXHAUSTED_REASON)
            else "error-reply"
        )
        raise ReplyRejected(kind, f"error reply: {client_error_text(reason)}")
    array_records, metric_records, config_names = split_records(message)
    if max_bytes is not None:
        check_reply_size(message, max_bytes, array_records)
    array_names = set(array_records.keys())
    if array_names != set(expected_arrays):
        raise ReplyRejected(
            "records",
            f"ArrayRecords {sorted(array_names)}, expected {sorted(expected_arrays)}",
        )
    if len(metric_records) != 1:
        raise ReplyRejected(
            "records",
            f"{len(metric_records)} MetricRecords, expected exactly one",
        )
    if config_names:
        raise ReplyRejected(
            "records", f"unexpected ConfigRecords {sorted(config_names)}"
        )
    metrics = next(iter(metric_records.values()))
    num_examples = check_weight(metrics, weight_key)
    arrays = {
        name: _check_array_record(
            name,
            array_records[name],
            spec,
            check_finite=name not in defer_finite,
        )
        for name, spec in expected_arrays.items()
    }
    return ValidReply(
        node_id=node_id,
        arrays=arrays,
        metrics=metrics,
        num_examples=num_examples,
        message=message,
    )


def init_keywords(cls: type, base: type) -> set[str]:
    """Return the keyword arguments ``cls(...)`` accepts, up to ``base`` included."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            names.update(
                name
                for name, param in inspect.signature(init).parameters.items()
                if name != "self"
                and param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD)
            )
        if klass is base:
            break
    return names

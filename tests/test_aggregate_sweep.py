"""The fast paths of aggregation: the same means, the same rejections.

``WeightedMean.add_all`` (the base's ``weighted_mean``) sweeps the accumulator
block by block over every reply; the validation reads each reply's records in
one pass. Both must give exactly what the reply-after-reply fold and Flower's
record properties give.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from flwr_prox_strategies import FedAvg
from flwr_prox_strategies.core.contract.validation import (
    ReplyRejected,
    split_records,
    validate_reply,
)
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
from flwr_prox_strategies.core.transport.records import array_view, spec_of, to_array
from flwr_prox_strategies.ops.aggregate import WeightedMean

NUM = 6
# A big array (several sweep blocks, not a multiple of one), a matrix, a tiny one.
SHAPES = {"w": (300_001,), "m": (40, 33), "b": (3,)}


def _round(
    dtype: type, edit: dict[int, float] | None = None
) -> tuple[FedAvg, list[Message], list[dict[str, np.ndarray]], list[float]]:
    """A strategy after configure_train, its replies, their arrays and weights."""
    grid = InProcessGrid(lambda m, c: m, num_nodes=NUM)
    strategy = FedAvg(min_available_nodes=NUM)
    model = ArrayRecord(
        {key: to_array(np.zeros(shape, dtype)) for key, shape in SHAPES.items()}
    )
    rng = np.random.default_rng(11)
    replies, arrays, weights = [], [], []
    for i, message in enumerate(
        strategy.configure_train(1, model, ConfigRecord(), grid)
    ):
        values = {
            key: rng.standard_normal(shape).astype(dtype)
            for key, shape in SHAPES.items()
        }
        if edit and i in edit:
            values["w"][123_456] = edit[i]
        content = RecordDict(
            {
                "arrays": ArrayRecord({k: to_array(v) for k, v in values.items()}),
                "metrics": MetricRecord({"num-examples": 10 + 7 * i}),
            }
        )
        replies.append(Message(content, reply_to=message))
        arrays.append(values)
        weights.append(10.0 + 7 * i)
    return strategy, replies, arrays, weights


def _one_after_another(
    arrays: list[dict[str, np.ndarray]], weights: list[float]
) -> dict[str, np.ndarray]:
    mean = WeightedMean(total=sum(weights))
    for values, weight in zip(arrays, weights, strict=True):
        mean.add(values, weight)
    return mean.result()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fedavg_gives_the_reply_after_reply_mean_bit_for_bit(dtype: type) -> None:
    strategy, replies, arrays, weights = _round(dtype)
    result, metrics = strategy.aggregate_train(1, replies)
    assert result is not None and metrics is not None
    expected = _one_after_another(arrays, weights)
    assert list(result.keys()) == list(SHAPES)
    for key, value in expected.items():
        np.testing.assert_array_equal(result[key].numpy(), value, strict=True)
    assert metrics["replies-valid"] == NUM


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_reply_is_rejected_and_the_rest_averaged_exactly(
    bad: float, caplog: pytest.LogCaptureFixture
) -> None:
    strategy, replies, arrays, weights = _round(np.float32, edit={2: bad})
    with caplog.at_level(logging.WARNING):
        result, metrics = strategy.aggregate_train(1, replies)
    assert result is not None and metrics is not None
    del arrays[2], weights[2]
    expected = _one_after_another(arrays, weights)
    for key, value in expected.items():
        np.testing.assert_array_equal(result[key].numpy(), value, strict=True)
    assert metrics["replies-valid"] == NUM - 1
    assert metrics["replies-rejected"] == 1
    assert "(non-finite): arrays/w hold NaN or inf" in caplog.text


def _reply(records: dict[str, object]) -> Message:
    """A message with ``records`` (what validate_reply reads of a reply)."""
    content = RecordDict(records)  # type: ignore[arg-type]
    return Message(content, dst_node_id=1, message_type=MessageType.TRAIN)


def _records() -> dict[str, object]:
    return {
        "arrays": ArrayRecord({"w": to_array(np.ones(3, np.float32))}),
        "metrics": MetricRecord({"num-examples": 5}),
    }


def test_split_records_equals_flowers_properties() -> None:
    records = {
        "cfg": ConfigRecord({"a": 1}),
        **_records(),
        "more": MetricRecord({"x": 1.0}),
        "other": ArrayRecord(),
    }
    message = _reply(records)
    arrays, metrics, others = split_records(message)
    content = message.content
    assert list(arrays.items()) == list(content.array_records.items())
    assert list(metrics.items()) == list(content.metric_records.items())
    assert others == list(content.config_records.keys()) == ["cfg"]


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"cfg": ConfigRecord({"a": 1})}, r"unexpected ConfigRecords \['cfg'\]"),
        ({"more": MetricRecord({"x": 1.0})}, "2 MetricRecords, expected exactly one"),
        ({"other": ArrayRecord()}, r"ArrayRecords \['arrays', 'other'\]"),
    ],
)
def test_validate_reply_still_refuses_extra_records(
    extra: dict[str, object], reason: str
) -> None:
    message = _reply({**_records(), **extra})
    spec = {"arrays": spec_of(_records()["arrays"])}  # type: ignore[arg-type]
    validate_reply(_reply(_records()), expected_arrays=spec)  # the valid one passes
    with pytest.raises(ReplyRejected, match=reason) as caught:
        validate_reply(message, expected_arrays=spec)
    assert caught.value.kind == "records"


def test_array_view_fast_path_checks_the_length_and_the_header() -> None:
    good = to_array(np.arange(6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(array_view(good), np.arange(6.0).reshape(2, 3))
    cases = {
        "payload has": good.data[:-4],  # the right header, a value short
        "payload has 28 bytes": good.data + b"\0\0\0\0",  # one value too many
        "declares": to_array(np.zeros((3, 2), np.float32)).data,  # other shape
    }
    for message, data in cases.items():
        array = Array("float32", (2, 3), "numpy.ndarray", data)
        with pytest.raises(ValueError, match=message):
            array_view(array)

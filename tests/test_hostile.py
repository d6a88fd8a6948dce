"""Hostile replies are bounded: overflow, inf through a non-linear centre,
inflated num-examples, oversized replies; and a dead node is named.

All in-process, built by hand (Flower's own code builds the SuperLink's reply
for a dead node).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import Array, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from flwr_prox_strategies import FedAvg, FedDC, FedEPM, FedProx, PFedAvg, Scaffold
from flwr_prox_strategies.core.contract.validation import (
    MAX_ABS_VALUE,
    NON_FINITE,
    OUT_OF_RANGE,
    value_problem,
)
from flwr_prox_strategies.core.server.strategy import ValidatedFedAvg
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid

from .helpers import logged, model_arrays, record, reply, sampling_grid
from .test_contract import build_reply, good_content

BIG = np.float32(3e38)  # finite; four of them overflow a float32 sum
F32_MAX = np.finfo(np.float32).max


def configure(strategy, grid, arrays=None) -> list[Message]:
    arrays = model_arrays() if arrays is None else arrays
    return list(strategy.configure_train(1, record(arrays), ConfigRecord(), grid))


def to_np(arrays) -> dict[str, np.ndarray]:
    assert arrays is not None
    return {key: value.numpy() for key, value in arrays.items()}


def contents(strategy, n: int) -> list[dict[str, dict[str, np.ndarray]]]:
    """Every record the strategy expects, per node; node 0's model holds 3e38."""
    out = [good_content(strategy, i) for i in range(n)]
    out[0]["arrays"]["w"][0, 0] = BIG
    out[0]["arrays"]["b"][:] = BIG
    return out


def huge_replies(strategy, messages: list[Message]):
    """Four replies weighted 10 to 13, node 0's upload huge: content, weights, replies."""
    content = contents(strategy, 4)
    weights = [10.0 + i for i in range(4)]
    replies = [
        build_reply(m, c, n=w, strategy=strategy)
        for m, c, w in zip(messages, content, weights, strict=True)
    ]
    return content, weights, replies


def mean64(models: list[dict[str, np.ndarray]], weights: list[float]) -> dict:
    total = sum(weights)
    return {
        key: sum(
            w * m[key].astype(np.float64) for m, w in zip(models, weights, strict=True)
        )
        / total
        for key in models[0]
    }


# ------------------------------------------------------------------ overflow
@pytest.mark.parametrize(
    "make",
    [
        lambda: FedAvg(min_available_nodes=4),
        lambda: FedProx(mu=0.1, min_available_nodes=4),
    ],
    ids=["fedavg", "fedprox"],
)
def test_one_huge_finite_upload_gives_the_true_mean(make) -> None:
    strategy = make()
    messages = configure(strategy, sampling_grid(4))
    content, weights, replies = huge_replies(strategy, messages)
    arrays, metrics = strategy.aggregate_train(1, replies)
    got = to_np(arrays)
    want = mean64([c["arrays"] for c in content], weights)
    assert metrics["replies-valid"] == 4 and metrics["replies-rejected"] == 0
    for key in want:
        assert got[key].dtype == np.float32
        assert np.all(np.isfinite(got[key]))
        np.testing.assert_allclose(got[key], want[key].astype(np.float32), rtol=2e-7)
    assert got["b"][0] == pytest.approx(3e38 * 10 / 46, rel=1e-6)  # ~6.5e37
    # Flower's FedAvg (which normalises the weights first) agrees.
    flower, _ = FlowerFedAvg().aggregate_train(1, replies)
    for key in want:
        np.testing.assert_allclose(got[key], flower[key].numpy(), rtol=1e-6)


@pytest.mark.parametrize("correction", ["official", "paper"])
def test_feddc_with_one_huge_upload_equals_its_float64_update(correction) -> None:
    strategy = FedDC(alpha=0.1, num_clients=4, correction=correction)
    initial = model_arrays()
    messages = configure(strategy, sampling_grid(4), initial)
    content, weights, replies = huge_replies(strategy, messages)
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert metrics["replies-valid"] == 4
    models = [c["arrays"] for c in content]
    # FedDC's default: uniform for its official code, by samples for the seed.
    want = mean64(models, [1.0] * 4 if correction == "official" else weights)
    if correction == "official":  # + H/N, H the summed drifts from zero
        for key in want:
            drift = sum(m[key].astype(np.float64) - initial[key] for m in models)
            want[key] = want[key] + drift / 4
    got = to_np(arrays)
    for key in want:
        assert np.all(np.isfinite(got[key]))
        np.testing.assert_allclose(got[key], want[key].astype(np.float32), rtol=1e-6)


def test_a_mean_at_the_float32_limit_is_recomputed_in_float64(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Ten uploads of float32's largest value, equal weights: 0.1 rounds up in
    # float32, the float32 sum overflows; the true mean (the value) fits.
    strategy = FedAvg(min_available_nodes=10, weighting="uniform")
    messages = configure(strategy, sampling_grid(10))
    full = {"w": np.full((4, 3), F32_MAX), "b": np.full(3, F32_MAX)}
    replies = [reply(m, full) for m in messages]
    with caplog.at_level(logging.WARNING):
        arrays, metrics = strategy.aggregate_train(1, replies)
    assert metrics["replies-valid"] == 10
    for value in to_np(arrays).values():
        np.testing.assert_array_equal(value, F32_MAX)
    assert logged(caplog, "recomputing it in float64")


def test_values_beyond_the_bound_are_named_apart_from_nan() -> None:
    assert value_problem(np.array([1.0, -1e29], np.float32)) is None
    assert value_problem(np.array([1.0, -2e30], np.float32)) == OUT_OF_RANGE
    assert value_problem(np.array([1.0, np.inf], np.float32)) == NON_FINITE
    assert value_problem(np.array([np.nan, 2e30])) == NON_FINITE
    assert value_problem(np.array([10**12], np.int64)) is None  # not a float
    assert value_problem(np.zeros(0, np.float32)) is None
    assert MAX_ABS_VALUE * 1e8 < F32_MAX  # 10^8 bounded values sum in float32


def test_two_huge_uploads_cannot_void_feddcs_round(caplog) -> None:
    """Their float32 drift sum overflows even in the float64 pass: they alone
    are rejected and the round equals one without them."""

    def run(keep: list[int]):
        strategy = FedDC(alpha=0.1, num_clients=4, min_round_nodes=1)
        messages = configure(strategy, sampling_grid(4), model_arrays())
        content = [good_content(strategy, i) for i in range(4)]
        for i in (0, 1):
            content[i]["arrays"]["b"][:] = BIG
        replies = [
            build_reply(messages[i], content[i], strategy=strategy) for i in keep
        ]
        return strategy, *strategy.aggregate_train(1, replies)

    with caplog.at_level(logging.WARNING):
        strategy, arrays, metrics = run([0, 1, 2, 3])
    assert arrays is not None, "the round was voided"
    assert metrics["replies-valid"] == 2
    assert strategy.rejections["aggregate_train:out-of-range"] == 2
    assert "(out-of-range): arrays/b hold values beyond" in caplog.text
    reference, want, _ = run([2, 3])
    for key, value in to_np(want).items():
        np.testing.assert_allclose(to_np(arrays)[key], value, rtol=1e-6)
    for key, value in reference.drift_sum.items():
        np.testing.assert_allclose(strategy.drift_sum[key], value, rtol=1e-6)


def test_a_huge_control_variate_update_is_rejected_alone() -> None:
    strategy = Scaffold(num_clients=4, min_round_nodes=1)
    messages = configure(strategy, sampling_grid(4), model_arrays())
    content = [good_content(strategy, i) for i in range(4)]
    (control,) = (name for name in content[0] if name != "arrays")
    for i in (0, 1):  # two of them: their float32 sum would be inf
        content[i][control]["w"][:] = BIG
    replies = [
        build_reply(m, c, strategy=strategy)
        for m, c in zip(messages, content, strict=True)
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and metrics["replies-valid"] == 2
    assert metrics["replies-rejected"] == 2
    assert all(np.isfinite(v).all() for v in strategy.control.values())


# ------------------------------------------------------- inf through FedEPM
@pytest.mark.parametrize("lam", [None, 10.0])
def test_fedepm_rejects_inf_before_it_enters_the_table(lam) -> None:
    def round_with(bad: bool):
        strategy = FedEPM(num_clients=4, rho=1.0, lam=lam)
        messages = configure(strategy, sampling_grid(4))
        replies = []
        for i, m in enumerate(messages):
            content = good_content(strategy, i)
            if bad and i == 0:
                content["arrays"]["w"][1, 2] = np.inf  # the centre would hide it
            replies.append(build_reply(m, content, strategy=strategy))
        return strategy, strategy.aggregate_train(1, replies if bad else replies[1:])

    strategy, (arrays, metrics) = round_with(bad=True)
    _, (clean, _) = round_with(bad=False)
    assert metrics["replies-rejected"] == 1 and metrics["replies-valid"] == 3
    assert strategy.rejections["aggregate_train:non-finite"] == 1
    assert strategy.uploads is not None
    assert all(np.all(np.isfinite(table)) for table in strategy.uploads.values())
    assert 1 not in strategy.slots  # client key 1 (node 1001) never got a slot
    for key, value in to_np(arrays).items():
        assert value.tobytes() == to_np(clean)[key].tobytes()


# --------------------------------------------------------- num-examples cap
def lying_round(strategy: ValidatedFedAvg, caplog=None):
    """Four clients: 100/110/120 examples uploading ~1, one claiming 1e12 with 3."""
    messages = configure(strategy, sampling_grid(4))
    claims = [1e12, 100, 110, 120]
    values = [3.0, 1.0, 1.1, 0.9]
    replies = [
        reply(
            m,
            {"w": np.full((4, 3), v, np.float32), "b": np.full(3, v, np.float32)},
            num_examples=n,
            metrics={"train-loss": 1.0, "client-key": 7 + i},
        )
        for i, (m, n, v) in enumerate(zip(messages, claims, values, strict=True))
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    return float(to_np(arrays)["w"][0, 0]), metrics


HONEST_MEAN = (100 * 1.0 + 110 * 1.1 + 120 * 0.9) / 330


def test_without_a_cap_the_liar_takes_over() -> None:
    model, metrics = lying_round(FedAvg(min_available_nodes=4, max_weight_ratio=None))
    assert model == pytest.approx(3.0, abs=1e-6)
    assert metrics["replies-capped"] == 0


def test_an_inflated_claim_is_capped_and_logged(caplog) -> None:
    # The deployment knows its largest partition (120): the cap binds the liar
    # only, and the model stays near the honest clients' mean.
    strategy = FedAvg(min_available_nodes=4, max_num_examples=120)
    with caplog.at_level(logging.WARNING):
        model, metrics = lying_round(strategy)
    want = (120 * 3.0 + 100 * 1.0 + 110 * 1.1 + 120 * 0.9) / 450
    assert model == pytest.approx(want, rel=1e-6)
    assert abs(model - HONEST_MEAN) < 0.3 * abs(3.0 - HONEST_MEAN)
    assert metrics["replies-capped"] == 1
    assert metrics["num-examples"] == 450  # the capped claim is the one used
    lines = [r.getMessage() for r in caplog.records if "capped to" in r.getMessage()]
    assert lines == [
        "aggregate_train: round 1: node 1001 (client key 7) claims num-examples "
        "1e+12: capped to 120 (max_num_examples=120)"
    ]


def test_the_default_cap_is_relative_to_the_round_median(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        model, metrics = lying_round(FedAvg(min_available_nodes=4))
    cap = 100 * 110.0  # median claim of the round (lower middle of four): 110
    want = (cap * 3.0 + 100 * 1.0 + 110 * 1.1 + 120 * 0.9) / (cap + 330)
    assert model == pytest.approx(want, rel=1e-6)
    assert metrics["replies-capped"] == 1
    assert logged(
        caplog, "capped to 11000 (max_weight_ratio=100 x the round's median claim 110)"
    )


def test_one_liar_cannot_raise_the_median_even_among_two() -> None:
    strategy = FedAvg(min_available_nodes=2)
    messages = configure(strategy, sampling_grid(2))
    replies = [
        reply(m, model_arrays(i), num_examples=n)
        for i, (m, n) in enumerate(zip(messages, [1e12, 100], strict=True))
    ]
    _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["replies-capped"] == 1
    assert metrics["num-examples"] == 100 * 100 + 100


def test_the_default_cap_leaves_a_skewed_honest_round_alone() -> None:
    # Partition sizes as Dirichlet(0.1) on Adult makes them: 60x the median.
    strategy = FedAvg(min_available_nodes=5)
    messages = configure(strategy, sampling_grid(5))
    claims = [5, 40, 60, 80, 3600]
    replies = [
        reply(m, model_arrays(i), num_examples=n)
        for i, (m, n) in enumerate(zip(messages, claims, strict=True))
    ]
    _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["replies-capped"] == 0 and metrics["num-examples"] == sum(claims)


def test_cap_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="max_weight_ratio must be >= 1"):
        FedAvg(max_weight_ratio=0.5)
    with pytest.raises(ValueError, match="max_num_examples"):
        FedAvg(max_num_examples=0)
    with pytest.raises(ValueError, match="max_reply_bytes"):
        FedAvg(max_reply_bytes=0)


# --------------------------------------------------------------- reply size
def garbage(num_bytes: int) -> Array:
    """An Array whose payload is not even an .npy: decoding it would fail."""
    return Array("float32", (num_bytes // 4,), "numpy.ndarray", b"\0" * num_bytes)


def test_an_oversized_reply_is_rejected_before_decoding() -> None:
    strategy = FedAvg(min_available_nodes=4)
    messages = configure(strategy, sampling_grid(4))
    replies = [reply(m, model_arrays(i)) for i, m in enumerate(messages)]
    # Default limit: 2 x the model's 60 payload bytes + 1 MiB.
    assert strategy.reply_size_limit(strategy.expected_train_arrays(1)) == (120 + 2**20)
    replies[0].content["arrays"]["junk"] = garbage(2**20 + 4)
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None
    assert metrics["replies-valid"] == 3 and metrics["replies-rejected"] == 1
    assert strategy.rejections == {"aggregate_train:too-large": 1}


def test_max_reply_bytes_is_an_absolute_limit() -> None:
    strategy = FedAvg(min_available_nodes=2, max_reply_bytes=100)
    messages = configure(strategy, sampling_grid(2))
    small = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.float32)}
    _, metrics = strategy.aggregate_train(1, [reply(m, small) for m in messages])
    # Each reply holds 2 x 128 bytes of .npy headers plus 60 of payload.
    assert metrics["replies-valid"] == 0 and metrics["replies-rejected"] == 2
    assert strategy.rejections == {"aggregate_train:too-large": 2}


# ---------------------------------------------------------------- dead node
def echo_app(message: Message, context: Context) -> Message:
    metrics = MetricRecord({"num-examples": 10, "accuracy": 0.5})
    if message.metadata.message_type.startswith("evaluate"):
        return Message(RecordDict({"metrics": metrics}), reply_to=message)
    content = RecordDict({"arrays": message.content["arrays"], "metrics": metrics})
    return Message(content, reply_to=message)


def test_a_dead_nodes_reply_counts_as_failed_and_names_it(caplog) -> None:
    grid = InProcessGrid(echo_app, num_nodes=4)
    grid.dead_nodes.add(1003)
    strategy = FedAvg(min_available_nodes=4)
    with caplog.at_level(logging.INFO):
        result = strategy.start(grid, record(model_arrays()), num_rounds=1)
    train = result.train_metrics_clientapp[1]
    assert train["replies-valid"] == 3
    assert train["replies-failed"] == 1 and train["replies-rejected"] == 0
    assert strategy.rejections == {
        "aggregate_train:error-reply": 1,
        "aggregate_evaluate:error-reply": 1,
    }
    assert strategy.run_tally.nodes == {1003}
    [(reason, count)] = strategy.run_tally.failed.items()
    assert count == 1 and reason.startswith("Error: Node Unavailable")
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "reply from node 1003 not used (error-reply)" in text
    assert "node 1 " not in text and "unsampled" not in text


def test_p_fedavg_routes_a_dead_nodes_reply_to_its_server() -> None:
    grid = InProcessGrid(echo_app, num_nodes=4)
    grid.dead_nodes.add(1002)
    strategy = PFedAvg(servers=2, assignment={1001 + i: i % 2 for i in range(4)})
    result = strategy.start(grid, record(model_arrays()), num_rounds=1)
    report = result.train_metrics_clientapp[1]
    assert report["replies-failed"] == 1 and report["replies-rejected"] == 0
    server = strategy.inner[1]
    assert isinstance(server, ValidatedFedAvg)
    assert server.run_tally.nodes == {1002}
    assert strategy.rejections == {"aggregate_train:error-reply": 1}


# ------------------------------------------------------------ round timeout
class TimedGrid(InProcessGrid):
    """Records the timeout every send_and_receive is given."""

    timeouts: list[float | None]

    def send_and_receive(self, messages, *, timeout=None):
        self.timeouts.append(timeout)
        return super().send_and_receive(messages, timeout=timeout)


def test_the_app_passes_round_timeout_to_flower(tmp_path) -> None:
    from apps.client_app import app as client_app
    from flwr_prox_strategies.experiment.server import run_experiment

    run_config = {
        "overrides": "num_clients=2 num_rounds=1 model=logreg round_timeout=42.5",
        "output-dir": str(tmp_path),
    }
    grid = TimedGrid(client_app, num_nodes=2, run_config=run_config)
    grid.timeouts = []
    run_experiment(grid, run_config)
    assert grid.timeouts and set(grid.timeouts) == {42.5}


def test_a_silent_node_is_counted_failed_and_named(caplog) -> None:
    """A sampled node whose reply never came (Flower's round timeout passed)."""
    strategy = FedAvg(min_available_nodes=4)
    messages = configure(strategy, sampling_grid(4))
    content = [good_content(strategy, i) for i in range(4)]
    replies = [
        build_reply(m, c, strategy=strategy)
        for m, c in zip(messages[1:], content[1:], strict=True)
    ]
    with caplog.at_level(logging.WARNING):
        arrays, metrics = strategy.aggregate_train(1, replies)
    silent = messages[0].metadata.dst_node_id
    assert arrays is not None  # accept_failures: the others' round goes on
    assert metrics["replies-valid"] == 3 and metrics["replies-failed"] == 1
    assert strategy.rejections["aggregate_train:no-reply"] == 1
    assert f"reply from node {silent} not used (no-reply)" in caplog.text

"""Secure aggregation (SecAgg+): the same models as plain aggregation within the
quantisation bound, nothing individual reaches the server, dropouts survived,
hostile replies named, bad settings refused at construction."""

from __future__ import annotations

import copy
import hashlib
import logging

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)

from flwr_prox_strategies import (
    APFL,
    APFLClient,
    FedAvg,
    FedAvgClient,
    FedDC,
    FedDCClient,
    FedDyn,
    FedDynClient,
    FedEPM,
    FedProx,
    FedProxClient,
    NoRoundAggregatedError,
    Scaffold,
    ScaffoldClient,
    SecAggPlus,
    SecAggPlusMod,
    to_client_app,
)
from flwr_prox_strategies.core.client.secagg import SecureAggregationRefused
from flwr_prox_strategies.core.transport.flower import set_task_identity
from flwr_prox_strategies.core.transport.inprocess import (
    InProcessGrid,
    node_unavailable_reply,
)
from flwr_prox_strategies.core.transport.secagg import (
    SECAGG_RECORD,
    Key,
    Layout,
    Quantizer,
    Stage,
    add_masks,
    expand_mask,
    neighbours,
)
from flwr_prox_strategies.extend import RoundUpdate, ValidatedFedAvg
from flwr_prox_strategies.testing.federation import LeastSquares

from .helpers import logged

NODES = 5
CLIP = 64.0  # the least-squares optima reach about 12
PROBLEM = LeastSquares(num_clients=NODES, dim=5)
CLIENT = {"learning_rate": 0.05, "local_epochs": 2}

ALGORITHMS = {
    "FedAvg": (FedAvg, FedAvgClient, {}),
    "FedProx": (FedProx, FedProxClient, {}),
    "SCAFFOLD": (Scaffold, ScaffoldClient, {"num_clients": NODES}),
    "FedDyn": (FedDyn, FedDynClient, {"num_clients": NODES}),
    "FedDC": (FedDC, FedDCClient, {"num_clients": NODES}),
    "APFL": (APFL, APFLClient, {}),
}


def strategy(cls, options, **more):
    return cls(
        min_train_nodes=NODES,
        min_available_nodes=NODES,
        fraction_evaluate=0.0,
        **options,
        **more,
    )


class Recorder:
    """A ClientApp around the pack's: keeps every reply, can kill a node or
    corrupt one stage's answer."""

    def __init__(self, client_cls, *, secure=True, **client_kwargs):
        self.app = to_client_app(
            PROBLEM.client_fn(client_cls, **{**CLIENT, **client_kwargs}),
            secure_aggregation=secure,
        )
        self.replies: list[Message] = []
        self.kill: tuple[int, str] | None = None  # (node, stage it dies at)
        self.tamper: dict[tuple[int, str], callable] = {}
        self.grid: InProcessGrid | None = None

    def __call__(self, message: Message, context: Context) -> Message:
        node = message.metadata.dst_node_id
        record = message.content.config_records.get(SECAGG_RECORD)
        stage = record.get(Key.STAGE) if record is not None else None
        if self.kill == (node, stage):
            self.grid.dead_nodes.add(node)
            return node_unavailable_reply(message)
        reply = self.app(message, context)
        if (node, stage) in self.tamper and not reply.has_error():
            self.tamper[(node, stage)](reply)
        # As sent (the server rewrites the replies it screens).
        self.replies.append(copy.deepcopy(reply))
        return reply

    def run(self, wrapped, rounds=1):
        self.grid = InProcessGrid(self, num_nodes=NODES)
        result = wrapped.start(
            grid=self.grid, initial_arrays=PROBLEM.initial(), num_rounds=rounds
        )
        return result.arrays.to_numpy_ndarrays()[0][0]


def secure(inner, **options):
    return SecAggPlus(inner, clipping_range=CLIP, **options)


def plain_and_secure(name, rounds, **more):
    cls, options, client_kwargs = ALGORITHMS[name][0], ALGORITHMS[name][2], {}
    client = ALGORITHMS[name][1]
    plain = Recorder(client, **client_kwargs).run(
        strategy(cls, options, **more), rounds
    )
    wrapped = secure(strategy(cls, options, **more))
    metrics = round_metrics(wrapped)
    return plain, Recorder(client).run(wrapped, rounds), metrics


def round_metrics(wrapped):
    """Return the list each ``aggregate_train`` of ``wrapped`` appends its metrics to."""
    metrics = []
    original = wrapped.aggregate_train

    def spy(server_round, replies):
        out = original(server_round, replies)
        metrics.append(out[1])
        return out

    wrapped.aggregate_train = spy
    return metrics


# FedDyn's and FedDC's model adds the drift sum over K to the mean: its error
# bound adds the plain sum's over K.
DRIFT_OVER_K = {"FedDyn", "FedDC"}


def model_bound(name, metrics):
    extra = metrics["secagg-sum-error-bound"] / NODES if name in DRIFT_OVER_K else 0
    return metrics["secagg-error-bound"] + extra


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_one_round_equals_plain_aggregation_within_the_bound(name):
    plain, masked, metrics = plain_and_secure(name, rounds=1)
    bound = model_bound(name, metrics[0])
    assert metrics[0]["secagg-contributors"] == NODES
    assert metrics[0]["secagg-sum-error-bound"] == NODES * 2 * CLIP / 2**22
    assert 0 < np.abs(masked - plain).max() <= bound, (masked - plain, bound)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_rounds_stay_within_the_accumulated_bound(name):
    rounds = 4
    plain, masked, metrics = plain_and_secure(name, rounds=rounds)
    assert len(metrics) == rounds
    # Each round's error enters the next round's start; least squares with a
    # small step neither amplifies it much nor cancels it.
    total = sum(model_bound(name, m) for m in metrics)
    assert np.abs(masked - plain).max() <= total
    assert PROBLEM.relative_error(masked) < PROBLEM.relative_error(np.zeros(5))


def test_uniform_weights_mask_each_record_once_and_cost_two_quanta():
    plain, masked, metrics = plain_and_secure("FedDyn", 1, weighting="uniform")
    assert metrics[0]["secagg-error-bound"] == pytest.approx(2 * CLIP / 2**22)
    assert np.abs(masked - plain).max() <= model_bound("FedDyn", metrics[0])
    layout = Layout.from_declaration(
        {"arrays": ("mean", "sum")}, {"arrays": {"w": (1, 5)}}, uniform=True
    )
    assert layout.kinds == ("sum",)


def test_the_mlp_on_digits_aggregates_within_the_bound():
    from sklearn.datasets import load_digits
    from torch.utils.data import DataLoader, TensorDataset

    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x / 16, dtype=torch.float32), torch.tensor(y))

    def client_fn(context):
        k = int(context.node_config["partition-id"])
        torch.manual_seed(k)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
        )
        part = torch.utils.data.Subset(data, range(60 * k, 60 * k + 60))
        return ScaffoldClient(model, DataLoader(part, batch_size=60), learning_rate=0.1)

    torch.manual_seed(0)
    init = torch.nn.Sequential(
        torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
    )
    initial = ArrayRecord(init.state_dict())
    finals, bounds = [], []
    for wrap in (lambda s: s, lambda s: SecAggPlus(s, max_weight=100.0)):
        grid = InProcessGrid(to_client_app(client_fn), num_nodes=3)
        inner = Scaffold(
            num_clients=3, min_train_nodes=3, min_available_nodes=3, fraction_evaluate=0
        )
        wrapped = wrap(inner)
        result = wrapped.start(grid=grid, initial_arrays=initial, num_rounds=1)
        finals.append(
            np.concatenate([a.ravel() for a in result.arrays.to_numpy_ndarrays()])
        )
        if wrapped is not inner:
            bounds.append(3 * 3 * 8.0 / (2**22 * (3 * 60 / 100.0)))
    assert 0 < np.abs(finals[0] - finals[1]).max() <= bounds[0]


def test_the_server_never_receives_an_individual_update():
    recorder = Recorder(ScaffoldClient)
    recorder.run(secure(strategy(Scaffold, {"num_clients": NODES})), rounds=1)
    plain = Recorder(ScaffoldClient)
    plain.run(strategy(Scaffold, {"num_clients": NODES}), rounds=1)
    updates = [
        arr.numpy().tobytes()
        for reply in plain.replies
        for record in reply.content.array_records.values()
        for arr in record.values()
    ]
    assert len(updates) == 2 * NODES  # each client's model and control delta
    stages = {Stage.SETUP: 0, Stage.SHARE_KEYS: 0, Stage.COLLECT_MASKED_VECTORS: 0}
    for reply in recorder.replies:
        assert not reply.content.array_records  # no array in any stage
        record = reply.content.config_records[SECAGG_RECORD]
        blob = b"".join(
            v
            if isinstance(v, bytes)
            else b"".join(x for x in v if isinstance(x, bytes))
            for v in record.values()
            if isinstance(v, (bytes, list))
        )
        for update in updates:
            assert update[:16] not in blob
        if Key.MASKED_PARAMETERS in record:
            stages[Stage.COLLECT_MASKED_VECTORS] += 1
        elif Key.PUBLIC_KEY_1 in record:
            stages[Stage.SETUP] += 1
        elif Key.CIPHERTEXT_LIST in record:
            stages[Stage.SHARE_KEYS] += 1
    assert stages == {stage: NODES for stage in stages}


def test_a_client_that_dies_after_sharing_keys_leaves_the_round_aggregated(caplog):
    recorder = Recorder(FedAvgClient)
    recorder.kill = (1003, Stage.COLLECT_MASKED_VECTORS)
    wrapped = secure(strategy(FedAvg, {}, accept_failures=True))
    grid = InProcessGrid(recorder, num_nodes=NODES)
    recorder.grid = grid
    arrays = PROBLEM.initial()
    messages = list(wrapped.configure_train(1, arrays, ConfigRecord(), grid))
    replies = grid.send_and_receive(messages)
    model, record = wrapped.aggregate_train(1, replies)
    assert model is not None
    assert record["secagg-contributors"] == NODES - 1
    assert record["secagg-dropped"] == 1
    # It equals plain FedAvg over the four others.
    plain = Recorder(FedAvgClient)
    plain.grid = InProcessGrid(plain, num_nodes=NODES)
    plain.grid.dead_nodes.add(1003)
    inner = strategy(FedAvg, {}, accept_failures=True)
    sent = list(inner.configure_train(1, arrays, ConfigRecord(), plain.grid))
    expected, _ = inner.aggregate_train(1, plain.grid.send_and_receive(sent))
    diff = np.abs(model.to_numpy_ndarrays()[0] - expected.to_numpy_ndarrays()[0]).max()
    assert 0 < diff <= record["secagg-error-bound"]


def _garbage_keys(reply):
    reply.content.config_records[SECAGG_RECORD][Key.PUBLIC_KEY_1] = b"not a key"


def _wrong_destinations(reply):
    reply.content.config_records[SECAGG_RECORD][Key.DESTINATION_LIST] = [1, 2]


def _short_vector(reply):
    record = reply.content.config_records[SECAGG_RECORD]
    record[Key.MASKED_PARAMETERS] = record[Key.MASKED_PARAMETERS][:-4]


def _corrupt_shares(reply):
    record = reply.content.config_records[SECAGG_RECORD]
    record[Key.SHARE_LIST] = [
        s[:4] + bytes(b ^ 0x5A for b in s[4:]) for s in record[Key.SHARE_LIST]
    ]


@pytest.mark.parametrize(
    ("stage", "tamper", "named"),
    [
        (Stage.SETUP, _garbage_keys, "malformed public keys"),
        (Stage.SHARE_KEYS, _wrong_destinations, "malformed shares"),
        (Stage.COLLECT_MASKED_VECTORS, _short_vector, "masked vector of"),
        (Stage.UNMASK, _corrupt_shares, "is corrupt"),
    ],
)
def test_garbage_in_any_stage_is_named_and_the_round_still_aggregates(
    stage, tamper, named, caplog
):
    recorder = Recorder(FedAvgClient)
    recorder.tamper[(1002, stage)] = tamper
    wrapped = secure(strategy(FedAvg, {}))
    with caplog.at_level(logging.WARNING):
        theta = recorder.run(wrapped, rounds=1)
    lines = [r.getMessage() for r in caplog.records if "node 1002" in r.getMessage()]
    assert any(named in line for line in lines), lines
    assert PROBLEM.relative_error(theta) < PROBLEM.relative_error(np.zeros(5))
    if stage != Stage.UNMASK:  # a bad share holder's own vector is still in
        assert wrapped.strategy.run_tally.aggregated == 1


def test_a_clientapp_without_the_mod_fails_the_round_naming_the_mod(caplog):
    recorder = Recorder(FedAvgClient, secure=False)
    with caplog.at_level(logging.WARNING), pytest.raises(NoRoundAggregatedError):
        recorder.run(secure(strategy(FedAvg, {})), rounds=1)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "SecAggPlusMod()" in text


def test_a_round_that_cannot_be_unmasked_keeps_the_previous_model(caplog):
    recorder = Recorder(FedAvgClient)
    for node in (1001, 1002, 1003):  # 2 of 5 left: below the threshold 3
        recorder.tamper[(node, Stage.COLLECT_MASKED_VECTORS)] = _short_vector
    with caplog.at_level(logging.WARNING), pytest.raises(NoRoundAggregatedError):
        recorder.run(secure(strategy(FedAvg, {})), rounds=1)
    assert logged(caplog, "cannot be unmasked")


class _Median(ValidatedFedAvg):
    def server_update(self, server_round, state, replies):
        return RoundUpdate(replies[0].message.content.array_records["arrays"])


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: SecAggPlus(FedEPM()), "elastic-net"),
        (lambda: SecAggPlus(_Median()), "without declaring secure_sums"),
        (lambda: SecAggPlus(FedProx(monitor_dissimilarity=True)), "dissimilarity"),
        (
            lambda: SecAggPlus(FedAvg(min_train_nodes=2), reconstruction_threshold=3),
            "min_train_nodes",
        ),
        (lambda: SecAggPlus(FedAvg(), num_shares=2), "num_shares"),
        (lambda: SecAggPlus(FedAvg(), num_shares=1.5), "num_shares"),
        (
            lambda: SecAggPlus(
                FedAvg(min_train_nodes=5), num_shares=3, reconstruction_threshold=4
            ),
            "<= num_shares",
        ),
        (lambda: SecAggPlus(FedAvg(), clipping_range=0.0), "clipping_range"),
        (lambda: SecAggPlus(FedAvg(), max_weight=float("inf")), "max_weight"),
        (lambda: SecAggPlus(FedAvg(), modulus_range=3 * 2**30), "power of 2"),
        (
            lambda: SecAggPlus(FedAvg(), quantization_range=2**33, modulus_range=2**32),
            "modulus_range",
        ),
        (lambda: SecAggPlus(object()), "single-model"),
    ],
)
def test_bad_settings_are_refused_at_construction(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def _collect_message(layout, weight_key="num-examples"):
    config = ConfigRecord(
        {
            Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
            "server-round": 1,
            Key.SOURCE_LIST: [],
            Key.CIPHERTEXT_LIST: [],
            "weight-key": weight_key,
            **layout.config(),
        }
    )
    return Message(
        RecordDict(
            {"arrays": ArrayRecord([np.zeros(3, np.float32)]), SECAGG_RECORD: config}
        ),
        dst_node_id=1001,
        message_type="train",
        group_id="1",
    )


def _mod_in_collect_stage(reply_arrays, num_examples=10.0, threshold=1):
    """Run setup, share_keys (a neighbourhood of one) and collect on one node."""
    set_task_identity(1)  # hand-built messages need one (a grid sets it)
    mod, context = SecAggPlusMod(), Context(1, 1001, {}, RecordDict(), {})
    setup = ConfigRecord(
        {
            Key.STAGE: Stage.SETUP,
            "server-round": 1,
            Key.SAMPLE_NUMBER: 1,
            Key.SHARE_NUMBER: 1,
            Key.THRESHOLD: threshold,
            Key.CLIPPING_RANGE: 8.0,
            Key.TARGET_RANGE: 2**22,
            Key.MOD_RANGE: 2**32,
            Key.MAX_WEIGHT: 100.0,
        }
    )

    def message(config):
        return Message(
            RecordDict({SECAGG_RECORD: config}),
            dst_node_id=1001,
            message_type="train",
            group_id="1",
        )

    keys = mod(message(setup), context, None).content.config_records[SECAGG_RECORD]
    mod(
        message(
            ConfigRecord(
                {
                    Key.STAGE: Stage.SHARE_KEYS,
                    "server-round": 1,
                    "1001": [keys[Key.PUBLIC_KEY_1], keys[Key.PUBLIC_KEY_2]],
                }
            )
        ),
        context,
        None,
    )
    layout = Layout(("arrays",), ("mean",), (3,), (("0",),))

    def train(msg, ctx):
        assert SECAGG_RECORD not in msg.content.config_records  # the app sees its own
        return Message(
            RecordDict(
                {
                    "arrays": _record(reply_arrays),
                    "metrics": MetricRecord({"num-examples": num_examples}),
                }
            ),
            reply_to=msg,
        )

    return mod(_collect_message(layout), context, train)


def _record(values):
    from flwr_prox_strategies.core.transport.records import dict_to_record

    return dict_to_record({"0": values})


def test_the_mod_masks_a_reply_it_can_and_refuses_what_it_cannot():
    reply = _mod_in_collect_stage(np.array([0.5, -9.0, 1.0], np.float32))
    assert not reply.content.array_records
    # -9 is clipped (to c = 8, before weighting), but how many values one
    # client clipped is masked with its vector: no plain count leaves.
    assert not any("clipped" in key for key in reply.content.metric_records["metrics"])
    with pytest.raises(SecureAggregationRefused, match="NaN or inf"):
        _mod_in_collect_stage(np.array([0.5, np.nan, 1.0], np.float32))
    with pytest.raises(SecureAggregationRefused, match="max_weight"):
        _mod_in_collect_stage(np.zeros(3, np.float32), num_examples=101.0)
    with pytest.raises(SecureAggregationRefused, match="holds 2 values"):
        _mod_in_collect_stage(np.zeros(2, np.float32))


def test_the_mod_never_gives_both_shares_of_a_node():
    recorder = Recorder(FedAvgClient)
    grid = InProcessGrid(recorder, num_nodes=NODES)
    recorder.grid = grid
    wrapped = secure(strategy(FedAvg, {}))
    messages = list(wrapped.configure_train(1, PROBLEM.initial(), ConfigRecord(), grid))
    grid.send_and_receive(messages)
    ask = Message(
        RecordDict(
            {
                SECAGG_RECORD: ConfigRecord(
                    {
                        Key.STAGE: Stage.UNMASK,
                        "server-round": 1,
                        Key.ACTIVE_NODE_ID_LIST: [1001, 1002, 1003],
                        Key.DEAD_NODE_ID_LIST: [1002],
                    }
                )
            }
        ),
        dst_node_id=1001,
        message_type="train",
        group_id="1",
    )
    with pytest.raises(SecureAggregationRefused, match="both shares"):
        SecAggPlusMod()(ask, grid.contexts[1001], None)


def test_masks_use_every_bit_of_the_seed_and_neighbourhoods_are_symmetric():
    a = expand_mask(b"\x01" + bytes(31), 1000)
    b = expand_mask(bytes(32), 1000)
    assert a.min() >= 0 and a.max() < 2**32 and not np.array_equal(a, b)
    # Flower's generator folds the seed to 32 bits: these two collide there.
    assert not np.array_equal(
        expand_mask(b"\x01\x00\x00\x00\x01" + bytes(27), 10),
        expand_mask(b"\x00\x00\x00\x00\x00" + bytes(27), 10),
    )
    # SuperNodes' ids are random 64-bit integers, some above 2**63.
    ids = [5677760776906844991, 12345678901234567890, 42, 2**64 - 1, 7]
    assert set(neighbours(ids, 3, np.random.default_rng(0))) == set(ids)
    ring = neighbours(list(range(1, 10)), 5, np.random.default_rng(0))
    assert all(len(ring[n]) == 5 and n in ring[n] for n in ring)
    assert all(m in ring[n] for n in ring for m in ring[n] if n in ring[m])
    assert all((m in ring[n]) == (n in ring[m]) for n in ring for m in ring)
    q = Quantizer(8.0, 2**22, 2**32)
    values = np.linspace(-8, 8, 1001)
    codes = q.encode(values, np.random.default_rng(0))
    assert np.abs(q.decode_sum(codes, 1) - values).max() < q.step


@pytest.mark.parametrize("size", [1, 7, 32768, 32769, 100_003])
def test_masks_are_the_aes_ctr_keystream_added_block_by_block(size):
    # The keystream in one piece, straight from the cipher: AES-128 (key the
    # first half of the seed's SHA-256), counter from zero, little-endian
    # 32-bit words.
    seeds = [bytes([i]) * 32 for i in range(1, 5)]
    streams = [
        np.frombuffer(
            Cipher(
                algorithms.AES(hashlib.sha256(seed).digest()[:16]), modes.CTR(bytes(16))
            )
            .encryptor()
            .update(bytes(4 * size)),
            "<u4",
        )
        for seed in seeds
    ]
    assert np.array_equal(expand_mask(seeds[0], size), streams[0])
    start = np.arange(size, dtype=np.uint32)
    vector = start.copy()
    add_masks(vector, zip(seeds, [1, -1, 1, -1], strict=True))
    expected = start + streams[0] - streams[1] + streams[2] - streams[3]  # mod 2**32
    assert np.array_equal(vector, expected)


@pytest.mark.parametrize("clip", [8.0, 0.1])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32])
def test_codes_are_stochastic_rounding_of_the_scaled_values_block_by_block(clip, dtype):
    # The blocked coder against the formula in one piece, with the same draws:
    # floor(s) + [u < s - floor(s)], s = (clip(x) w / T + c) / step, in float64.
    q = Quantizer(clip, 2**22, 2**32)
    x = (np.random.default_rng(3).standard_normal(200_003) * 4 * clip).astype(dtype)
    for weight in (None, 1, 777, 2**22):
        w = 2**22 if weight is None else weight
        s = (np.clip(x.astype(np.float64), -clip, clip) * (w / 2**22) + clip) / q.step
        u = np.random.default_rng(9).random(x.size)
        low, high = q.code_range(w)
        expected = np.clip(np.floor(s) + (u < s - np.floor(s)), low, high)
        codes = q.encode(x, np.random.default_rng(9), weight)
        assert np.array_equal(codes, expected)
        # Two arrays one after the other into a vector: one stream of draws.
        out = np.empty(x.size, np.uint32)
        rng = np.random.default_rng(9)
        q.encode(x[:70_001], rng, weight, out=out[:70_001])
        q.encode(x[70_001:], rng, weight, out=out[70_001:])
        assert np.array_equal(out, expected)


def test_state_commits_only_for_clients_whose_vector_is_in_the_sum():
    recorder = Recorder(ScaffoldClient)
    recorder.tamper[(1002, Stage.COLLECT_MASKED_VECTORS)] = _short_vector
    wrapped = secure(strategy(Scaffold, {"num_clients": NODES}))
    recorder.run(wrapped, rounds=1)
    # Client keys are partition ids: node 1002 holds partition 1.
    assert wrapped.strategy.book.accepted == {0: 1, 2: 1, 3: 1, 4: 1}
    # The server's c is SCAFFOLD's over the four others (node 1002 dead instead).
    plain = Recorder(ScaffoldClient)
    plain.kill = (1002, None)
    inner = strategy(Scaffold, {"num_clients": NODES})
    plain.run(inner, rounds=1)
    assert inner.book.accepted == wrapped.strategy.book.accepted
    for key, value in inner.control.items():
        assert np.abs(wrapped.strategy.control[key] - value).max() <= 2 * CLIP / 2**22


def test_clipping_is_counted_and_warned(caplog):
    recorder = Recorder(ScaffoldClient)
    wrapped = SecAggPlus(strategy(Scaffold, {"num_clients": NODES}), clipping_range=8.0)
    metrics = round_metrics(wrapped)
    with caplog.at_level(logging.WARNING):
        recorder.run(wrapped, rounds=2)
    assert metrics[0]["secagg-clipped"] > 0
    warned = [r for r in caplog.records if "clipped" in r.getMessage()]
    assert len(warned) == 1 and "raise clipping_range" in warned[0].getMessage()

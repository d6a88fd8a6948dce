"""Distributed DP under SecAgg+ (``SecAggPlus(distributed_dp=DistributedDP(...))``):
every summing algorithm aggregates as in plain within the encoding's bound, the
clip covers every record together, the sum's noise is the mechanism's, the
account charges what was revealed and stops a run before its budget, and a
lying server or client gets what the guarantee says, and no more."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message

from flwr_prox_strategies import (
    DistributedDP,
    FedEPM,
    NoRoundAggregatedError,
    PrivacyBudgetSpentError,
    SecAggPlus,
)
from flwr_prox_strategies.core.transport.ddp import (
    DDPRound,
    noise_multiplier_at,
    sensitivity,
)
from flwr_prox_strategies.core.transport.inprocess import (
    InProcessGrid,
    default_node_config,
)
from flwr_prox_strategies.core.transport.secagg import SECAGG_RECORD, Key, Stage
from flwr_prox_strategies.ops.privacy.accounting import (
    DEFAULT_ORDERS,
    ddg_rdp,
    integer_l1_bound,
    rdp_to_epsilon,
)
from flwr_prox_strategies.ops.privacy.encoding import (
    DDPSettings,
    decode_sum,
    encode_upload,
    upload_layout,
)
from flwr_prox_strategies.ops.privacy.quantise import modular_unwrap

from .test_secure_aggregation import (
    ALGORITHMS,
    NODES,
    PROBLEM,
    Recorder,
    round_metrics,
    strategy,
)

EXACT = {"l2_clip": 1e3, "bits": 32, "noise_multiplier": 1e-9}


def ddp(**settings):
    return DistributedDP(**{"expected_clients": NODES, **EXACT, **settings})


def run(name, rounds=1, recorder=None, dp=None, **more):
    cls, client = ALGORITHMS[name][0], ALGORITHMS[name][1]
    inner = strategy(cls, ALGORITHMS[name][2], weighting="uniform", **more)
    wrapped = SecAggPlus(inner, distributed_dp=dp or ddp())
    metrics = round_metrics(wrapped)
    recorder = recorder or Recorder(client)
    return recorder.run(wrapped, rounds), metrics, wrapped


def plain(name, rounds=1):
    cls, client = ALGORITHMS[name][0], ALGORITHMS[name][1]
    inner = strategy(cls, ALGORITHMS[name][2], weighting="uniform")
    return Recorder(client).run(inner, rounds)


def upload_of(wrapped):
    spec = wrapped.strategy.expected_train_arrays(1)
    names = wrapped.strategy.secure_sums()
    return upload_layout(
        {n: {k: np.zeros(a.shape, a.dtype) for k, a in spec[n].items()} for n in names}
    )


# ------------------------------------------------------------- exactness
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_without_noise_every_summing_algorithm_aggregates_as_in_plain(name):
    """One round through clip, rotation, rounding and the modular sum."""
    expected = plain(name)
    got, metrics, wrapped = run(name)
    padded = upload_of(wrapped).padded_dim
    # Each client's rounding moves its integer vector by < 1 per coordinate
    # (sqrt(D) in L2, as much back through the rotation); a mean divides by n,
    # FedDyn's and FedDC's sums over K add as much again.
    bound = 2 * metrics[0]["ddp-granularity"] * math.sqrt(padded)
    assert metrics[0]["secagg-contributors"] == NODES
    assert np.abs(got - expected).max() <= bound, (got - expected, bound)
    assert np.abs(got - expected).max() > 0  # rounded, not passed in plain


def test_the_clip_covers_the_model_change_and_scaffolds_control_together():
    """SCAFFOLD's upload (model change and control change) is clipped as one."""
    rec = Recorder(ALGORITHMS["SCAFFOLD"][1])
    plain_global = rec.run(strategy(*_scaffold(), weighting="uniform"), 1)
    replies = [r for r in rec.replies if r.content.array_records]
    initial = PROBLEM.initial().to_numpy_ndarrays()[0]
    deltas = [
        r.content.array_records["arrays"].to_numpy_ndarrays()[0] - initial
        for r in replies
    ]
    controls = [
        r.content.array_records["control-delta"].to_numpy_ndarrays()[0] for r in replies
    ]
    norms = [
        math.sqrt(float(np.sum(d**2) + np.sum(c**2)))
        for d, c in zip(deltas, controls, strict=True)
    ]
    clip = min(norms) / 2  # every client clipped
    clipped = [d * min(1.0, clip / n) for d, n in zip(deltas, norms, strict=True)]
    expected = initial + np.mean(clipped, axis=0)
    got, _, _ = run("SCAFFOLD", dp=ddp(l2_clip=clip))
    assert np.abs(got - expected).max() <= 1e-5 * clip
    # Clipping the model change alone would give a different model.
    alone = initial + np.mean(
        [d * min(1.0, clip / np.linalg.norm(d)) for d in deltas], axis=0
    )
    assert np.abs(alone - expected).max() > 1e-3 * clip
    assert not np.allclose(got, plain_global)


def _scaffold():
    return ALGORITHMS["SCAFFOLD"][0], ALGORITHMS["SCAFFOLD"][2]


# ------------------------------------------------------------------ noise
def test_the_sums_noise_has_the_mechanisms_variance():
    """Noisy minus plain, over rounds and coordinates: (z C)^2 / n^2 per entry."""
    z, clip, rounds = 0.5, 40.0, 12
    expected = plain("FedAvg")
    errors = []
    for _ in range(rounds):
        got, _, _ = run("FedAvg", dp=ddp(noise_multiplier=z, l2_clip=clip))
        errors.append((got - expected).ravel())
    sample = np.concatenate(errors)
    target = (z * clip) ** 2 / NODES**2
    # The sample variance of m normal draws: relative sd sqrt(2/m).
    spread = 4 * math.sqrt(2 / sample.size)
    assert abs(float(np.mean(sample**2)) / target - 1) < spread, (
        np.mean(sample**2),
        target,
    )


def test_a_client_skipping_its_noise_leaves_the_honest_noise_the_account_charged():
    """The account charges the threshold's t contributors, not the n sampled.

    One of five clients adds no noise (it lies to the server, which cannot see
    it): the sum still carries four clients' noise, above the three the
    account charged; a client cannot make the sum less private than charged
    unless more than n - t of them skip.
    """
    dim, n, t = 4096, 5, 3
    settings = DDPSettings(
        l2_clip=1.0, bits=32, local_variance=400.0, granularity=1e-3, num_clients=n
    )
    layout = upload_layout({"m": {"w": np.zeros(dim, np.float32)}})
    rng = np.random.default_rng(0)
    zero = {"m": {"w": np.zeros(dim, np.float32)}}
    liar = DDPSettings(**{**settings.__dict__, "local_variance": 0.0})
    total = np.zeros(layout.padded_dim, np.int64)
    for client in range(n):
        mine = liar if client == 0 else settings
        upload = encode_upload(zero, mine, round_seed=7, rng=rng, layout=layout)
        total = (total + upload.values) % 2**32
    noise = modular_unwrap(total, 32).astype(float)
    measured = float(np.var(noise))
    assert measured == pytest.approx((n - 1) * 400.0, rel=0.1)
    assert measured > t * 400.0  # what the account assumed, even with the liar
    summed = decode_sum(total, layout, settings, round_seed=7)["m"]["w"]
    assert np.std(summed) == pytest.approx(1e-3 * math.sqrt((n - 1) * 400), rel=0.1)


# ------------------------------------------------------------- accounting
def test_the_metrics_charge_each_revealed_round_with_the_threshold():
    dp = ddp(noise_multiplier=1.0, l2_clip=10.0, bits=20)
    _, metrics, wrapped = run("FedAvg", rounds=3, dp=dp)
    state = wrapped.account
    assert state.rounds == 3
    m = metrics[-1]
    upload = upload_of(wrapped)
    settings = dp.encoding(upload.dim, NODES)
    padded = upload.padded_dim
    assert settings.granularity == m["ddp-granularity"]
    fewest = m["ddp-noise-contributors"]
    assert fewest == math.ceil(0.6 * NODES)  # the default threshold
    l2 = sensitivity(settings, padded)
    one = ddg_rdp(
        DEFAULT_ORDERS,
        l2_sensitivity=l2,
        l1_sensitivity=integer_l1_bound(l2, padded),
        sigma2=settings.local_variance,
        num_clients=fewest,
        dim=padded,
    )
    assert m["ddp-epsilon-total"] == pytest.approx(
        rdp_to_epsilon(DEFAULT_ORDERS, 3 * one, dp.delta), rel=1e-9
    )
    assert m["ddp-epsilon"] == pytest.approx(
        rdp_to_epsilon(DEFAULT_ORDERS, one, dp.delta), rel=1e-9
    )
    assert [x["ddp-epsilon-total"] for x in metrics] == sorted(
        x["ddp-epsilon-total"] for x in metrics
    )
    assert m["ddp-noise-multiplier"] == pytest.approx(
        noise_multiplier_at(settings, padded, fewest)
    )


def test_a_round_that_reveals_nothing_charges_nothing():
    rec = Recorder(ALGORITHMS["FedAvg"][1])

    def no_vector(reply):  # every client's masked vector is garbage
        reply.content.config_records[SECAGG_RECORD][Key.MASKED_PARAMETERS] = b"x"

    for node in range(1001, 1001 + NODES):
        rec.tamper[(node, Stage.COLLECT_MASKED_VECTORS)] = no_vector
    inner = strategy(ALGORITHMS["FedAvg"][0], {}, weighting="uniform")
    wrapped = SecAggPlus(inner, distributed_dp=ddp(noise_multiplier=1.0, l2_clip=10.0))
    metrics = round_metrics(wrapped)
    with pytest.raises(NoRoundAggregatedError):
        rec.run(wrapped, 1)
    assert wrapped.account.rounds == 0 and wrapped.account.epsilon() == 0.0
    assert metrics[0]["ddp-epsilon"] == 0.0 and metrics[0]["ddp-epsilon-total"] == 0.0
    assert metrics[0]["secagg-contributors"] == 0


def test_the_budget_stops_the_run_before_the_round_that_would_pass_it():
    dp = ddp(noise_multiplier=2.0, l2_clip=10.0, bits=20)
    _, metrics, _ = run("FedAvg", rounds=3, dp=dp)
    totals = [m["ddp-epsilon-total"] for m in metrics]
    target = (totals[1] + totals[2]) / 2
    budget = ddp(noise_multiplier=2.0, l2_clip=10.0, bits=20, target_epsilon=target)
    with pytest.raises(PrivacyBudgetSpentError, match="round 3 would take") as err:
        run("FedAvg", rounds=5, dp=budget)
    assert err.value.stopped_at == 3
    assert err.value.result.arrays is not None


def test_a_resumed_run_with_its_budget_spent_stops_before_its_first_round():
    dp = ddp(noise_multiplier=2.0, l2_clip=10.0, bits=20)
    _, metrics, _ = run("FedAvg", rounds=2, dp=dp)
    spent = metrics[-1]["ddp-epsilon-total"]
    cls, client = ALGORITHMS["FedAvg"][0], ALGORITHMS["FedAvg"][1]
    inner = strategy(cls, {}, weighting="uniform")
    inner.round_offset = 2  # as a checkpoint after two rounds restores it
    wrapped = SecAggPlus(
        inner,
        distributed_dp=ddp(
            noise_multiplier=2.0, l2_clip=10.0, bits=20, target_epsilon=spent * 1.01
        ),
    )
    rec = Recorder(client)
    with pytest.raises(PrivacyBudgetSpentError, match="round 3 would take"):
        rec.run(wrapped, 1)
    assert not rec.replies  # not even a key left


# ------------------------------------------------------- lying parties
class Node(Recorder):
    """The pack's FedAvg ClientApp with a noise floor; keeps each refusal.

    ``lie`` rewrites the collect message before the node reads it (a lying
    server).
    """

    def __init__(self, floor=None, lie=None):
        from flwr_prox_strategies import FedAvgClient, SecAggPlusMod, to_client_app

        super().__init__(FedAvgClient)
        self.app = to_client_app(
            PROBLEM.client_fn(FedAvgClient, learning_rate=0.05, local_epochs=2),
            secure_aggregation=False,
            mods=[SecAggPlusMod(min_noise_multiplier=floor)],
        )
        self.lie = lie
        self.refusals: list[str] = []
        self.masked = 0

    def __call__(self, message: Message, context: Context) -> Message:
        record = message.content.config_records.get(SECAGG_RECORD)
        collect = record is not None and record.get(Key.STAGE) == (
            Stage.COLLECT_MASKED_VECTORS
        )
        if collect and self.lie is not None:
            self.lie(record)
        try:
            reply = super().__call__(message, context)
        except Exception as err:
            self.refusals.append(str(err))
            raise
        out = reply.content.config_records.get(SECAGG_RECORD) if collect else None
        self.masked += int(out is not None and Key.MASKED_PARAMETERS in out)
        return reply


def test_a_server_asking_for_less_noise_than_the_nodes_floor_gets_nothing():
    strong = ddp(noise_multiplier=2.0, l2_clip=10.0, bits=20)
    weak = ddp(noise_multiplier=0.1, l2_clip=10.0, bits=20)
    _, metrics, _ = run("FedAvg", recorder=Node(floor=1.0), dp=strong)
    assert metrics[0]["secagg-contributors"] == NODES
    node = Node(floor=1.0)
    with pytest.raises(NoRoundAggregatedError):
        run("FedAvg", recorder=node, dp=weak)
    assert len(node.refusals) == NODES and node.masked == 0
    assert all("below this node's floor 1" in why for why in node.refusals)


@pytest.mark.parametrize(
    ("key", "factor"),
    [("ddp-l2-clip", 1e4), ("ddp-local-variance", 1e-4), ("ddp-granularity", 1e-3)],
)
def test_a_server_lying_about_the_noise_in_the_collect_message_is_refused(key, factor):
    """A larger clip, less noise or a finer step than honest: the node computes
    the ratio itself, from what it would do, and masks nothing."""

    def lie(record):
        record[key] = factor * float(record[key])

    node = Node(floor=1.0, lie=lie)
    with pytest.raises(NoRoundAggregatedError):
        run("FedAvg", recorder=node, dp=ddp(noise_multiplier=2.0, l2_clip=10.0))
    assert node.masked == 0
    assert len(node.refusals) == NODES
    assert all("below this node's floor" in why for why in node.refusals)


def test_a_node_requiring_distributed_dp_refuses_a_plain_secure_round_untrained():
    node = Node(floor=1.0)
    inner = strategy(ALGORITHMS["FedAvg"][0], {}, weighting="uniform")
    with pytest.raises(NoRoundAggregatedError):
        node.run(SecAggPlus(inner, clipping_range=64.0), 1)
    assert len(node.refusals) == NODES and node.masked == 0
    assert all("requires distributed DP" in why for why in node.refusals)


def test_the_operator_sets_the_floor_in_the_node_config():
    node = Node()
    default = default_node_config(NODES)
    node.grid = InProcessGrid(
        node,
        num_nodes=NODES,
        node_config=lambda i: {**default(i), "ddp-min-noise-multiplier": "1.0"},
    )
    inner = strategy(ALGORITHMS["FedAvg"][0], {}, weighting="uniform")
    wrapped = SecAggPlus(inner, distributed_dp=ddp(noise_multiplier=0.1, l2_clip=10.0))
    with pytest.raises(NoRoundAggregatedError):
        wrapped.start(grid=node.grid, initial_arrays=PROBLEM.initial(), num_rounds=1)
    assert node.masked == 0 and len(node.refusals) == NODES
    assert all("ddp-min-noise-multiplier" in why for why in node.refusals)


def test_any_rotation_seed_keeps_every_upload_within_the_sensitivity():
    """The server picks the seed; the conditional rounding bounds the norm anyway."""
    settings = DDPSettings(l2_clip=1.0, bits=32, granularity=1e-2)
    rng = np.random.default_rng(1)
    x = {"m": {"w": np.full(100, 0.1, np.float32)}}  # a norm-1 upload
    layout = upload_layout(x)
    bound = sensitivity(settings, layout.padded_dim)
    for seed in [0, 0, 1, 2**31 - 1, *range(2, 40)]:  # repeated ones too
        values = modular_unwrap(
            encode_upload(x, settings, round_seed=seed, rng=rng).values, 32
        )
        assert np.linalg.norm(values.astype(float)) <= bound


def test_the_round_config_is_read_back_and_malformed_ones_are_refused():
    settings = DDPSettings(l2_clip=2.0, bits=20, granularity=0.5, local_variance=3.0)
    plan = DDPRound(settings, 5, ("arrays", "control-delta"), ("arrays",))
    config = plan.config()
    assert DDPRound.from_config(config) == plan
    assert DDPRound.from_config({}) is None
    for key, bad in (
        ("ddp-bits", 20.0),
        ("ddp-noise", "laplace"),
        ("ddp-local-variance", -1.0),
        ("ddp-relative", ["other"]),
        ("ddp-seed", -1),
    ):
        with pytest.raises(ValueError):
            DDPRound.from_config({**config, key: bad})


# --------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"noise_multiplier": 0.0}, "noise_multiplier"),
        ({"l2_clip": -1.0}, "l2_clip"),
        ({"bits": 40}, "bits must be <= 32"),
        ({"bits": 3, "expected_clients": 100}, "smallest width that works is bits="),
        ({"mechanism": "laplace"}, "mechanism"),
        ({"delta": 1.0}, "delta"),
        ({"target_epsilon": 0.0}, "target_epsilon"),
        ({"denominator": "weights"}, "denominator"),
        ({"expected_clients": 0}, "expected_clients"),
    ],
)
def test_bad_settings_are_refused_naming_the_parameter(settings, match):
    with pytest.raises(ValueError, match=match):
        DistributedDP(
            **{
                "noise_multiplier": 1.0,
                "l2_clip": 1.0,
                "expected_clients": 5,
                **settings,
            }
        )


def test_weighted_means_and_unsummable_rules_are_refused_with_the_reason():
    inner = strategy(ALGORITHMS["FedAvg"][0], {})  # num-examples weighting
    with pytest.raises(ValueError, match="weighting='uniform'"):
        SecAggPlus(inner, distributed_dp=ddp())
    with pytest.raises(ValueError, match="cannot run FedEPM"):
        SecAggPlus(FedEPM(num_clients=3), distributed_dp=ddp())
    with pytest.raises(ValueError, match="must be a DistributedDP"):
        SecAggPlus(
            strategy(ALGORITHMS["FedAvg"][0], {}, weighting="uniform"),
            distributed_dp={"noise_multiplier": 1.0},
        )


def test_the_encoding_picks_the_finest_granularity_that_cannot_wrap():
    dp = DistributedDP(noise_multiplier=1.0, l2_clip=1.0, expected_clients=10, bits=16)
    settings = dp.encoding(1000, 10)
    finer = DDPSettings(
        **{
            **settings.__dict__,
            "granularity": settings.granularity / 1.01,
            "local_variance": settings.local_variance * 1.01**2,
        }
    )
    from flwr_prox_strategies.ops.privacy.encoding import check_bits

    check_bits(settings, 1000)
    with pytest.raises(ValueError, match="too small"):
        check_bits(finer, 1000)
    more_bits = DistributedDP(
        noise_multiplier=1.0, l2_clip=1.0, expected_clients=10, bits=20
    ).encoding(1000, 10)
    assert more_bits.granularity < settings.granularity / 8
    with pytest.raises(ValueError, match="at any granularity"):
        DistributedDP(
            noise_multiplier=1.0, l2_clip=1.0, expected_clients=1, bits=4
        ).encoding(1000, 10)
    assert ConfigRecord(DDPRound(settings, 1, ("a",), ()).config())


# ------------------------------------------------------------- the app
def test_privacy_distributed_runs_through_the_app_and_records_epsilon(tmp_path):
    """``privacy=distributed``: SecAgg+ with distributed DP, uniform means, the
    run's epsilon in results.json every round; with a clip of 1e-9 and no
    noise the model cannot move (the clip applies), and it moves without it."""
    import json

    from flwr_prox_strategies.experiment.sweeps.sweep import run_inprocess

    def run_with(clip: float) -> list[str]:
        return [
            *("strategy=scaffold", "num_clients=3", "num_rounds=2", "model=logreg"),
            "privacy=distributed",
            "privacy.distributed.noise_multiplier=1e-9",
            f"privacy.distributed.l2_clip={clip}",
            "privacy.distributed.bits=32",
        ]

    pinned = run_with(1e-9)
    results = json.loads(run_inprocess(pinned, tmp_path / "pinned", 3).read_text())
    assert "distributed_dp=DistributedDP(" in results["secure-aggregation"]
    train = [r["train"] for r in results["rounds"] if r["round"] > 0]
    assert [t["secagg-contributors"] for t in train] == [3, 3]
    totals = [t["ddp-epsilon-total"] for t in train]
    assert 0 < totals[0] < totals[1]
    # The summary, log line and privacy plot read the run's user-level figure.
    assert results["summary"]["final-epsilon-max"] == totals[-1]
    assert results["summary"]["delta"] == 1e-5
    assert (tmp_path / "pinned" / "privacy.png").is_file()
    loss = [r["central"]["loss"] for r in results["rounds"]]
    assert loss[-1] == pytest.approx(loss[0], abs=1e-6)
    moved = json.loads(run_inprocess(run_with(1e3), tmp_path / "free", 3).read_text())
    assert moved["rounds"][-1]["central"]["loss"] < loss[0] - 0.05


def test_privacy_distributed_without_secure_aggregation_is_refused():
    from flwr_prox_strategies.experiment.build import wrap_secure_aggregation
    from flwr_prox_strategies.experiment.config import compose_config

    cfg = compose_config("privacy=distributed secure_aggregation=none")
    inner = strategy(ALGORITHMS["FedAvg"][0], {}, weighting="uniform")
    with pytest.raises(ValueError, match="needs secure_aggregation=secaggplus"):
        wrap_secure_aggregation(cfg, inner, lambda: 100)


def test_colluding_clients_are_charged_out_of_the_threshold():
    dp = ddp(noise_multiplier=1.0, l2_clip=10.0, bits=20)
    _, honest, _ = run("FedAvg", dp=dp)
    _, colluding, _ = run("FedAvg", dp=ddp(**{**dp.__dict__, "colluding": 1}))
    t = honest[0]["ddp-noise-contributors"]
    assert colluding[0]["ddp-noise-contributors"] == t - 1
    assert colluding[0]["ddp-epsilon"] > honest[0]["ddp-epsilon"]
    with pytest.raises(NoRoundAggregatedError):  # t - k < 1: nothing starts
        run("FedAvg", dp=ddp(**{**dp.__dict__, "colluding": t}))


def test_a_resumed_runs_earlier_rounds_are_charged_once():
    """Offset 2; the first resumed round reveals nothing, the next does: 2 + 1."""
    rec = Recorder(ALGORITHMS["FedAvg"][1])
    corrupted: set[int] = set()

    def first_vector_garbage(node):
        def tamper(reply):
            if node not in corrupted:
                corrupted.add(node)
                record = reply.content.config_records[SECAGG_RECORD]
                record[Key.MASKED_PARAMETERS] = b"x"

        return tamper

    for node in range(1001, 1001 + NODES):
        rec.tamper[(node, Stage.COLLECT_MASKED_VECTORS)] = first_vector_garbage(node)
    inner = strategy(ALGORITHMS["FedAvg"][0], {}, weighting="uniform")
    inner.round_offset = 2
    wrapped = SecAggPlus(inner, distributed_dp=ddp(noise_multiplier=2.0, l2_clip=10.0))
    metrics = round_metrics(wrapped)
    rec.run(wrapped, 2)
    assert [m["secagg-contributors"] for m in metrics] == [0, NODES]
    assert wrapped.account.rounds == 3  # two earlier rounds, one revealed now

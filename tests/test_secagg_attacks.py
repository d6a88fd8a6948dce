"""Secure aggregation when a party lies: each attack is run as the liar would.

A lying server runs the real wrapper's first stages, then sends the unmask
requests of its choice and tries to rebuild one client's update from what comes
back; a lying client tampers with its own masked vector. Every test here states
what the attack got against the honest-but-curious protocol and what it gets
now.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from flwr_prox_strategies import (
    FedAvg,
    FedAvgClient,
    NoRoundAggregatedError,
    Scaffold,
    ScaffoldClient,
    SecAggPlus,
    to_client_app,
)
from flwr_prox_strategies.core.client.secagg import (
    SecAggPlusMod,
    SecureAggregationRefused,
)
from flwr_prox_strategies.core.transport import shamir, signing
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
from flwr_prox_strategies.core.transport.secagg import (
    CONSISTENCY_STAGE,
    SECAGG_RECORD,
    SIGNATURE_KEY,
    SIGNERS_KEY,
    SURVIVORS_KEY,
    Key,
    Stage,
    expand_mask,
    from_bytes,
    pairwise_seed,
    pairwise_sign,
    reduce,
)
from flwr_prox_strategies.experiment.appdir import make_client_app
from flwr_prox_strategies.experiment.build import client_recipe
from flwr_prox_strategies.testing.federation import LeastSquares

from .helpers import logged
from .system.engine import make_signing_keys

CLIENT = {"learning_rate": 0.05, "local_epochs": 2}
CLIP = 64.0


class Federation:
    """``nodes`` clients of a least-squares problem and a wrapped strategy."""

    def __init__(
        self,
        nodes: int = 5,
        *,
        strategy_cls=FedAvg,
        client_cls=FedAvgClient,
        mod: dict | None = None,
        node_config=None,
        **secagg,
    ):
        self.problem = LeastSquares(num_clients=nodes, dim=5)
        self.nodes = nodes
        options = {"num_clients": nodes} if strategy_cls is Scaffold else {}
        self.inner = strategy_cls(
            min_train_nodes=nodes,
            min_available_nodes=nodes,
            fraction_evaluate=0.0,
            **options,
        )
        self.wrapped = SecAggPlus(self.inner, **{"clipping_range": CLIP, **secagg})
        app = to_client_app(
            self.problem.client_fn(client_cls, **CLIENT),
            secure_aggregation=False,
            mods=[SecAggPlusMod(**(mod or {}))],
        )
        self.tamper: dict[int, callable] = {}  # on the masked vector
        self.tamper_keys: dict[int, callable] = {}  # on the setup's public keys

        def run(message, context):
            reply = app(message, context)
            node = message.metadata.dst_node_id
            record = None if reply.has_error() else reply.content.config_records
            record = None if record is None else record.get(SECAGG_RECORD)
            if record is not None and Key.MASKED_PARAMETERS in record:
                self.tamper.get(node, lambda _: None)(record)
            if record is not None and Key.PUBLIC_KEY_1 in record:
                self.tamper_keys.get(node, lambda _: None)(record)
            return reply

        self.grid = InProcessGrid(run, num_nodes=nodes, node_config=node_config)
        self.vectors: dict[int, np.ndarray] = {}

    def collect(self) -> list[Message]:
        """Run setup, share_keys and collect through the real wrapper."""
        messages = list(
            self.wrapped.configure_train(
                1, self.problem.initial(), ConfigRecord(), self.grid
            )
        )
        replies = list(self.grid.send_and_receive(messages))
        state = self.wrapped._round
        for reply in replies:
            if not reply.has_error():
                record = reply.content.config_records[SECAGG_RECORD]
                self.vectors[reply.metadata.src_node_id] = from_bytes(
                    record[Key.MASKED_PARAMETERS],
                    state.layout.length,
                    self.wrapped.modulus_range,
                )
        return replies

    def setup(self):
        """Run the real wrapper's setup only: the round and the keys it forwards."""
        from flwr_prox_strategies.core.privacy.secagg import _Round

        self.wrapped._grid = self.grid
        state = _Round(1, {n: None for n in range(1001, 1001 + self.nodes)})
        self.wrapped._size_round(state, self.nodes)
        self.wrapped._setup(self.grid, state, sorted(state.messages))
        return state, {str(n): list(state.public_keys[n]) for n in state.public_keys}

    def ask(self, node: int, active: list, dead: list, **extra) -> Message:
        """Send ``node`` an unmask request of the liar's choice; return the reply."""
        config = {
            Key.STAGE: Stage.UNMASK,
            "server-round": 1,
            Key.ACTIVE_NODE_ID_LIST: active,
            Key.DEAD_NODE_ID_LIST: dead,
            **extra,
        }
        message = Message(
            RecordDict({SECAGG_RECORD: ConfigRecord(config)}),
            dst_node_id=node,
            message_type="train",
            group_id="1",
        )
        return next(iter(self.grid.send_and_receive([message])))

    def rebuild(self, target: int, answers: dict[int, Message]) -> np.ndarray | None:
        """Return ``target``'s plain values if ``answers`` hold what unmasks it."""
        state = self.wrapped._round
        t = state.threshold
        seeds: dict[int, dict[int, bytes]] = {}
        keys: dict[int, dict[int, bytes]] = {}
        for holder, reply in answers.items():
            if reply.has_error():
                continue
            record = reply.content.config_records[SECAGG_RECORD]
            for owner, share in zip(
                record[Key.NODE_ID_LIST], record[Key.SHARE_LIST], strict=True
            ):
                position = sorted(state.neighbours[owner]).index(holder) + 1
                into = seeds if owner in self.answered_active[holder] else keys
                into.setdefault(owner, {})[position] = share
        neighbours = sorted(state.neighbours[target] - {target})
        if len(seeds.get(target, {})) < t or any(
            len(keys.get(j, {})) < t for j in neighbours
        ):
            return None
        vector = self.vectors[target].copy()
        seed = shamir.combine(seeds[target], t)
        vector -= expand_mask(seed, vector.size)
        for j in neighbours:
            sk1 = shamir.combine(keys[j], t)
            mask = expand_mask(
                pairwise_seed(sk1, state.public_keys[target][0]), vector.size
            )
            if pairwise_sign(target, j) > 0:
                vector -= mask
            else:
                vector += mask
        codes = reduce(vector, self.wrapped.modulus_range).astype(np.int64)
        q = self.wrapped.quantizer
        ratio = codes[0] / q.quantization_range
        return np.concatenate(state.layout.split(q.decode_sum(codes, 1))) / ratio

    def attack(self, requests: dict[int, tuple[list, list]]) -> dict[int, Message]:
        """Send each holder its request; remember whom it was told is active."""
        self.answered_active = {node: set(a) for node, (a, _) in requests.items()}
        return {node: self.ask(node, a, d) for node, (a, d) in requests.items()}

    def plain_update(self, node: int) -> np.ndarray:
        """Return what ``node`` replies in a plain round from the same model."""
        app = to_client_app(self.problem.client_fn(FedAvgClient, **CLIENT))
        grid = InProcessGrid(app, num_nodes=self.nodes)
        plain = FedAvg(min_train_nodes=self.nodes, min_available_nodes=self.nodes)
        messages = list(
            plain.configure_train(1, self.problem.initial(), ConfigRecord(), grid)
        )
        for reply in grid.send_and_receive(messages):
            if reply.metadata.src_node_id == node:
                return reply.content.array_records["arrays"].to_numpy_ndarrays()[0]
        raise AssertionError(node)


def _errors(answers: dict[int, Message]) -> dict[int, str]:
    return {
        node: str(reply.error.reason)
        for node, reply in answers.items()
        if reply.has_error()
    }


# ----------------------------------------------------------- repeated ids
def test_a_server_repeating_a_node_id_cannot_isolate_it():
    """Before: every holder answered active=[X, X, X] (3 >= t with repeats) with
    X's seed share and every other node's key share: X's update rebuilt to one
    quantisation step. Now each holder refuses, naming the repeated id."""
    fed = Federation(5)
    fed.collect()
    x = 1003
    others = [n for n in range(1001, 1006) if n != x]
    requests = {holder: ([x, x, x], others) for holder in range(1001, 1006)}
    answers = fed.attack(requests)
    errors = _errors(answers)
    assert set(errors) == set(requests)
    assert all("repeated" in why for why in errors.values()), errors
    assert fed.rebuild(x, answers) is None


@pytest.mark.parametrize(
    ("active", "dead", "named"),
    [
        ([1001, 1002, 1002], [1003, 1004, 1005], "repeated"),
        ([1001, 1002, 1003], [1004, 1004, 1005], "repeated"),
        ([1001, 1002, 1003, 9999], [1004, 1005], "no shares of nodes [9999]"),
        ([1001, 1002, 1003], [1003, 1004, 1005], "both shares"),
        ([1002, 1003, 1004], [1001, 1005], "not among the active"),
        ([1001, 1002, 1003], [1004], "neither active nor dead"),
        ([1001, 1002], [1003, 1004, 1005], "fewer than the threshold 3"),
        ([1001, True, 1003], [1004, 1005], "not a list of node ids"),
    ],
)
def test_the_mod_refuses_every_unmask_request_that_could_isolate_a_node(
    active, dead, named
):
    fed = Federation(5)
    fed.collect()
    reply = fed.ask(1001, active, dead)
    assert reply.has_error() and named in str(reply.error.reason), reply.error
    # A refusal ends the node's part in the round: an honest request now is
    # out of order too.
    again = fed.ask(1001, [1001, 1002, 1003, 1004, 1005], [])
    assert again.has_error() and "out of order" in str(again.error.reason)


def test_a_second_request_of_a_stage_is_refused():
    fed = Federation(5)
    fed.collect()
    everyone = [1001, 1002, 1003, 1004, 1005]
    first = fed.ask(1002, everyone, [])
    assert not first.has_error()
    second = fed.ask(1002, [1001, 1002, 1003], [1004, 1005])
    assert second.has_error() and "out of order" in str(second.error.reason)


def _stage_message(node: int, config: dict) -> Message:
    return Message(
        RecordDict({SECAGG_RECORD: ConfigRecord({"server-round": 1, **config})}),
        dst_node_id=node,
        message_type="train",
        group_id="1",
    )


def test_repeated_ids_in_share_keys_and_collect_are_refused():
    fed = Federation(5)
    grid = fed.grid
    # Run setup only, then forward the keys with node 1002 under two spellings.
    _, keys = fed.setup()
    aliased = {**keys, "01002": keys["1002"]}
    reply = next(
        iter(
            grid.send_and_receive(
                [_stage_message(1001, {Key.STAGE: Stage.SHARE_KEYS, **aliased})]
            )
        )
    )
    assert reply.has_error() and "repeated node id '01002'" in str(reply.error.reason)
    # Collect: the same source forwarded twice would count one neighbour twice.
    fed = Federation(5)
    state, _ = fed.setup()
    fed.wrapped._share_keys(fed.grid, state)
    srcs, texts = fed.wrapped._forwarded[1001]
    collect = {
        Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
        Key.SOURCE_LIST: [srcs[0], *srcs],
        Key.CIPHERTEXT_LIST: [texts[0], *texts],
        "weight-key": "num-examples",
        **state.layout.config(),
    }
    reply = next(iter(fed.grid.send_and_receive([_stage_message(1001, collect)])))
    assert reply.has_error() and "repeated" in str(reply.error.reason)


# ------------------------------------------------------ unusable keys
#: X25519 public keys whose agreement with any private key is all zeros (the
#: identity and a point of order 8, RFC 7748's curve), and one too short.
SMALL_ORDER = [
    bytes(32),
    bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),
]


@pytest.mark.parametrize("position", [0, 1], ids=["mask key", "share key"])
@pytest.mark.parametrize(
    "bad", [*SMALL_ORDER, b"\x09" * 31], ids=["zero", "order 8", "short"]
)
def test_a_server_forwarding_an_unusable_key_gets_no_share(position, bad):
    """A server replacing a neighbour's key with one of small order would know
    the secret agreed with it (all zeros through HKDF): the mask that hides
    the node from that neighbour, or the key its shares travel under. The
    node refuses, naming the neighbour, before it encrypts anything."""
    fed = Federation(5)
    _, keys = fed.setup()
    keys["1004"][position] = bad
    message = _stage_message(1001, {Key.STAGE: Stage.SHARE_KEYS, **keys})
    reply = next(iter(fed.grid.send_and_receive([message])))
    assert reply.has_error()
    why = str(reply.error.reason)
    assert "node 1004's key is not a usable X25519 public key" in why, why
    assert ("small order" in why) == (bad in SMALL_ORDER), why


@pytest.mark.parametrize(
    "bad", [*SMALL_ORDER, b"\x09" * 31], ids=["zero", "order 8", "short"]
)
def test_a_client_sending_an_unusable_key_is_left_out_at_setup(caplog, bad):
    """A client announcing a key of small order would let anyone compute the
    masks its neighbours add for it; the server drops it at setup, says why,
    and the other four aggregate their plain mean."""
    fed = Federation(5)

    def lie(record):
        record[Key.PUBLIC_KEY_1] = bad

    fed.tamper_keys[1003] = lie
    with caplog.at_level(logging.INFO, logger="flwr"):
        result = fed.wrapped.start(
            grid=fed.grid, initial_arrays=fed.problem.initial(), num_rounds=1
        )
    assert logged(caplog, "setup: malformed public keys (")
    assert logged(caplog, "small order" if bad in SMALL_ORDER else "32-byte")
    honest = [n for n in range(1001, 1006) if n != 1003]
    # Every client holds 20 rows: the plain mean is unweighted.
    expected = np.mean([fed.plain_update(n) for n in honest], axis=0)
    got = result.arrays.to_numpy_ndarrays()[0]
    metrics = result.train_metrics_clientapp[1]
    assert (metrics["secagg-contributors"], metrics["secagg-dropped"]) == (4, 1)
    assert 0 < np.abs(got - expected).max() <= metrics["secagg-error-bound"] < 1e-2


# ------------------------------------------------------- weak thresholds
def _split_requests(nodes: list[int], x: int) -> dict[int, tuple[list, list]]:
    """Each holder H (but X) told ``active = [H, X]``, the others dead: X's seed
    from every holder, every other node's key from all but itself."""
    return {
        h: (sorted({h, x}), [n for n in nodes if n not in (h, x)])
        for h in nodes
        if h != x
    }


def test_the_default_threshold_is_above_half_at_every_size():
    for nodes in range(2, 40):
        fed = SecAggPlus(FedAvg(min_train_nodes=2))
        from flwr_prox_strategies.core.privacy.secagg import _Round

        state = _Round(1, {})
        fed._size_round(state, nodes)
        assert 2 * state.threshold > state.num_shares, (nodes, state.threshold)
        assert state.failure is None, state.failure
    # Four nodes: 0.6 x 4 = 2.4, rounded up to 3 (it was rounded to 2).
    state = _Round(1, {})
    SecAggPlus(FedAvg(min_train_nodes=2))._size_round(state, 4)
    assert state.threshold == 3


def test_split_requests_cannot_isolate_a_client_at_the_default_threshold():
    """Before: 4 nodes at the default fraction had t = 2; three holders each
    told "you and X are active" gave X's seed and every other key: X's update
    rebuilt. Now t = 3 and each such request has too few active nodes."""
    fed = Federation(4)
    fed.collect()
    nodes = [1001, 1002, 1003, 1004]
    answers = fed.attack(_split_requests(nodes, 1002))
    assert fed.rebuild(1002, answers) is None
    assert all("fewer than the threshold 3" in w for w in _errors(answers).values())
    assert len(_errors(answers)) == 3


def test_a_weak_threshold_is_refused_by_the_server_and_by_the_clients(caplog):
    for build in (
        lambda: SecAggPlus(FedAvg(), reconstruction_threshold=0.5),
        lambda: SecAggPlus(
            FedAvg(min_train_nodes=4), num_shares=4, reconstruction_threshold=2
        ),
    ):
        with pytest.raises(ValueError, match="allow_weak_threshold"):
            build()
    # A count that is weak only for this round's neighbourhood fails the round.
    fed = Federation(4, reconstruction_threshold=2)
    with caplog.at_level(logging.WARNING), pytest.raises(NoRoundAggregatedError):
        fed.wrapped.start(
            grid=fed.grid, initial_arrays=fed.problem.initial(), num_rounds=1
        )
    assert logged(caplog, "at most half")
    # The server's opt-out is not the clients': they refuse at share_keys.
    fed = Federation(4, reconstruction_threshold=2, allow_weak_threshold=True)
    replies = fed.collect()
    assert replies == []
    dropped = fed.wrapped._round.dropped
    assert len(dropped) == 4
    assert all("at most half" in why for why in dropped.values()), dropped


def test_with_both_sides_opting_out_the_split_attack_works():
    """Why the weak threshold is refused: with both opt-outs, it rebuilds X."""
    fed = Federation(
        4,
        reconstruction_threshold=2,
        allow_weak_threshold=True,
        mod={"allow_weak_threshold": True},
    )
    fed.collect()
    nodes = [1001, 1002, 1003, 1004]
    answers = fed.attack(_split_requests(nodes, 1002))
    assert not _errors(answers)
    rebuilt = fed.rebuild(1002, answers)
    assert rebuilt is not None
    plain = fed.plain_update(1002).ravel()
    # One quantum of r x, divided by r = 20 / 1000 (20 rows of max_weight 1000).
    step = fed.wrapped.quantizer.step
    assert np.abs(rebuilt - plain).max() < 2 * step * 1000 / 20


# --------------------------------------------------------------- required
def test_a_required_mod_refuses_a_server_that_leaves_out_the_wrapper():
    problem = LeastSquares(num_clients=3, dim=5)
    outcomes: list[Message | Exception] = []
    app = to_client_app(
        problem.client_fn(FedAvgClient, **CLIENT),
        secure_aggregation=False,
        mods=[SecAggPlusMod(required=True)],
    )

    def run(message, context):
        try:
            reply = app(message, context)
        except Exception as err:  # the grid turns it into an error reply
            outcomes.append(err)
            raise
        outcomes.append(reply)
        return reply

    grid = InProcessGrid(run, num_nodes=3)
    plain = FedAvg(min_train_nodes=3, min_available_nodes=3, fraction_evaluate=0)
    with pytest.raises(NoRoundAggregatedError):
        plain.start(grid=grid, initial_arrays=problem.initial(), num_rounds=1)
    assert len(outcomes) == 3
    assert all(
        isinstance(o, SecureAggregationRefused) and "SecAggPlus" in str(o)
        for o in outcomes
    ), outcomes


def test_the_operator_requires_it_through_the_node_config():
    problem = LeastSquares(num_clients=3, dim=5)
    app = to_client_app(problem.client_fn(FedAvgClient, **CLIENT))
    config = {"partition-id": 0, "num-partitions": 3, "secagg-required": True}
    grid = InProcessGrid(
        app, num_nodes=3, node_config=lambda i: {**config, "partition-id": i}
    )
    plain = FedAvg(min_train_nodes=3, min_available_nodes=3, fraction_evaluate=0)
    with pytest.raises(NoRoundAggregatedError):
        plain.start(grid=grid, initial_arrays=problem.initial(), num_rounds=1)
    # Under the wrapper the same nodes train.
    fed = SecAggPlus(
        FedAvg(min_train_nodes=3, min_available_nodes=3, fraction_evaluate=0),
        clipping_range=CLIP,
    )
    result = fed.start(grid=grid, initial_arrays=problem.initial(), num_rounds=1)
    assert result.arrays is not None


# ---------------------------------------------------------- lying clients
def _shift(position: int | slice, amount: int):
    def tamper(record):
        vector = np.frombuffer(record[Key.MASKED_PARAMETERS], "<u4").astype(np.uint32)
        vector[position] += np.uint32(amount % 2**32)
        record[Key.MASKED_PARAMETERS] = vector.astype("<u4").tobytes()

    return tamper


def test_a_client_lying_about_its_weight_is_caught(caplog):
    """Before: a client setting its masked weight so that the sum collapses to
    n moved the model by about 1e5, unseen. Now the sum must equal the codes of
    the plain num-examples: the round keeps the previous model and says why."""
    fed = Federation(5)
    q = fed.wrapped.quantizer
    codes = [q.weight_code(20.0, fed.wrapped.max_weight)] * 5  # 20 rows each
    fed.tamper[1003] = _shift(0, -(sum(codes) - 5))
    with caplog.at_level(logging.WARNING), pytest.raises(NoRoundAggregatedError):
        fed.wrapped.start(
            grid=fed.grid, initial_arrays=fed.problem.initial(), num_rounds=1
        )
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "masked another weight than it reported" in text
    assert "keeping the previous model" in text


def test_a_client_lying_in_a_weighted_record_is_caught(caplog):
    """Before: adding 2T to a client's value codes moved the weighted mean by
    far more than clipping_range allows, and was accepted."""
    fed = Federation(5)
    t = fed.wrapped.quantization_range
    fed.tamper[1002] = _shift(slice(2, None), 2 * t)
    with caplog.at_level(logging.WARNING), pytest.raises(NoRoundAggregatedError):
        fed.wrapped.start(
            grid=fed.grid, initial_arrays=fed.problem.initial(), num_rounds=1
        )
    assert logged(caplog, "beyond clipping_range")


def _shift_record(fed: Federation, name: str, amount: int):
    """Tamper: add ``amount`` to every code of the record ``name``."""

    def tamper(record):
        layout = fed.wrapped._round.layout
        index = layout.records.index(name)
        start = 2 + sum(layout.sizes[:index])
        size = layout.sizes[index]
        _shift(slice(start, start + size), amount)(record)

    return tamper


def test_a_lie_within_the_honest_range_moves_a_sum_at_most_to_its_edge():
    """What no check can catch without range proofs: a lie that keeps every sum
    where honest clipped clients could put it. The documented bound holds: a
    plain sum stays within [-n c, n c], so SCAFFOLD's control within [-c, c]."""
    fed = Federation(5, strategy_cls=Scaffold, client_cls=ScaffoldClient)
    t = fed.wrapped.quantization_range
    fed.tamper[1004] = _shift_record(fed, "control-delta", t // 3)  # inside [0, n T]
    result = fed.wrapped.start(
        grid=fed.grid, initial_arrays=fed.problem.initial(), num_rounds=1
    )
    assert fed.inner.run_tally.aggregated == 1
    honest = Federation(5, strategy_cls=Scaffold, client_cls=ScaffoldClient)
    honest.wrapped.start(
        grid=honest.grid, initial_arrays=honest.problem.initial(), num_rounds=1
    )
    lied = np.concatenate([v.ravel() for v in fed.inner.control.values()])
    truth = np.concatenate([v.ravel() for v in honest.inner.control.values()])
    # Moved by the lie (t/3 codes = 2c/3 per entry of the sum, over N = 5) ...
    assert np.abs(lied - truth).max() == pytest.approx(2 * CLIP / 3 / 5, rel=1e-3)
    # ... and never beyond the honest range.
    assert np.abs(lied).max() <= CLIP * (1 + 1e-6)
    assert result.arrays is not None


# ------------------------------------------------------ corrupt shares
def _corrupt(reply):
    record = reply.content.config_records[SECAGG_RECORD]
    record[Key.SHARE_LIST] = [
        bytes(b ^ 0x5A for b in s) for s in record[Key.SHARE_LIST]
    ]


@pytest.mark.parametrize(("nodes", "threshold"), [(6, 4), (5, 3), (7, 5)])
def test_one_corrupt_share_at_any_position_is_survived_and_named(
    nodes, threshold, caplog
):
    """Before: only contiguous windows of the sorted holders were tried, so a
    corrupt holder in the middle (the 3rd or 4th of 6 at t = 4) failed the
    round, unnamed. Now any t good shares rebuild a secret, and the holder of
    a disagreeing share is named."""
    for position in range(nodes):
        fed = Federation(nodes, reconstruction_threshold=threshold)
        corrupt = 1001 + position
        original = fed.grid.client_app

        def run(message, context, original=original, corrupt=corrupt):
            reply = original(message, context)
            record = message.content.config_records.get(SECAGG_RECORD)
            if (
                message.metadata.dst_node_id == corrupt
                and record is not None
                and record.get(Key.STAGE) == Stage.UNMASK
                and not reply.has_error()
            ):
                _corrupt(reply)
            return reply

        fed.grid.client_app = run
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            fed.wrapped.start(
                grid=fed.grid, initial_arrays=fed.problem.initial(), num_rounds=1
            )
        assert fed.inner.run_tally.aggregated == 1, (position, caplog.text)
        named = [
            r.getMessage()
            for r in caplog.records
            if f"node {corrupt}" in r.getMessage() and "corrupt" in r.getMessage()
        ]
        assert named, (position, caplog.text)


# ------------------------------------------------- active-adversary mode
def _signed_federation(
    tmp_path: Path, nodes: int = 5, keys=None, **secagg
) -> Federation:
    paths, directory = keys or make_signing_keys(tmp_path, nodes)

    def node_config(i):
        return {
            "partition-id": i,
            "num-partitions": nodes,
            "secagg-signing-key": str(paths[i]),
            "secagg-key-directory": str(directory),
        }

    return Federation(nodes, node_config=node_config, active_adversary=True, **secagg)


def test_active_adversary_mode_aggregates_like_the_honest_protocol(tmp_path):
    fed = _signed_federation(tmp_path)
    result = fed.wrapped.start(
        grid=fed.grid, initial_arrays=fed.problem.initial(), num_rounds=2
    )
    plain = fed.problem.run(
        FedAvg(min_train_nodes=5, min_available_nodes=5, fraction_evaluate=0),
        FedAvgClient,
        2,
        **CLIENT,
    )
    secure = result.arrays.to_numpy_ndarrays()[0]
    bound = sum(
        m["secagg-error-bound"] for m in result.train_metrics_clientapp.values()
    )
    assert 0 < np.abs(secure - plain).max() <= bound
    assert fed.inner.run_tally.aggregated == 2


def test_a_server_telling_clients_different_survivor_sets_gets_no_share(tmp_path):
    """The consistency check: node 1001 is told that 1003 dropped (so that it
    reveals 1003's key), the others that 1003 contributed (so that they reveal
    its seed). 1001 signed a set nobody else signed: it refuses."""
    fed = _signed_federation(tmp_path)
    fed.collect()
    everyone = sorted(fed.vectors)
    lie = [n for n in everyone if n != 1003]
    signed = _survivor_signatures(
        fed, {n: lie if n == 1001 else everyone for n in everyone}
    )
    reply = fed.ask(1001, lie, [1003], **signed)
    assert reply.has_error()
    assert "different stories" in str(reply.error.reason)
    # The honest story still works for the others.
    honest = fed.ask(1002, everyone, [], **signed)
    assert not honest.has_error(), honest.error


def _survivor_signatures(fed: Federation, told: dict[int, list[int]]) -> dict:
    """Run the consistency stage telling each node its own story; return the
    signatures as an unmask request carries them."""
    signatures = {}
    for node, survivors in told.items():
        message = _stage_message(
            node, {Key.STAGE: CONSISTENCY_STAGE, SURVIVORS_KEY: survivors}
        )
        reply = next(iter(fed.grid.send_and_receive([message])))
        assert not reply.has_error(), reply.error
        signatures[node] = reply.content.config_records[SECAGG_RECORD][SIGNATURE_KEY]
    return {SIGNERS_KEY: list(told), SIGNATURE_KEY: list(signatures.values())}


def test_survivor_signatures_replayed_from_another_run_are_refused(tmp_path):
    """A server that kept the survivor signatures of an earlier run (same
    signing keys, same node ids, same round number, same survivors) replays
    them to node 1001 while telling the others that 1003 dropped. Before, the
    signature covered only the round and the set, and 1001 accepted the
    replay. Now it covers the signer's key of this round too: refused."""
    keys = make_signing_keys(tmp_path, 5)
    earlier = _signed_federation(tmp_path, keys=keys)
    earlier.collect()
    everyone = sorted(earlier.vectors)
    replayed = _survivor_signatures(earlier, {n: everyone for n in everyone})

    fed = _signed_federation(tmp_path, keys=keys)
    fed.collect()
    assert sorted(fed.vectors) == everyone
    lie = [n for n in everyone if n != 1003]
    own = _survivor_signatures(fed, {n: everyone if n == 1001 else lie for n in lie})
    # 1001's own signature is fresh; the others' are the replayed ones.
    mixed = dict(replayed)
    mixed[SIGNATURE_KEY] = [
        own[SIGNATURE_KEY][0] if n == 1001 else sig
        for n, sig in zip(everyone, replayed[SIGNATURE_KEY], strict=True)
    ]
    reply = fed.ask(1001, everyone, [], **mixed)
    assert reply.has_error()
    assert "signed the survivor set" in str(reply.error.reason)
    # The replayed signatures are genuine, over this round and these
    # survivors: only the earlier run's keys inside them give them away.
    earlier_round = earlier.wrapped._round
    for node, signature in zip(everyone, replayed[SIGNATURE_KEY], strict=True):
        assert signing.verify(
            earlier_round.signing_keys[node],
            signature,
            signing.SURVIVORS_CONTEXT,
            signing.survivors_statement(
                1, earlier_round.public_keys[node][0], everyone
            ),
        )


def test_a_node_with_keys_refuses_a_server_without_the_consistency_check(tmp_path):
    fed = _signed_federation(tmp_path)
    plain = SecAggPlus(fed.inner, clipping_range=CLIP)
    with pytest.raises(NoRoundAggregatedError):
        plain.start(grid=fed.grid, initial_arrays=fed.problem.initial(), num_rounds=1)
    assert all(
        "active_adversary=True" in why for why in plain._round.dropped.values()
    ), plain._round.dropped


def test_a_participant_outside_the_key_directory_is_refused(tmp_path):
    paths, directory = make_signing_keys(tmp_path, 5)
    (directory / "node4.pub").unlink()  # node 4's key is not trusted

    def node_config(i):
        return {
            "partition-id": i,
            "num-partitions": 5,
            "secagg-signing-key": str(paths[i]),
            "secagg-key-directory": str(directory),
        }

    fed = Federation(5, node_config=node_config, active_adversary=True)
    with pytest.raises(NoRoundAggregatedError):
        fed.wrapped.start(
            grid=fed.grid, initial_arrays=fed.problem.initial(), num_rounds=1
        )
    assert any(
        "outside this node's key directory" in why
        for why in fed.wrapped._round.dropped.values()
    )


def test_clipped_values_are_summed_inside_the_masked_vector(caplog):
    """Before: each reply said in plain how many of its values were clipped.
    Now the count travels masked; the server learns only the round's total."""
    fed = Federation(
        5, strategy_cls=Scaffold, client_cls=ScaffoldClient, clipping_range=8.0
    )
    metrics = []
    original = fed.wrapped.aggregate_train

    def spy(server_round, replies):
        replies = list(replies)
        for reply in replies:
            if not reply.has_error():
                assert "secagg-clipped" not in reply.content.metric_records["metrics"]
        out = original(server_round, replies)
        metrics.append(out[1])
        return out

    fed.wrapped.aggregate_train = spy
    with caplog.at_level(logging.INFO, logger="flwr"):
        fed.wrapped.start(
            grid=fed.grid, initial_arrays=fed.problem.initial(), num_rounds=1
        )
    counts = [
        int(r.getMessage().split(", ")[1].split()[0])
        for r in caplog.records
        if "sent its masked vector" in r.getMessage()
    ]
    assert len(counts) == 5 and sum(counts) > 0
    assert metrics[0]["secagg-clipped"] == sum(counts)


@pytest.mark.parametrize("secure", [True, False])
def test_the_experiment_client_app_requires_what_its_run_configures(secure):
    """The pack's ClientApp reads the run's configuration: with
    secure_aggregation set, a plain train message (a server that left out the
    wrapper) gets no update, only a refusal naming the setting."""
    overrides = "strategy=fedavg num_clients=2 model=logreg train.local_epochs=1"
    if secure:
        overrides += " secure_aggregation=secaggplus"
    grid = InProcessGrid(
        make_client_app(), num_nodes=2, run_config={"overrides": overrides}
    )
    initial = ArrayRecord(client_recipe({"overrides": overrides}).model.state_dict())
    plain = FedAvg(min_train_nodes=2, min_available_nodes=2)
    replies = list(
        grid.send_and_receive(
            list(plain.configure_train(1, initial, ConfigRecord(), grid))
        )
    )
    assert len(replies) == 2
    if secure:
        assert all(
            r.has_error() and "secagg-required" in r.error.reason for r in replies
        )
    else:
        assert not any(r.has_error() for r in replies)
        assert all(r.content.array_records for r in replies)

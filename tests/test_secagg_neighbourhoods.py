"""SecAgg+'s automatic neighbourhoods: the size grows as log n, its bounds hold on
the real ring, a 60-client round unmasks what plain aggregation gives, and a
server that lies about the neighbourhoods gets nothing masked."""

from __future__ import annotations

import itertools
import logging
import math

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message

from flwr_prox_strategies import FedAvg, FedAvgClient, SecAggPlus, to_client_app
from flwr_prox_strategies.core.client.secagg import SecAggPlusMod
from flwr_prox_strategies.core.privacy import secagg_exchange
from flwr_prox_strategies.core.transport.inprocess import (
    InProcessGrid,
    node_unavailable_reply,
)
from flwr_prox_strategies.core.transport.secagg import (
    SECAGG_RECORD,
    Key,
    Stage,
    neighbours,
)
from flwr_prox_strategies.ops.privacy.neighbourhoods import (
    correctness_failure,
    disconnection_failure,
    hypergeometric_tail,
    neighbourhood_size,
    privacy_failure,
    runs_removed,
)
from flwr_prox_strategies.testing.federation import LeastSquares

from .helpers import logged

CLIENT = {"learning_rate": 0.05, "local_epochs": 2}
CLIP = 1024.0  # 60 least-squares clients reach a few hundred
N = 60


# ------------------------------------------------------------- the formula
def test_the_size_grows_as_log_n_and_stays_well_below_n():
    sizes = {n: neighbourhood_size(n) for n in range(10, 5001, 10)}
    values = [sizes[n].size for n in sorted(sizes)]
    assert values == sorted(values)  # nondecreasing where 0.1 n is whole
    for n, (k, t) in sizes.items():
        assert k % 2 == 1 and k < n and 2 * t > k and t <= k, (n, k, t)
    assert neighbourhood_size(60).size == 15
    assert neighbourhood_size(100).size == 23
    assert neighbourhood_size(200).size == 33
    # log n: a hundred times the nodes, a few more neighbours.
    big, small = neighbourhood_size(10**5).size, neighbourhood_size(10**3).size
    assert 0 < big - small <= 15
    assert neighbourhood_size(10**6).size < 70


def test_small_federations_mask_with_everyone_as_before():
    for n in range(1, 6):
        k, t = neighbourhood_size(n)
        assert k == n
        assert t == max(2, math.ceil(0.6 * n))


def test_a_fixed_threshold_is_respected():
    k, t = neighbourhood_size(200, threshold=0.6)
    assert t == math.ceil(0.6 * k)
    assert k >= neighbourhood_size(200).size  # a fixed t is never cheaper
    assert neighbourhood_size(200, threshold=20).threshold == 20


def test_the_hypergeometric_tail_is_exact_against_enumeration():
    population, marked = 12, 4
    items = range(population)
    for draws in (3, 5, 8):
        counts = [
            sum(i < marked for i in chosen)
            for chosen in itertools.combinations(items, draws)
        ]
        for at_least in range(draws + 2):
            exact = sum(c >= at_least for c in counts) / len(counts)
            got = hypergeometric_tail(population, marked, draws, at_least)
            assert got == pytest.approx(exact, rel=1e-9, abs=1e-15)
    assert runs_removed(10, 4, 2) == pytest.approx(4 * 3 * 2 * 1 / (10 * 9 * 8 * 7))


def _components(alive: set[int], graph: dict[int, set[int]]) -> int:
    seen: set[int] = set()
    parts = 0
    for start in alive:
        if start in seen:
            continue
        parts += 1
        stack = [start]
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            stack.extend(graph[node] & alive - seen)
    return parts


def test_the_bounds_hold_on_the_real_ring_by_simulation():
    """30 nodes, small neighbourhoods (so the bounds are far from 0): each
    condition's empirical frequency on the pack's own ring stays below it."""
    n, corrupt, dropped, trials = 30, 6, 6, 3000
    rng = np.random.default_rng(0)
    for size, t in ((5, 3), (7, 4)):
        leaks = splits = short = 0
        for _ in range(trials):
            graph = neighbours(list(range(n)), size, rng)
            order = rng.permutation(n)
            bad, gone = set(order[:corrupt]), set(order[corrupt : corrupt + dropped])
            leaks += any(len((graph[v] - {v}) & bad) >= t for v in range(n))
            survivors = set(range(n)) - bad - gone
            splits += _components(survivors, graph) > 1
            short += any(len((graph[v] - {v}) - gone) < t for v in range(n))
        slack = 3 / math.sqrt(trials)  # three standard deviations at most
        assert leaks / trials <= privacy_failure(n, size, t, corrupt) + slack
        assert splits / trials <= disconnection_failure(n, size, corrupt + dropped)
        assert short / trials <= correctness_failure(n, size, t, dropped) + slack
        # The bounds are not vacuous here: the events happen.
        assert splits > 0 and short > 0


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"corrupt_fraction": 0.5}, "corrupt_fraction"),
        ({"dropout_fraction": -0.1}, "dropout_fraction"),
        ({"security_bits": 0}, "security_bits"),
        ({"correctness_bits": "20"}, "correctness_bits"),
        ({"num_shares": "everyone"}, "num_shares"),
        ({"reconstruction_threshold": 0.5}, "reconstruction_threshold"),
    ],
)
def test_bad_settings_are_refused_naming_the_parameter(options, name):
    with pytest.raises(ValueError, match=name):
        SecAggPlus(FedAvg(), **options)
    with pytest.raises(ValueError, match="min_neighbourhood"):
        SecAggPlusMod(min_neighbourhood=0)
    with pytest.raises(ValueError, match="n must be"):
        neighbourhood_size(0)


# ------------------------------------------------------- a 60-client round
class Federation:
    """``N`` least-squares clients; nodes in ``dead`` vanish at collection."""

    def __init__(self, *, mod: dict | None = None, node_config=None):
        self.problem = LeastSquares(num_clients=N, dim=5)
        self.app = to_client_app(
            self.problem.client_fn(FedAvgClient, **CLIENT),
            secure_aggregation=False,
            mods=[SecAggPlusMod(**(mod or {}))],
        )
        self.dead: set[int] = set()
        self.grid = InProcessGrid(self, num_nodes=N, node_config=node_config)

    def __call__(self, message: Message, context: Context) -> Message:
        record = message.content.config_records.get(SECAGG_RECORD)
        stage = record.get(Key.STAGE) if record is not None else None
        node = message.metadata.dst_node_id
        if node in self.dead and stage == Stage.COLLECT_MASKED_VECTORS:
            self.grid.dead_nodes.add(node)
            return node_unavailable_reply(message)
        return self.app(message, context)

    def strategy(self, **more):
        return FedAvg(
            min_train_nodes=N, min_available_nodes=N, fraction_evaluate=0.0, **more
        )

    def round(self, wrapped):
        messages = list(
            wrapped.configure_train(
                1, self.problem.initial(), ConfigRecord(), self.grid
            )
        )
        replies = list(self.grid.send_and_receive(messages))
        return messages, wrapped.aggregate_train(1, replies)


def _plain(dead: set[int]):
    fed = Federation()
    fed.grid.dead_nodes |= dead
    inner = fed.strategy(accept_failures=True)
    sent = list(
        inner.configure_train(1, fed.problem.initial(), ConfigRecord(), fed.grid)
    )
    arrays, _ = inner.aggregate_train(1, fed.grid.send_and_receive(sent))
    return arrays.to_numpy_ndarrays()[0]


@pytest.mark.parametrize("dropped", [0, 6])
def test_sixty_clients_unmask_the_plain_mean_with_the_auto_size(dropped, caplog):
    fed = Federation()
    fed.dead = set(range(1001, 1001 + N))
    fed.dead = set(sorted(fed.dead)[3 : 3 + 10 * dropped : 10])  # spread out
    wrapped = SecAggPlus(fed.strategy(accept_failures=True), clipping_range=CLIP)
    with caplog.at_level(logging.INFO, logger="flwr"):
        _, (arrays, metrics) = fed.round(wrapped)
    state = wrapped._round
    assert (state.num_shares, state.threshold) == neighbourhood_size(N) == (15, 8)
    assert all(len(members) == 15 for members in state.neighbours.values())
    assert logged(caplog, "neighbourhoods of 15, threshold 8")
    assert arrays is not None, state.failure
    assert metrics["secagg-contributors"] == N - dropped
    assert metrics["secagg-clipped"] == 0
    plain = _plain(fed.dead)
    diff = np.abs(arrays.to_numpy_ndarrays()[0] - plain).max()
    assert 0 < diff <= metrics["secagg-error-bound"]


# ------------------------------------------------------------- a lying server
def test_a_server_asking_for_neighbourhoods_of_three_gets_nothing_masked():
    fed = Federation()
    wrapped = SecAggPlus(fed.strategy(), num_shares=3, clipping_range=CLIP)
    messages, (arrays, _) = fed.round(wrapped)
    assert messages == [] and arrays is None
    dropped = wrapped._round.dropped
    assert len(dropped) == N
    assert all("below the 15 that num_shares='auto'" in w for w in dropped.values())


def test_a_server_declaring_the_auto_size_but_giving_three_gets_nothing(monkeypatch):
    """The liar declares k = 15, t = 8, then hands each node a ring of 3 (and
    skips the honest server's own check of its neighbourhoods)."""

    def small(nodes, num_shares, rng):
        return neighbours(nodes, 3, rng)

    monkeypatch.setattr(secagg_exchange, "neighbours", small)
    monkeypatch.setattr(
        secagg_exchange.KeyExchange, "_check_neighbourhoods", lambda *a: None
    )
    fed = Federation()
    wrapped = SecAggPlus(fed.strategy(), clipping_range=CLIP)
    messages, (arrays, _) = fed.round(wrapped)
    assert messages == [] and arrays is None
    dropped = wrapped._round.dropped
    assert len(dropped) == N and not wrapped._round.shared  # no share sent
    assert all("fewer than the threshold 8" in w for w in dropped.values()), dropped


def test_a_server_giving_more_neighbours_than_declared_gets_nothing(monkeypatch):
    def large(nodes, num_shares, rng):
        return neighbours(nodes, 21, rng)

    monkeypatch.setattr(secagg_exchange, "neighbours", large)
    fed = Federation()
    wrapped = SecAggPlus(fed.strategy(), clipping_range=CLIP)
    messages, _ = fed.round(wrapped)
    assert messages == []
    dropped = wrapped._round.dropped
    assert len(dropped) == N
    assert all("more than the neighbourhood of 15" in w for w in dropped.values())


@pytest.mark.parametrize("where", ["mod", "node config"])
def test_a_node_floor_refuses_smaller_neighbourhoods(where):
    if where == "mod":
        fed = Federation(mod={"min_neighbourhood": 21})
    else:
        fed = Federation(
            node_config=lambda i: {
                "partition-id": i,
                "num-partitions": N,
                "secagg-min-neighbourhood": "21",
            }
        )
    wrapped = SecAggPlus(fed.strategy(), clipping_range=CLIP)
    messages, _ = fed.round(wrapped)
    assert messages == []
    assert all(
        "below this node's floor 21" in why for why in wrapped._round.dropped.values()
    )
    # Everyone (k = 60) is above the floor: the round runs.
    fed = Federation(mod={"min_neighbourhood": 21})
    wrapped = SecAggPlus(fed.strategy(), num_shares=1.0, clipping_range=CLIP)
    _, (arrays, _) = fed.round(wrapped)
    assert arrays is not None


def test_distributed_dp_keeps_everyone_and_explicit_sizes_are_kept():
    """Distributed DP counts the noise of t contributors: auto stays everyone."""
    from flwr_prox_strategies import DistributedDP
    from flwr_prox_strategies.core.privacy.secagg_exchange import _Round

    dp = DistributedDP(noise_multiplier=1.0, l2_clip=1.0, expected_clients=N)
    inner = FedAvg(min_train_nodes=2, weighting="uniform")
    for wrapped, expected in (
        (SecAggPlus(inner, distributed_dp=dp), (N, 36)),
        (SecAggPlus(inner), neighbourhood_size(N)),
        (SecAggPlus(inner, num_shares=1.0), (N, 36)),
        (SecAggPlus(inner, num_shares=21, reconstruction_threshold=0.6), (21, 13)),
    ):
        state = _Round(1, {})
        wrapped._size_round(state, N)
        assert (state.num_shares, state.threshold) == expected


def test_the_hydra_keys_reach_the_wrapper_and_null_keeps_its_defaults():
    from flwr_prox_strategies.experiment.build import wrap_secure_aggregation
    from flwr_prox_strategies.experiment.config import compose_config

    cfg = compose_config(
        "secure_aggregation=secaggplus secure_aggregation.corrupt_fraction=0.2"
    )
    wrapped = wrap_secure_aggregation(cfg, FedAvg(min_train_nodes=2), lambda: 100)
    assert wrapped.num_shares == "auto" and wrapped.reconstruction_threshold is None
    assert wrapped.corrupt_fraction == 0.2
    default = SecAggPlus(FedAvg())
    assert (wrapped.security_bits, wrapped.correctness_bits) == (
        default.security_bits,
        default.correctness_bits,
    )
    assert wrapped.dropout_fraction == default.dropout_fraction

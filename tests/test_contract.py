"""The conformance kit run over every algorithm of the pack.

The checks themselves live in :mod:`flwr_prox_strategies.testing`, the kit a
plugin's own tests call; the configurations come from the algorithm table
(each algorithm module's ``CASES``), so a new algorithm is checked as soon as
it is registered, and a strategy of the pack is checked exactly as a plugin's.
"""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord

from flwr_prox_strategies import FedAvg, testing
from flwr_prox_strategies.algorithms import ALGORITHMS
from flwr_prox_strategies.testing.checks import to_arrays
from flwr_prox_strategies.testing.replies import valid_content

from .helpers import model_arrays, record, sampling_grid

NUM_NODES = testing.NUM_NODES

#: Every configuration of the table, as other test modules name them:
#: ``<algorithm>`` for the default case, else ``<algorithm>-<case>``.
STRATEGIES = {
    (name if case == "default" else f"{name}-{case}"): (
        lambda make=make: make(NUM_NODES)
    )
    for name, algorithm in ALGORITHMS.items()
    for case, make in testing.cases_of(algorithm).items()
}
#: The kit's bad replies, as (strategy, message, the round's good replies).
BAD_REPLIES = {
    kind: (lambda s, m, good, make=make: make(s, m))
    for kind, make in testing.BAD_REPLIES.items()
    if "declared-metric" not in kind  # no pack strategy declares metrics
}
to_np = to_arrays
assert_same_state = testing.assert_same_value
good_content = valid_content


def build_reply(to, content, n=10, metrics=None, *, strategy=None):
    """A valid reply with the given arrays (the kit's, under the old names)."""
    assert metrics is not None or strategy is not None, "say whose reply it is"
    return testing.valid_reply(strategy, to, content, num_examples=n, metrics=metrics)


def setup_round(name: str):
    """A fresh configuration ``name``, its round-1 messages and valid replies."""
    return testing.first_round(lambda n: STRATEGIES[name]())


CHECKS = {
    f"{name}/{check}": run
    for name, algorithm in ALGORITHMS.items()
    for check, run in testing.conformance_checks(algorithm).items()
}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_conformance(name: str) -> None:
    CHECKS[name]()


def test_every_algorithm_is_checked_against_every_kind_of_bad_reply() -> None:
    for name in ALGORITHMS:
        for kind in testing.BAD_REPLIES:
            if "declared-metric" in kind:
                continue  # only for strategies that declare metrics
            assert any(
                key.startswith(f"{name}/") and key.endswith(f"/bad-reply/{kind}")
                for key in CHECKS
            ), (name, kind)


def test_zero_total_weight_is_logged_not_raised() -> None:
    class ZeroWeight(FedAvg):
        def reply_weight(self, reply):
            return 0.0

    strategy = ZeroWeight(min_available_nodes=NUM_NODES)
    messages = list(
        strategy.configure_train(
            1, record(model_arrays()), ConfigRecord(), sampling_grid(NUM_NODES)
        )
    )
    replies = [testing.valid_reply(strategy, m, seed=i) for i, m in enumerate(messages)]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is None and metrics is not None


def test_not_enough_nodes_fails_fast_with_the_fix() -> None:
    strategy = FedAvg(min_available_nodes=20, node_wait_timeout=0.0)
    with pytest.raises(RuntimeError, match="num-supernodes"):
        strategy.configure_train(
            1, record(model_arrays()), ConfigRecord(), sampling_grid(3)
        )

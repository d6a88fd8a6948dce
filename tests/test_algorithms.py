"""The algorithm table agrees with the conf tree, the exports, the tests and the README.

An algorithm added half-way (a module without its YAML, a YAML naming another
client, a strategy missing from the bad-reply contract suite) fails here.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import numpy as np
import pytest
from flwr.serverapp.strategy import Strategy
from hydra.utils import get_class
from omegaconf import OmegaConf

import flwr_prox_strategies as pack
from flwr_prox_strategies import FedAvgClient, extend
from flwr_prox_strategies.algorithms import ALGORITHMS

from .lsq import LeastSquares

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf" / "strategy"


def test_every_strategy_yaml_is_an_algorithm_and_back() -> None:
    assert {p.stem for p in CONF.glob("*.yaml")} == set(ALGORITHMS)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_yaml_names_the_algorithms_strategy_and_client(name: str) -> None:
    node = OmegaConf.load(CONF / f"{name}.yaml")
    entry = ALGORITHMS[name]
    assert get_class(node.strategy._target_) is entry.strategy
    client = get_class(node.client._target_)
    if entry.client is None:  # a composite: its clients are its inner strategy's
        inner = get_class(node.strategy.inner._target_)
        matching = [a for a in ALGORITHMS.values() if a.strategy is inner]
        assert matching and client is matching[0].client
    else:
        assert client is entry.client


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_client_rule_and_strategy_belong_together(name: str) -> None:
    entry = ALGORITHMS[name]
    if entry.client is None:
        return
    assert entry.client.rule_class is entry.rule
    assert entry.client.protocol == entry.rule.protocol
    if entry.strategy.rule_metric is not None:  # the names its warning gives
        default = (f"{entry.strategy.__name__}Client", f"{entry.strategy.__name__}Rule")
        client, rule = entry.strategy.rule_pieces or default
        assert getattr(pack, client) is entry.client
        assert getattr(pack, rule) is entry.rule
        if name != "sfedprox":  # SFedRule serves both; it reports both metrics
            assert entry.rule.applied_metric == entry.strategy.rule_metric
    # What the server reads of its clients without importing them (checkpoints).
    assert entry.rule.stateful == entry.strategy.stateful_clients
    assert entry.rule.keeps_privacy_ledger == entry.strategy.ledger_clients


def test_the_package_exports_exactly_the_tables_pieces() -> None:
    exported = {getattr(pack, name) for name in pack.__all__}
    pieces = {
        piece
        for entry in ALGORITHMS.values()
        for piece in (entry.strategy, entry.client, entry.rule)
        if piece is not None
    }
    assert pieces <= exported
    strategies = {
        obj
        for obj in exported
        if inspect.isclass(obj)
        and issubclass(obj, Strategy)
        and obj.__module__.startswith("flwr_prox_strategies.algorithms")
    }
    assert strategies == {entry.strategy for entry in ALGORITHMS.values()} | {
        entry.deployed for entry in ALGORITHMS.values() if entry.deployed is not None
    }


#: What a user of the algorithms imports; contributors' names are in .extend.
USER_API = {
    *(f"{name}{part}" for name in ("FedAvg", "FedProx", "FedDyn", "FedDC")
      for part in ("", "Client")),
    "FedProxRule", "FedDynRule", "FedDCRule", "Scaffold", "ScaffoldClient",
    "ScaffoldRule", "APFL", "APFLClient", "APFLRule", "FedEPM", "FedEPMClient",
    "FedEPMRule", "SFedAvg", "SFedAvgClient", "SFedProx", "SFedProxClient",
    "SFedRule", "PFedAvg", "PFedAvgServer", "ClientRule",  # FedAvg's rule
    "to_client_app", "PROXIMAL_MU_KEY", "ProtocolError", "NoRoundAggregatedError",
    "EveryClientRetiredError", "AggregationStalledError",
    "DPSGD", "make_private_model", "PrivacyBudgetExhausted", "LaplaceUploadMod", "SecAggPlus", "SecAggPlusMod",
    "DistributedDP", "PrivacyBudgetSpentError", "FederatedPart", "federated_part",
    "ClientSideFixedClipping", "ServerSideFixedClipping", "PromptGrid",
}  # fmt: skip

EXTEND_API = {
    "STATE_ROUND_METRIC": "flwr_prox_strategies.core.transport.keys",
    "ValidatedFedAvg": "flwr_prox_strategies.core.server.strategy",
    "StrategyWrapper": "flwr_prox_strategies.core.wrapper",
    "RunLifecycle": "flwr_prox_strategies.core.wrapper",
    "RoundUpdate": "flwr_prox_strategies.core.contract.fields",
    "ClientRule": "flwr_prox_strategies.core.client.rule",
    "TorchClient": "flwr_prox_strategies.core.client.client",
    "GradientTerm": "flwr_prox_strategies.core.client.training",
    "ValidReply": "flwr_prox_strategies.core.contract.validation",
    "ReplyRejected": "flwr_prox_strategies.core.contract.validation",
    "MetricSpec": "flwr_prox_strategies.core.contract.validation",
    "RecordSpec": "flwr_prox_strategies.core.transport.records",
    "ArraySpec": "flwr_prox_strategies.core.transport.records",
    "ClientState": "flwr_prox_strategies.core.client.state",
    "StepCounts": "flwr_prox_strategies.core.client.steps",
    "record_to_dict": "flwr_prox_strategies.core.transport.records",
    "dict_to_record": "flwr_prox_strategies.core.transport.records",
    "ALGORITHMS": "flwr_prox_strategies.algorithms",
    "Algorithm": "flwr_prox_strategies.algorithms",
    "NoRoundAggregatedError": "flwr_prox_strategies.core.server.outcome",
    "ReplyTally": "flwr_prox_strategies.core.server.outcome",
    "RoundPiece": "flwr_prox_strategies.core.server.pieces",
    "LearningRateDecay": "flwr_prox_strategies.core.server.pieces",
    "DissimilarityMonitor": "flwr_prox_strategies.core.server.pieces",
    "Stragglers": "flwr_prox_strategies.core.server.sampling",
    **{
        f"check_{kind}": "flwr_prox_strategies.ops.checks"
        for kind in ("int", "positive", "non_negative", "fraction", "choice")
    },
}


def test_the_top_level_is_the_users_api_exactly() -> None:
    exported, listed = set(pack.__all__), USER_API
    assert not exported - listed, (
        f"flwr_prox_strategies exports {sorted(exported - listed)}: add them to "
        "USER_API in tests/test_algorithms.py (and to docs/reference/api/)"
    )
    assert not listed - exported, (
        f"USER_API in tests/test_algorithms.py lists {sorted(listed - exported)}: "
        "add them to __all__ in flwr_prox_strategies/__init__.py, or remove them"
    )
    assert len(pack.__all__) == len(USER_API), "a name twice in __all__"
    assert all(hasattr(pack, name) for name in pack.__all__)


def test_extend_holds_the_extension_points_from_their_homes() -> None:
    import importlib

    exported, listed = set(extend.__all__), set(EXTEND_API)
    assert not exported - listed, (
        f"flwr_prox_strategies.extend exports {sorted(exported - listed)}: add "
        "them, with their home module, to EXTEND_API in tests/test_algorithms.py"
    )
    assert not listed - exported, (
        f"EXTEND_API in tests/test_algorithms.py lists {sorted(listed - exported)}: "
        "add them to __all__ in flwr_prox_strategies/extend.py, or remove them"
    )
    for name, home in EXTEND_API.items():
        assert getattr(extend, name) is getattr(importlib.import_module(home), name)
        assert name in (extend.__doc__ or ""), f"extend's guide does not name {name}"


@pytest.mark.parametrize("name", ["ValidatedFedAvg", "TorchClient"])
def test_a_moved_name_still_imports_from_the_top_with_a_warning(name: str) -> None:
    with pytest.warns(FutureWarning, match=f"flwr_prox_strategies.extend.{name}"):
        assert getattr(pack, name) is getattr(extend, name)
    with pytest.raises(AttributeError):
        _ = pack.NoSuchName  # type: ignore[attr-defined]


def test_the_extend_guide_s_example_runs_and_resumes() -> None:
    """The strategy written in extend's docstring trains, and its declared state
    goes through state_dict/load_state_dict."""
    (code,) = re.findall(r"::\n\n((?:    .*\n|\n)+)", extend.__doc__ or "")
    namespace: dict = {}
    exec(compile(inspect.cleandoc(code), "extend-example", "exec"), namespace)
    strategy = namespace["SmoothedMedian"](beta=0.5, min_available_nodes=4)
    lsq = LeastSquares(num_clients=4)
    theta = lsq.run(strategy, FedAvgClient, rounds=3, learning_rate=0.1)
    assert np.all(np.isfinite(theta)) and strategy.smoothed is not None
    state = strategy.state_dict()
    assert "smoothed" in state and state["beta"] == 0.5
    fresh = namespace["SmoothedMedian"](beta=0.5)
    fresh.load_state_dict(state)
    np.testing.assert_array_equal(
        next(iter(fresh.smoothed.values())), next(iter(strategy.smoothed.values()))
    )
    with pytest.raises(ValueError, match="beta"):
        namespace["SmoothedMedian"](beta=0.9).load_state_dict(state)
    assert "beta=0.5" in repr(strategy)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_declares_its_conformance_cases(name: str) -> None:
    entry = ALGORITHMS[name]
    assert entry.cases, (
        f"{entry.strategy.__module__} declares no CASES for the conformance "
        "checks: add them there and to its ALGORITHMS entry"
    )
    for make in entry.cases.values():
        assert type(make(5)) is entry.strategy


def test_the_readme_and_the_docs_list_every_algorithm() -> None:
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## The algorithms")[1].split("\n## ")[0]
    pages = (ROOT / "docs" / "algorithms" / "index.md").read_text()
    for entry in ALGORITHMS.values():
        assert f"`{entry.strategy.__name__}`" in table, entry.strategy.__name__
        assert entry.strategy.__name__ in pages, entry.strategy.__name__

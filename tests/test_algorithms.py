"""The algorithm table agrees with the conf tree, the exports, the tests and the README.

An algorithm added half-way (a module without its YAML, a YAML naming another
client, a strategy missing from the bad-reply contract suite) fails here.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import Strategy
from hydra.utils import get_class
from omegaconf import OmegaConf

import flwr_prox_strategies as pack
from flwr_prox_strategies import ProtocolError
from flwr_prox_strategies.algorithms import ALGORITHMS
from flwr_prox_strategies.core.rule import ClientRule

from .test_contract import STRATEGIES as CONTRACT_CASES
from .test_rules import context, train_message

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
    assert strategies == {entry.strategy for entry in ALGORITHMS.values()}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_the_bad_reply_contract_covers_every_algorithm(name: str) -> None:
    strategy = ALGORITHMS[name].strategy
    assert any(type(make()) is strategy for make in CONTRACT_CASES.values()), (
        f"tests/test_contract.py STRATEGIES has no case for {strategy.__name__}"
    )


def test_the_readme_lists_every_algorithm() -> None:
    table = (ROOT / "README.md").read_text().split("## What the main job produces")[0]
    for entry in ALGORITHMS.values():
        assert f"`{entry.strategy.__name__}`" in table, entry.strategy.__name__


@pytest.mark.parametrize(
    "name",
    sorted(
        n
        for n, a in ALGORITHMS.items()
        if a.rule is not None and a.rule is not ClientRule
    ),
)
def test_a_rule_sent_another_strategys_message_names_the_strategy_it_needs(
    name: str,
) -> None:
    entry = ALGORITHMS[name]
    assert entry.rule is not None
    model = torch.nn.Linear(3, 1, bias=False)
    fedavg_message = train_message(
        ArrayRecord([np.zeros((1, 3), np.float32)]), {"lr": 0.1, "server-round": 1}
    )
    kwargs = (
        {"num_examples": 10}
        if "num_examples" in inspect.signature(entry.rule.__init__).parameters
        else {}
    )
    with pytest.raises(ProtocolError, match=f"running {entry.rule.protocol}"):
        entry.rule.from_message(fedavg_message, context(), model, **kwargs)

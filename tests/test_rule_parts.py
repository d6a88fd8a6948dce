"""The rule's parts, each on its own: layout, message ends, wiring, round commit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flwr_prox_strategies import ClientRule, FedDynRule, ScaffoldRule, testing
from flwr_prox_strategies.core.client.layout import ReplyLayout
from flwr_prox_strategies.core.client.message import metric_record, server_hint
from flwr_prox_strategies.core.client.rule import pack_rules
from flwr_prox_strategies.core.client.state import ClientState, RoundCommit
from flwr_prox_strategies.core.transport.keys import (
    ACCEPTED_ROUND_KEY,
    RUN_TAG_KEY,
    STATE_OUTSIDE_COMMIT_METRIC,
    STATE_ROUND_METRIC,
)


def test_layout_replies_in_the_dtypes_and_keys_the_server_sent() -> None:
    model = testing.buffered_model()
    entries = model.state_dict()
    keys = [f"k{i}" for i in range(len(entries))]
    layout = ReplyLayout(model, keys, [np.dtype(np.float64)] * len(entries))
    params = [p for p in model.parameters() if p.requires_grad]
    arrays = layout.to_reply(
        [torch.ones_like(p) for p in params], params, buffers="zeros", rule="R"
    )
    assert all(a.dtype == np.float64 for a in arrays)
    record = layout.record([a.astype(np.float32) for a in arrays])
    assert list(record.keys()) == keys
    assert all(a.numpy().dtype == np.float64 for a in record.values())
    model_record = layout.model_record()
    for (_name, value), array in zip(
        entries.items(), model_record.values(), strict=True
    ):
        np.testing.assert_array_equal(array.numpy(), value.double().numpy())


def test_layout_without_the_servers_dtypes_keeps_the_models() -> None:
    model = testing.buffered_model()
    wrong_count = ReplyLayout(model, [], [np.dtype(np.float64)])
    assert wrong_count.server_dtypes() is None
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(ValueError, match="buffers must be"):
        wrong_count.to_reply(params, params, buffers="ones", rule="R")
    with pytest.raises(ValueError, match=r"R\.to_reply_layout takes one tensor"):
        wrong_count.to_reply(params[:1], params, buffers="zeros", rule="R")


def test_metric_record_holds_python_numbers() -> None:
    record = metric_record(
        {"a": True, "b": np.float32(0.5), "c": torch.tensor(3), "d": 2}
    )
    assert dict(record) == {"a": 1, "b": 0.5, "c": 3, "d": 2}
    assert type(record["a"]) is int and type(record["b"]) is float


def test_server_hint_names_the_rule_for_the_keys_sent() -> None:
    hint = server_hint({"feddyn-alpha": 0.1}, ScaffoldRule, pack_rules())
    assert "build FedDynRule" in hint and "instead of ScaffoldRule" in hint
    assert server_hint({"feddyn-alpha": 0.1}, FedDynRule, pack_rules()) == ""
    assert server_hint({"lr": 0.1}, ScaffoldRule, pack_rules()) == ""


def test_round_commit_applies_the_servers_word_then_spots_a_set() -> None:
    state = ClientState(None)
    state.set_pending("drift", [np.ones(2)], server_round=3)
    config = {ACCEPTED_ROUND_KEY: 3}
    commit = RoundCommit(state, ("drift",), config, client_key=4, rule="R")
    assert state.get("drift") is not None and state.committed_round() == 3
    assert commit.metrics() == {STATE_ROUND_METRIC: 3, STATE_OUTSIDE_COMMIT_METRIC: 0}
    state.set("drift", [np.zeros(2)])  # commits at once: outside the commit
    assert commit.saved_outside() == ["drift"]
    assert commit.metrics()[STATE_OUTSIDE_COMMIT_METRIC] == 1


def test_round_commit_forgets_state_that_names_no_run() -> None:
    state = ClientState(None)
    state.set_pending("drift", [np.ones(2)], server_round=3)
    config = {RUN_TAG_KEY: "run-a", ACCEPTED_ROUND_KEY: 3}
    RoundCommit(state, ("drift",), config, client_key=4, rule="R")
    assert state.get("drift") is None


def test_round_commit_drops_what_the_server_did_not_aggregate() -> None:
    state = ClientState(None)
    state.set_pending("drift", [np.ones(2)], server_round=3)
    RoundCommit(state, ("drift",), {ACCEPTED_ROUND_KEY: 2}, client_key=0, rule="R")
    assert state.get("drift") is None


def test_a_moved_method_still_works_and_says_where_it_went() -> None:
    model = torch.nn.Linear(2, 1)
    rule = ClientRule(model, {})
    with pytest.warns(DeprecationWarning, match=r"use rule\.wiring\.ensure_term"):
        rule.ensure_term()
    # Without an optimiser, a loop's steps are its calls that added the term.
    assert rule.counts.steps == 1
    adam = torch.optim.Adam(model.parameters())
    moved = r"rule\.wiring\.check_plain_sgd"
    with (
        pytest.warns(DeprecationWarning, match=moved),
        pytest.raises(ValueError, match=r"needs torch\.optim\.SGD"),
    ):
        rule.check_plain_sgd(adam)
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        rule.nonsense  # noqa: B018


def test_the_wiring_counts_what_the_optimiser_did() -> None:
    model = torch.nn.Linear(2, 1)
    rule = ClientRule(model, {})
    optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=0.5))
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
    rule.close()
    assert rule.counts.steps == 3
    assert rule.wiring.lr_of_round(None) == 0.5
    assert rule.wiring.handles == []  # close removed the hook


def test_the_add_an_algorithm_page_shows_the_whole_rule_surface() -> None:
    """The page's one-screen surface names every public method the rule defines."""
    import inspect
    import re
    from pathlib import Path

    page = (
        Path(__file__).resolve().parent.parent / "docs" / "howto" / "add-algorithm.md"
    ).read_text()
    shown = set(re.findall(r"self\.(\w+)\(", page)) | {"setup", "finish"}
    own = {
        name
        for name, value in vars(ClientRule).items()
        if not name.startswith("_") and inspect.isfunction(value)
    }
    assert own <= shown, f"the page omits {sorted(own - shown)}"
    assert len(own) <= 10, f"the author's surface grew: {sorted(own)}"

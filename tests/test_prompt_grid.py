"""Replies pulled as they arrive (``PromptGrid``), on a clock of the test's own.

Flower's grids pull at a fixed cadence (0.1 s in simulation, 3 s in a
deployment). The view pulls at once, then after waits of ``share`` of the
time waited so far, ``first_wait`` to ``max_wait``: a phase ends at most about
``share`` after its last reply, and a long phase pulls about as seldom as
Flower's deployment grid. The grid here delivers each reply at a chosen time;
the clock moves only when the view sleeps.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from flwr.serverapp import Grid

from flwr_prox_strategies.core.transport.grid import PromptGrid
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


class TimedGrid(Grid):
    """Reply ``i`` arrives ``arrivals[i]`` seconds after the push (inf: never)."""

    def __init__(self, clock: Clock, arrivals: list[float]) -> None:
        self.clock, self.arrivals = clock, arrivals
        self.pulled_at: list[float] = []
        self.pull_interval = 0.1  # a grid's own attribute, read through the view
        self._due: dict[str, tuple[float, Any]] = {}

    def set_run(self, run: Any) -> None:
        self.run_set = run

    @property
    def run(self) -> Any:
        return self.run_set

    def create_message(self, *args: Any, **kwargs: Any) -> Any:
        return message(1)

    def get_node_ids(self) -> Iterable[int]:
        return [1, 2, 3]

    def get_nodes(self) -> Iterable[Any]:
        return ["node info"]

    def push_messages(self, messages: Iterable[Any]) -> Iterable[str]:
        ids = [f"m{i}" for i, _ in enumerate(messages)]
        for i, message_id in enumerate(ids):
            reply = SimpleNamespace(
                metadata=SimpleNamespace(reply_to_message_id=message_id)
            )
            self._due[message_id] = (self.clock() + self.arrivals[i], reply)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Any]:
        self.pulled_at.append(self.clock())
        ready = [i for i in message_ids if self._due[i][0] <= self.clock()]
        return [self._due.pop(i)[1] for i in ready]

    def send_and_receive(
        self, messages: Iterable[Any], *, timeout: float | None = None
    ) -> Iterable[Any]:
        raise AssertionError("the view waits itself")


def message(node: int) -> Any:
    """What the view passes on untouched: a message to ``node``."""
    return SimpleNamespace(metadata=SimpleNamespace(dst_node_id=node))


def messages(n: int) -> list[Any]:
    return [message(k) for k in range(n)]


def prompt(clock: Clock, arrivals: list[float]) -> tuple[PromptGrid, TimedGrid]:
    parent = TimedGrid(clock, arrivals)
    return PromptGrid(parent, clock=clock, sleep=clock.sleep), parent


@pytest.mark.parametrize("last", [0.0, 0.003, 0.05, 0.27, 2.0, 45.0, 600.0])
def test_a_phase_ends_soon_after_its_last_reply(last: float) -> None:
    clock = Clock()
    grid, parent = prompt(clock, [0.0, last / 2, last])
    replies = list(grid.send_and_receive(messages(3)))
    assert len(replies) == 3
    # At most share of the wait later (plus the shortest wait), or max_wait.
    assert clock.now <= max(last * (1 + grid.share) + grid.first_wait, 0.0) + 1e-9
    assert clock.now - last <= grid.max_wait + 1e-9
    # Flower's simulation grid would have ended at the next 0.1 s poll.
    assert grid.pulls == len(parent.pulled_at)
    # Waits grow: the pulls are logarithmically many, then max_wait apart.
    growing = math.log(max(last, grid.first_wait) / grid.first_wait) / math.log(
        1 + grid.share
    )
    assert grid.pulls <= 2 + growing + last / grid.max_wait
    assert all(b >= a for a, b in zip(clock.sleeps, clock.sleeps[1:], strict=False))
    assert max(clock.sleeps, default=0) <= grid.max_wait


def test_replies_ready_at_once_cost_one_pull_and_no_wait() -> None:
    clock = Clock()
    grid, _ = prompt(clock, [0.0, 0.0])
    assert len(list(grid.send_and_receive(messages(2)))) == 2
    assert grid.pulls == 1 and clock.now == 0.0


def test_the_timeout_ends_the_wait_with_the_replies_that_came() -> None:
    clock = Clock()
    grid, _ = prompt(clock, [0.2, math.inf, 30.0])
    replies = list(grid.send_and_receive(messages(3), timeout=10.0))
    assert [r.metadata.reply_to_message_id for r in replies] == ["m0"]
    assert clock.now == pytest.approx(10.0)  # not a wait beyond the deadline


def test_what_the_view_does_not_change_is_the_parents() -> None:
    clock = Clock()
    grid, parent = prompt(clock, [])
    grid.set_run("run 7")
    assert grid.run == "run 7" == parent.run
    assert list(grid.get_node_ids()) == [1, 2, 3]
    assert list(grid.get_nodes()) == ["node info"]
    assert grid.pull_interval == 0.1
    assert grid.create_message().metadata.dst_node_id == 1
    assert list(grid.send_and_receive([])) == [] and grid.pulls == 0


@pytest.mark.parametrize(
    ("option", "value"),
    [("first_wait", 0.0), ("share", 0.0), ("share", 1.5), ("max_wait", 0.001)],
)
def test_bad_waits_are_refused_by_name(option: str, value: float) -> None:
    with pytest.raises(ValueError, match=option):
        PromptGrid(TimedGrid(Clock(), []), **{option: value})


class PollingGrid(InProcessGrid):
    """Replies at once, and a fixed cadence of its own, as Flower's simulation grid."""

    pull_interval = 0.1


def test_the_app_pulls_a_polling_grid_promptly_and_runs_the_same(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from apps.client_app import app as client_app
    from flwr_prox_strategies.experiment.server import run_experiment

    overrides = "strategy=scaffold num_clients=3 num_rounds=2 model=logreg"
    central = {}
    for prompt_replies in ("auto", "false"):
        out = tmp_path / prompt_replies
        run_config = {
            "overrides": f"{overrides} prompt_replies={prompt_replies}",
            "output-dir": str(out),
        }
        grid = PollingGrid(client_app, num_nodes=3, run_config=run_config)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="flwr"):
            run_experiment(grid, run_config)
        said = "Replies are pulled as they arrive" in caplog.text
        assert said == (prompt_replies == "auto")
        assert "0.005 to 0.1 s" in caplog.text or prompt_replies == "false"
        rounds = json.loads((out / "results.json").read_text())["rounds"]
        central[prompt_replies] = [r["central"] for r in rounds]
    assert central["auto"] == central["false"]
    run_config = {
        "overrides": f"{overrides} prompt_replies=3",
        "output-dir": str(tmp_path / "refused"),
    }
    with pytest.raises(ValueError, match="prompt_replies must be auto, true or false"):
        run_experiment(
            InProcessGrid(client_app, num_nodes=3, run_config=run_config), run_config
        )
    assert not (tmp_path / "refused").exists()


def test_only_a_grid_with_a_fixed_cadence_is_wrapped() -> None:
    from omegaconf import OmegaConf

    from flwr_prox_strategies.experiment.build import rounds_grid

    auto, on, off = (
        OmegaConf.create({"prompt_replies": v}) for v in ("auto", True, False)
    )
    polling = PollingGrid(lambda message, context: message, num_nodes=1)
    for setting in (auto, on):
        view = rounds_grid(polling, setting)
        assert isinstance(view, PromptGrid)
        assert view.max_wait == polling.pull_interval
    assert rounds_grid(polling, off) is polling
    # Replies at once (the in-process engine), or a deployment's HttpGrid,
    # whose SuperNodes' own 3 s polling sets the pace: as they are, unless true.
    instant = InProcessGrid(lambda message, context: message, num_nodes=1)
    assert rounds_grid(instant, auto) is instant
    view = rounds_grid(instant, on)
    assert isinstance(view, PromptGrid) and view.max_wait == 3.0
    polling.pull_interval = 0.001  # already as prompt as the view would be
    assert rounds_grid(polling, auto) is polling

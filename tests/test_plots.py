"""The plots a user looks at: whole rounds on round axes, nothing <= 0 on a log axis.

Every plot is drawn from a small hand-made results document (no run), so these
tests take a second: ``metrics.png`` and ``privacy.png`` (a run), ``comparison.png``
(a sweep), ``pfedavg-deploy.png`` (the P-FedAvg launcher) and the topology tool's
``speedup.png``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from flwr_prox_strategies.experiment import results as results_module
from flwr_prox_strategies.experiment.results import (
    plot_log,
    plot_run,
    positive_points,
)
from flwr_prox_strategies.experiment.sweeps.sweep import plot_comparison
from flwr_prox_strategies.pfedavg_deploy.launcher import plot_deploy


@pytest.fixture
def kept_figures(monkeypatch) -> Iterator[list[Any]]:
    """The figures the plot functions close, kept for inspection."""
    kept: list[Any] = []

    class Keep:
        def __getattr__(self, name: str) -> Any:
            return getattr(plt, name)

        def close(self, fig: Any) -> None:
            kept.append(fig)

    monkeypatch.setattr(results_module, "pyplot", lambda: Keep())
    yield kept
    for fig in kept:
        plt.close(fig)


def assert_whole_rounds(ax: Any, axis: str = "x") -> None:
    """The axis ticks whole numbers only, and says so with an integer locator."""
    locator = getattr(ax, f"{axis}axis").get_major_locator()
    assert isinstance(locator, MaxNLocator) and locator._integer  # type: ignore[attr-defined]
    ax.figure.canvas.draw()
    ticks = getattr(ax, f"get_{axis}ticks")()
    assert len(ticks) > 1 and np.all(ticks == np.round(ticks)), ticks


def run_results(rounds: int = 3) -> dict[str, Any]:
    """A run of a few rounds (a default locator would tick 1.25, 1.5, ...)."""
    return {
        "strategy": "FedProx",
        "dataset": "digits",
        "rounds": [
            {
                "round": r,
                "central": {"accuracy": 0.5 + 0.1 * r, "loss": 1.0 / (r + 1)},
                "train": {
                    "train-loss": 1.2 / (r + 1),
                    "dp-epsilon-total-max": 0.5 * r,
                    "dp-epsilon-total-mean": 0.4 * r,
                },
            }
            for r in range(1, rounds + 1)
        ],
    }


def test_positive_points_drops_zeros_negatives_and_unknowns() -> None:
    xs, ys, zeros = positive_points(
        [1, 2, 3, 4, 5, 6], [0.5, 0.0, None, float("nan"), -1e-18, 2e-3]
    )
    assert (xs, ys, zeros) == ([1, 6], [0.5, 2e-3], [2, 5])


@pytest.mark.parametrize(
    ("values", "note"),
    [
        ([1e-2, 1e-3, 0.0, 0.0], "0 from round 3"),
        ([4.6e-17, 0.0, 0.0, 0.0], "0 from round 2"),
        ([1e-2, 0.0, 1e-4, 1e-5], "0 at round 2"),
        ([0.0, 0.0, 0.0, 0.0], "0 from round 1"),
    ],
)
def test_a_series_with_zeros_on_a_log_axis_drops_them_without_a_warning(
    values: list[float], note: str
) -> None:
    fig, ax = plt.subplots()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # any matplotlib warning fails the test
            zeros = plot_log(ax, [1, 2, 3, 4], values, "k.-", label="distance")
            ax.legend()
            fig.canvas.draw()
        assert ax.get_yscale() == "log"
        (line,) = ax.get_lines()
        assert np.all(np.asarray(line.get_ydata()) > 0)
        assert len(np.asarray(line.get_xdata())) == 4 - len(zeros)
        assert line.get_label() == f"distance ({note})"
    finally:
        plt.close(fig)


@pytest.mark.parametrize("rounds", [1, 3, 30])
def test_metrics_and_privacy_plots_tick_whole_rounds(
    tmp_path: Path, kept_figures: list[Any], rounds: int
) -> None:
    paths = plot_run(run_results(rounds), tmp_path)
    assert [p.name for p in paths] == ["metrics.png", "privacy.png"]
    metrics, privacy = kept_figures
    for ax in metrics.axes:
        assert_whole_rounds(ax)
    _, epsilon_per_round = privacy.axes
    assert_whole_rounds(epsilon_per_round)


def test_the_sweep_comparison_ticks_whole_rounds_and_names_what_differs() -> None:
    def curve(top: float) -> dict[int, float]:
        return {r: top * r / 3 for r in range(4)}

    shared = {"+experiment": "fedprox-stragglers", "partition": "pathological"}
    jobs = [
        ({**shared, "strategy": s, "strategy.drop_percent": d}, curve(top + seed))
        for s, d, top in (
            ("fedavg", "0", 0.9),
            ("fedavg", "0.9", 0.6),
            ("fedprox", "0", 0.9),
            ("fedprox", "0.9", 0.85),
        )
        for seed in (0.0, 0.01)
    ]
    jobs.append(
        ({**shared, "strategy": "fedavg", "strategy.drop_percent": "0.5"}, curve(0.9))
    )
    jobs.append(
        ({**shared, "strategy": "fedavg", "strategy.drop_percent": "0.5"}, curve(0.91))
    )
    fig = plot_comparison(jobs, title="sweep x")
    try:
        (ax,) = fig.axes
        assert_whole_rounds(ax)
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert set(lines) == {
            "fedavg, drop_percent=0 (2 seeds)",
            "fedavg, drop_percent=0.9 (2 seeds)",
            "fedprox, drop_percent=0 (same as fedavg, drop_percent=0) (2 seeds)",
            "fedprox, drop_percent=0.9 (2 seeds)",
            "fedavg, drop_percent=0.5 (same as fedavg, drop_percent=0) (2 seeds)",
        }
        # One colour per strategy, one line style per straggler setting.
        by = {label.split(" (")[0]: line for label, line in lines.items()}
        avg0, avg9 = by["fedavg, drop_percent=0"], by["fedavg, drop_percent=0.9"]
        prox0, prox9 = by["fedprox, drop_percent=0"], by["fedprox, drop_percent=0.9"]
        assert avg0.get_color() == avg9.get_color()
        assert avg0.get_color() != prox0.get_color()
        assert prox0.get_linestyle() == avg0.get_linestyle()
        assert prox0.get_linestyle() != prox9.get_linestyle()
        # The first colour's lines are wider: drawn over, they show as an outline.
        assert avg0.get_linewidth() > prox0.get_linewidth()
        # What every job shares is in the title, not repeated in the legend.
        assert "+experiment=fedprox-stragglers partition=pathological" in ax.get_title()
    finally:
        plt.close(fig)


def deploy_results(distances: list[float | None]) -> dict[str, Any]:
    return {
        "servers": 4,
        "clients-per-server": 1,
        "topology": "ring",
        "mixing": "metropolis",
        "rounds": [
            {"round": r, "accuracy": [0.8, 0.7, None, 0.75], "consensus-distance": d}
            for r, d in enumerate(distances, start=1)
        ],
    }


@pytest.mark.parametrize(
    ("distances", "shown", "note"),
    [
        ([0.3, 0.05, 0.01], 3, None),
        ([4.6e-17, 0.0, 0.0], 1, "0 from round 2"),  # a complete graph's float noise
        ([0.3, None, 0.01], 2, None),  # a round without every server's model
    ],
)
def test_the_p_fedavg_deploy_plot_has_whole_rounds_and_no_zero_on_its_log_axis(
    tmp_path: Path,
    kept_figures: list[Any],
    distances: list[float | None],
    shown: int,
    note: str | None,
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = plot_deploy(deploy_results(distances), tmp_path / "pfedavg-deploy.png")
    assert path is not None and path.stat().st_size > 5_000
    (fig,) = kept_figures
    accuracy, distance = fig.axes
    for ax in (accuracy, distance):
        assert_whole_rounds(ax)
    assert distance.get_yscale() == "log"
    (line,) = distance.get_lines()
    assert len(line.get_ydata()) == shown
    assert np.all(np.asarray(line.get_ydata()) > 0)
    label = line.get_label()
    assert (note in label) if note else ("0 " not in label)


def test_the_topology_speed_up_curve_ticks_whole_client_counts(
    tmp_path: Path, monkeypatch
) -> None:
    from matplotlib.figure import Figure

    from flwr_prox_strategies.topology.__main__ import plot_speedup

    saved: list[Any] = []
    original = Figure.savefig

    def keep(self: Any, *args: Any, **kwargs: Any) -> None:
        saved.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    clients = np.array([3, 4, 5, 6])
    plot_speedup(str(tmp_path / "s.png"), clients, clients / 2.0, 3, "ring")
    (fig,) = saved
    assert_whole_rounds(fig.axes[0])

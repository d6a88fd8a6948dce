"""Results files and plots: what a user looks at before reading anything."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..core.contract.ledger import PER_CLIENT_LIMIT
from ..ops.checks import check_fraction

RESULTS_FILE = "results.json"
# Beyond PER_CLIENT_LIMIT clients, where every client's partition size goes.
PARTITION_SIZES_FILE = "partition-sizes.json"


def pyplot() -> Any:
    """Return ``matplotlib.pyplot`` on the file-only backend, imported on first use.

    (Every ClientApp process imports this module through the app; only the
    ServerApp draws, so the clients do not pay for matplotlib.)
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    return plt


def integer_rounds(ax: Any, axis: str = "x") -> None:
    """Put ticks on whole numbers only on ``ax``'s ``axis`` (rounds, clients).

    An axis spanning less than 2 (one round drawn) is widened to 2 around its
    centre: a narrower one holds a single whole number and matplotlib would fall
    back to fractional ticks.
    """
    from matplotlib.ticker import MaxNLocator

    getattr(ax, f"{axis}axis").set_major_locator(MaxNLocator(integer=True))
    low, high = getattr(ax, f"get_{axis}lim")()
    if abs(high - low) < 2:
        centre = round((low + high) / 2)
        getattr(ax, f"set_{axis}lim")(centre - 1, centre + 1)


def positive_points(
    xs: Sequence[Any], ys: Sequence[Any]
) -> tuple[list[Any], list[float], list[Any]]:
    """Split a series for a log axis: the points with ``y > 0``, and where ``y == 0``.

    Returns ``(xs, ys, zero_xs)``: the points a log axis can show, and the x of the
    points whose value is exactly zero or negative (a log axis has no place for them:
    draw them as a note, never as a fake tiny value). ``None`` and NaN are left out
    of both (unknown, not zero).
    """
    keep_x, keep_y, zeros = [], [], []
    for x, y in zip(xs, ys, strict=True):
        if y is None or not math.isfinite(float(y)):
            continue
        if float(y) > 0:
            keep_x.append(x)
            keep_y.append(float(y))
        else:
            zeros.append(x)
    return keep_x, keep_y, zeros


def plot_log(
    ax: Any, xs: Sequence[Any], ys: Sequence[Any], *args: Any, **kwargs: Any
) -> list[Any]:
    """Plot ``ys`` against ``xs`` on a log y axis, leaving out values ``<= 0``.

    A ``label`` (or, without one, the axis title) gets ``"(0 at round k)"`` /
    ``"(0 from round k)"`` for the left-out points, so a zero stays visible as a
    fact instead of a gap or a warning. Returns the x of the left-out points.
    """
    keep_x, keep_y, zeros = positive_points(xs, ys)
    ax.set_yscale("log")
    note = _zero_note(zeros, xs)
    if note:
        if "label" in kwargs:
            kwargs["label"] = f"{kwargs['label']} ({note})"
        else:
            ax.set_title(f"{ax.get_title()} ({note})".strip())
    if keep_x:
        ax.plot(keep_x, keep_y, *args, **kwargs)
    elif note:  # nothing above zero: an empty, labelled line for the legend
        ax.plot([], [], *args, **kwargs)
    return zeros


def _zero_note(zeros: Sequence[Any], xs: Sequence[Any]) -> str:
    """``"0 from round k"`` when every point from k on is <= 0, else the rounds."""
    if not zeros:
        return ""
    tail = list(xs)[list(xs).index(zeros[0]) :]
    if list(zeros) == tail and len(zeros) > 1:
        return f"0 from round {zeros[0]}"
    if len(zeros) == 1:
        return f"0 at round {zeros[0]}"
    return "0 at rounds " + ", ".join(str(z) for z in zeros)


def _clean(value: Any, *, keep_non_finite: bool = False) -> Any:
    """JSON-ready copy: records become dicts, numpy scalars Python numbers.

    NaN and infinities become None (``results.json`` is read by any JSON
    reader), or with ``keep_non_finite`` stay (JSON's ``NaN``/``Infinity``,
    which :func:`json.loads` reads back: a checkpoint keeps every value).
    """
    if isinstance(value, Mapping):
        return {
            str(k): _clean(v, keep_non_finite=keep_non_finite) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_clean(v, keep_non_finite=keep_non_finite) for v in value]
    if isinstance(value, float):
        return value if keep_non_finite or math.isfinite(value) else None
    if hasattr(value, "item"):
        return _clean(value.item(), keep_non_finite=keep_non_finite)
    return value


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write JSON atomically (a reader never sees a half-written file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_clean(data), indent=2))
    os.replace(tmp, path)


def sizes_entry(sizes: list[int], output_dir: Path) -> dict[str, Any]:
    """Return the partition sizes for ``results.json``: all, or a summary.

    ``results.json`` is rewritten as rounds end, so beyond
    :data:`~..core.privacy.PER_CLIENT_LIMIT` clients it keeps the min, mean and
    max, and every client's size goes once to ``partition-sizes.json``.
    """
    if len(sizes) <= PER_CLIENT_LIMIT:
        return {"partition-sizes": sizes}
    output_dir.mkdir(parents=True, exist_ok=True)
    write_json(output_dir / PARTITION_SIZES_FILE, {"partition-sizes": sizes})
    return {
        "partition-size": {
            "min": min(sizes),
            "mean": sum(sizes) / len(sizes),
            "max": max(sizes),
            "file": PARTITION_SIZES_FILE,
        }
    }


#: A run's summary figures a search can optimise, and which way is better.
OBJECTIVES = {
    "final-accuracy": "maximize",
    "best-accuracy": "maximize",
    "rounds-to-target": "minimize",
    "final-loss": "minimize",
}


def summarise(rounds: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """Final/best central accuracy, final loss, the first round reaching ``target``.

    ``rounds-evaluated`` counts the rounds with a central accuracy.
    """
    accs = [
        (r["round"], r["central"]["accuracy"])
        for r in rounds
        if r.get("central") and r["central"].get("accuracy") is not None
    ]
    if not accs:
        return {**dict.fromkeys(OBJECTIVES), "rounds-evaluated": 0}
    reached = [rnd for rnd, acc in accs if acc >= target]
    losses = [r["central"]["loss"] for r in rounds if "loss" in r.get("central", {})]
    return {
        "final-accuracy": accs[-1][1],
        "best-accuracy": max(acc for _, acc in accs),
        "rounds-to-target": reached[0] if reached else None,
        "final-loss": losses[-1] if losses else None,
        "rounds-evaluated": len(accs),
        "target-accuracy": target,
        **summarise_clients(rounds),
        **summarise_privacy(rounds),
    }


# Federated-evaluation figures summarised per run: (results key, metric).
CLIENT_SUMMARY = {
    "final-personal-accuracy-mean": "personal-accuracy-clients-mean",
    "final-personal-accuracy-worst": "personal-accuracy-worst",
    "final-global-accuracy-on-clients-mean": "accuracy-clients-mean",
    "final-global-accuracy-on-clients-worst": "accuracy-worst",
}


def summarise_privacy(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Privacy spent by the end: the largest and the mean per-client epsilon."""
    spent = [r["train"] for r in rounds if "dp-epsilon-total-max" in r.get("train", {})]
    if not spent:
        return {}
    last = spent[-1]
    return {
        "final-epsilon-max": last["dp-epsilon-total-max"],
        "final-epsilon-mean": last["dp-epsilon-total-mean"],
        "delta": last.get("dp-delta"),
    }


def summarise_clients(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Last federated evaluation: personalised and global accuracy over clients."""
    evaluated = [r["evaluate"] for r in rounds if r.get("evaluate")]
    if not evaluated:
        return {}
    last = evaluated[-1]
    return {name: last[key] for name, key in CLIENT_SUMMARY.items() if key in last}


class RunRecorder:
    """Collects per-round metrics and keeps ``results.json`` current.

    The file is rewritten as rounds end (:meth:`end_round`), so a long or
    interrupted run can be inspected while it goes: after every round while
    writing it takes at most ``write_share`` of the run's time, and as often
    as that allows once it grows (each write holds every round so far, so
    writing after every round would cost a run of R rounds R^2/2 rounds'
    worth of writing). :meth:`flush` always writes: the run's end, a failure
    and a resume call it. A round's ``elapsed-s`` is the time at which it
    ended, counted from the start of the run (a resumed run goes on from the
    time its checkpoint recorded).

    Parameters
    ----------
    output_dir : Path
        Where ``results.json`` goes (created if missing).
    meta : Mapping[str, Any]
        The document's top-level entries (strategy, dataset, config, ...).
    target : float
        The accuracy the summary's ``rounds-to-target`` counts to.
    write_share : float, default 0.02
        The largest share of the run's time that rewriting the file after a
        round may take, in [0, 1]: a write that took ``w`` seconds is followed
        by the next one no sooner than ``w * (1 - write_share) / write_share``
        seconds later. 1 writes after every round; 0 only when :meth:`flush`
        is called.
    clock : Callable[[], float], default time.monotonic
        The run's clock, in seconds (a benchmark's or a test's own).

    Raises
    ------
    ValueError
        If ``write_share`` is not in [0, 1].
    """

    def __init__(
        self,
        output_dir: Path,
        *,
        meta: Mapping[str, Any],
        target: float,
        write_share: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.output_dir = output_dir
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.meta = dict(meta)
        self.target = target
        self.write_share = check_fraction("write_share", write_share)
        self.clock = clock
        self.start = clock()
        self.elapsed_before = 0.0  # run time before a resume
        self.rounds: dict[int, dict[str, Any]] = {}
        self.complete = False  # set when the last round's results are in
        self.writes = 0  # times results.json was written
        # Each ended round's entry as JSON text, made once: a checkpoint holds
        # every round, and encoding them all again each round grows with the run.
        self._round_text: dict[int, str] = {}
        self._written_at: float | None = None  # the clock when the last write ended
        self._write_s = 0.0  # how long the last write took

    def elapsed(self) -> float:
        """Return the run's time so far (before a resume included)."""
        return self.elapsed_before + self.clock() - self.start

    def record(
        self, server_round: int, section: str, metrics: Mapping[str, Any]
    ) -> None:
        """Store ``metrics`` of ``section`` (central, train, evaluate) for a round."""
        entry = self.rounds.setdefault(server_round, {"round": server_round})
        entry[section] = dict(metrics)
        self._round_text.pop(server_round, None)

    def end_round(self, server_round: int) -> bool:
        """Stamp the round's ``elapsed-s``; rewrite the file if it is due.

        Returns
        -------
        bool
            Whether ``results.json`` was rewritten (:meth:`write_due`).
        """
        entry = self.rounds.get(server_round)
        if entry is not None:
            entry["elapsed-s"] = self.elapsed()
            self._round_text.pop(server_round, None)
        if not self.write_due():
            return False
        self.flush()
        return True

    def write_due(self) -> bool:
        """Whether rewriting the file now keeps writing within ``write_share``."""
        if self.write_share == 0.0:
            return False
        if self._written_at is None:
            return True
        since = self.clock() - self._written_at
        return self._write_s * (1.0 - self.write_share) <= self.write_share * since

    def state(self) -> dict[str, Any]:
        """Return what a checkpoint keeps: meta, rounds so far, time so far.

        The rounds are one JSON text (``rounds-json``, UTF-8 bytes as a uint8
        array) joined from each round's text, encoded once when the round has
        ended: a checkpoint then costs the bytes of the rounds so far, not
        their encoding. Every value is kept (NaN and infinities included);
        numpy scalars come back as the Python numbers they equal.
        """
        texts = []
        for rnd in sorted(self.rounds):
            text = self._round_text.get(rnd)
            if text is None:
                text = self._round_text[rnd] = json.dumps(
                    _clean(self.rounds[rnd], keep_non_finite=True)
                )
            texts.append(text)
        encoded = ("[" + ",".join(texts) + "]").encode()
        return {
            "meta": dict(self.meta),
            "rounds-json": np.frombuffer(encoded, dtype=np.uint8),
            "elapsed-s": self.elapsed(),
        }

    def restore(self, state: Mapping[str, Any], up_to: int) -> None:
        """Take back a checkpoint's :meth:`state`, rounds after ``up_to`` dropped.

        The meta given to the constructor wins over the saved one (the resumed
        run's ``num-rounds``, say); saved keys it lacks are kept.
        """
        self.meta = {**dict(state.get("meta", {})), **self.meta}
        if "rounds-json" in state:
            text = np.asarray(state["rounds-json"], dtype=np.uint8).tobytes()
            saved = json.loads(text.decode())
        else:  # a checkpoint written before the rounds were kept as text
            saved = state.get("rounds", [])
        self.rounds = {
            int(entry["round"]): dict(entry)
            for entry in saved
            if int(entry["round"]) <= up_to
        }
        self._round_text = {}
        self.elapsed_before = float(state.get("elapsed-s", 0.0))
        self.start = self.clock()

    def as_dict(self) -> dict[str, Any]:
        """Return the whole results document."""
        rounds = [self.rounds[r] for r in sorted(self.rounds)]
        return {
            **self.meta,
            "rounds": rounds,
            "summary": {
                **summarise(rounds, self.target),
                "wall-time-s": self.elapsed(),
                "complete": self.complete,
            },
        }

    def flush(self) -> Path:
        """Rewrite ``results.json``; return its path."""
        path = self.output_dir / RESULTS_FILE
        started = self.clock()
        write_json(path, self.as_dict())
        self._written_at = self.clock()
        self._write_s = self._written_at - started
        self.writes += 1
        return path


def plot_run(results: Mapping[str, Any], output_dir: Path) -> list[Path]:
    """Accuracy and loss per round (central evaluation, clients' train loss)."""
    rounds = results["rounds"]
    paths = []
    plt = pyplot()
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(10, 4))
    series = {
        "central accuracy": ("central", "accuracy", ax_acc),
        "all clients' mean (FedDyn)": ("central-all-clients", "accuracy", ax_acc),
        "weighted average (APFL)": ("central-average", "accuracy", ax_acc),
        "federated accuracy": ("evaluate", "accuracy", ax_acc),
        "personalised, clients' mean": (
            "evaluate",
            "personal-accuracy-clients-mean",
            ax_acc,
        ),
        "personalised, worst client": ("evaluate", "personal-accuracy-worst", ax_acc),
        "personalised weighted average (APFL), mean": (
            "evaluate",
            "personal-avg-accuracy-clients-mean",
            ax_acc,
        ),
        "global on clients' splits, worst": ("evaluate", "accuracy-worst", ax_acc),
        "central loss": ("central", "loss", ax_loss),
        "training loss (global model)": ("central-train", "loss", ax_loss),
        "clients' train loss": ("train", "train-loss", ax_loss),
    }
    for label, (section, key, ax) in series.items():
        points = [
            (r["round"], r[section][key])
            for r in rounds
            if section in r and r[section].get(key) is not None
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker=".", label=label)
    servers = sorted(
        {key for r in rounds for key in r if key.startswith("server-")},
        key=lambda name: int(name.split("-")[1]),
    )
    for name in servers:  # P-FedAvg: every server's own model
        points = [(r["round"], r[name]["accuracy"]) for r in rounds if name in r]
        if points:
            xs, ys = zip(*points, strict=True)
            ax_acc.plot(xs, ys, linewidth=0.8, alpha=0.6, label=name.replace("-", " "))
    title = f"{results.get('strategy', '')} on {results.get('dataset', '')}"
    ax_acc.set(xlabel="round", ylabel="accuracy", title=title)
    ax_loss.set(xlabel="round", ylabel="loss", title="loss")
    for ax in (ax_acc, ax_loss):
        ax.grid(alpha=0.3)
        integer_rounds(ax)
        if ax.has_data():
            ax.legend(fontsize=7)
    fig.tight_layout()
    path = output_dir / "metrics.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(path)
    for extra in (plot_clients(results, output_dir), plot_privacy(results, output_dir)):
        if extra is not None:
            paths.append(extra)
    return paths


def plot_privacy(results: Mapping[str, Any], output_dir: Path) -> Path | None:
    """Central accuracy against epsilon spent, and epsilon per round."""
    points = [
        (
            r["round"],
            r["train"]["dp-epsilon-total-max"],
            r["train"]["dp-epsilon-total-mean"],
            (r.get("central") or {}).get("accuracy"),
        )
        for r in results["rounds"]
        if "dp-epsilon-total-max" in r.get("train", {})
    ]
    if not points:
        return None
    rounds, eps_max, eps_mean, accuracy = zip(*points, strict=True)
    plt = pyplot()
    fig, (ax_acc, ax_eps) = plt.subplots(1, 2, figsize=(10, 4))
    if any(a is not None for a in accuracy):
        ax_acc.plot(eps_max, accuracy, marker=".")
    ax_acc.set(
        xlabel="epsilon (largest over clients)",
        ylabel="central accuracy",
        title="accuracy against privacy spent",
    )
    ax_eps.plot(rounds, eps_max, marker=".", label="largest client")
    ax_eps.plot(rounds, eps_mean, marker=".", label="mean over clients")
    ax_eps.set(xlabel="round", ylabel="epsilon", title="epsilon spent")
    integer_rounds(ax_eps)
    for ax in (ax_acc, ax_eps):
        ax.grid(alpha=0.3)
    ax_eps.legend(fontsize=7)
    fig.tight_layout()
    path = output_dir / "privacy.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_clients(results: Mapping[str, Any], output_dir: Path) -> Path | None:
    """Per-client accuracy at the last federated evaluation: global vs personal."""
    evaluated = [r for r in results["rounds"] if r.get("evaluate")]
    if not evaluated:
        return None
    last = evaluated[-1]["evaluate"]
    keys = last.get("eval-client-keys")
    bars = {
        label: last[key]
        for label, key in (
            ("global model", "accuracy-per-client"),
            ("personalised", "personal-accuracy-per-client"),
        )
        if key in last
    }
    if not keys or not bars:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(keys) + 2), 4))
    width = 0.8 / len(bars)
    for i, (label, values) in enumerate(bars.items()):
        xs = [j + i * width for j in range(len(keys))]
        ys = [v if v is not None else 0.0 for v in values]
        ax.bar(xs, ys, width=width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))])
    ax.set_xticklabels([str(int(k)) for k in keys], fontsize=7)
    ax.set(
        xlabel="client",
        ylabel="accuracy on its held-out split",
        title=f"round {evaluated[-1]['round']}: every client",
        ylim=(0, 1),
    )
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path = output_dir / "clients.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

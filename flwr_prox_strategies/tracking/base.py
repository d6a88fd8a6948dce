"""The tracker interface, the background worker, and what a round logs.

A :class:`Tracker` is one run in an experiment tracker (TensorBoard, MLflow,
Weights & Biases). :class:`InBackground` runs any tracker on a thread of its
own, so a slow backend never holds up a round: calls are queued, the backend
is opened (imported, its run created) on that thread, and :meth:`~Tracker.close`
flushes the queue. :func:`round_metrics` and :func:`flat_params` turn a round of
``results.json`` and a resolved configuration into what every backend logs.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.common.logger import log

from .._optional import require_installed


class Tracker:
    """One run of an experiment tracker; subclasses talk to one library.

    Every method but :meth:`where` may be slow (a library imported, a file
    written, a server called): wrap a tracker in :class:`InBackground` to keep
    them off the round's path. A tracker is used in this order: :meth:`open`,
    then any number of :meth:`log_params`, :meth:`log_metrics` and
    :meth:`log_artifacts`, then :meth:`close`.
    """

    #: The backend's name, for messages (``"mlflow"``).
    name = "tracker"
    #: The module the backend imports and the pack's extra that installs it
    #: (``("mlflow", "mlflow")``); None: nothing to install.
    requires: tuple[str, str] | None = None

    def open(self) -> None:
        """Import the library and start the run (the default does nothing)."""

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Record the run's parameters (a flat mapping, see :func:`flat_params`).

        Parameters
        ----------
        params : Mapping[str, Any]
            Parameter names (dotted paths) and their values.
        """
        raise NotImplementedError

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record scalar metrics at ``step`` (the round).

        Parameters
        ----------
        metrics : Mapping[str, float]
            Metric names (``"central/accuracy"``) and their values.
        step : int
            The round they belong to.
        """
        raise NotImplementedError

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        """Attach files to the run (``results.json``, plots, the checkpoint).

        Parameters
        ----------
        paths : Sequence[Path]
            Files to attach; missing ones are skipped.
        """
        raise NotImplementedError

    def close(self, *, failed: bool = False) -> None:
        """End the run, marked failed when ``failed``; write what is buffered.

        Parameters
        ----------
        failed : bool (default: False)
            Whether the run ended in an error.
        """

    def where(self) -> str:
        """Return the shell command that opens this run's UI (``""``: none).

        Returns
        -------
        str
            A command a user can paste (``tensorboard --logdir ...``).
        """
        return ""


class InBackground(Tracker):
    """Run ``tracker`` on a thread of its own: no call waits for the backend.

    Calls are queued in order and carried out by one worker thread, which
    opens the tracker first. The first error of the backend is logged with
    Flower's logger (a warning naming the backend and what failed) and the
    tracker is dropped: tracking never fails a run. :meth:`close` waits for
    the queue to drain, at most ``close_timeout`` seconds. A backend whose
    library is not installed fails here, at once, naming the extra to install.

    Parameters
    ----------
    tracker : Tracker
        The tracker to run in the background.
    close_timeout : float (default: 300)
        Seconds :meth:`close` waits for the queued calls to be carried out.

    Raises
    ------
    ImportError
        When the backend's library is not installed, naming the extra.
    """

    def __init__(self, tracker: Tracker, *, close_timeout: float = 300) -> None:
        if tracker.requires is not None:  # here, not on the thread: fail at once
            module, extra = tracker.requires
            require_installed((module,), extra, f"Tracking with {tracker.name}")
        self.tracker = tracker
        self.name = tracker.name
        self.close_timeout = float(close_timeout)
        #: The error that stopped the backend, if one did.
        self.error: BaseException | None = None
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._worker = threading.Thread(
            target=self._work, name=f"tracker-{tracker.name}", daemon=True
        )
        self._closed = False
        self._worker.start()
        self._submit(tracker.open, "open")

    def _submit(self, call: Callable[..., None], what: str, *args: Any) -> None:
        def job() -> None:
            if self.error is None:
                try:
                    call(*args)
                except Exception as err:  # a tracker must never fail the run
                    self.error = err
                    log(
                        WARNING,
                        "Tracking with %s stopped (%s failed): %s: %s",
                        self.name,
                        what,
                        type(err).__name__,
                        err,
                    )

        if not self._closed:
            self._calls.put(job)

    def _work(self) -> None:
        while (job := self._calls.get()) is not None:
            job()

    def log_params(self, params: Mapping[str, Any]) -> None:  # noqa: D102
        self._submit(self.tracker.log_params, "log_params", dict(params))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:  # noqa: D102
        self._submit(self.tracker.log_metrics, "log_metrics", dict(metrics), step)

    def log_artifacts(self, paths: Sequence[Path]) -> None:  # noqa: D102
        self._submit(self.tracker.log_artifacts, "log_artifacts", list(paths))

    def close(self, *, failed: bool = False) -> None:
        """Queue the backend's close, then wait for the queue to drain."""
        if self._closed:
            return

        def close() -> None:
            self.tracker.close(failed=failed)

        self._submit(close, "close")
        self._closed = True
        self._calls.put(None)
        self._worker.join(self.close_timeout)
        if self._worker.is_alive():
            log(
                WARNING,
                "Tracking with %s: still writing after %.0f s; what is left is lost",
                self.name,
                self.close_timeout,
            )

    def where(self) -> str:  # noqa: D102
        return self.tracker.where()


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten a nested configuration into dotted names (``strategy.mu``).

    Lists become their text; ``None`` becomes ``"null"`` (trackers refuse it).

    Parameters
    ----------
    config : Mapping[str, Any]
        A resolved configuration (``OmegaConf.to_container(cfg, resolve=True)``).
    prefix : str (default: "")
        Prepended to every name, with a dot.

    Returns
    -------
    dict[str, Any]
        One entry per leaf.
    """
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flat_params(value, name))
        elif value is None:
            flat[name] = "null"
        elif isinstance(value, bool | int | float | str):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


#: The sections of a round of ``results.json`` that are logged, in order.
ROUND_SECTIONS = ("central", "train", "evaluate", "timing")
#: The federated evaluation's list of client keys: ``*-per-client`` lists are
#: logged per client under those keys.
CLIENT_KEYS = "eval-client-keys"


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def round_metrics(entry: Mapping[str, Any]) -> dict[str, float]:
    """Flatten one round of ``results.json`` into ``section/name`` scalars.

    Every finite number of the ``central``, ``train``, ``evaluate`` and
    ``timing`` sections, and the round's ``elapsed-s``. A federated
    evaluation's per-client lists (``personal-accuracy-per-client``) become one
    metric per client, ``evaluate/personal-accuracy-per-client/<client key>``.
    Other lists, text and non-finite values are left out.

    Parameters
    ----------
    entry : Mapping[str, Any]
        A round: ``{"round": 3, "central": {...}, "train": {...}, ...}``.

    Returns
    -------
    dict[str, float]
        The metrics to log at that round.
    """
    metrics: dict[str, float] = {}
    for section in ROUND_SECTIONS:
        values = entry.get(section) or {}
        clients = values.get(CLIENT_KEYS)
        for key, value in values.items():
            if isinstance(value, list):
                if (
                    clients
                    and key.endswith("-per-client")
                    and len(value) == len(clients)
                ):
                    for client, each in zip(clients, value, strict=True):
                        number = _number(each)
                        if number is not None:
                            metrics[f"{section}/{key}/{int(client)}"] = number
                continue
            number = _number(value)
            if number is not None:
                metrics[f"{section}/{key}"] = number
    elapsed = _number(entry.get("elapsed-s"))
    if elapsed is not None:
        metrics["elapsed-s"] = elapsed
    return metrics


def summary_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """Return the finite numbers of a run's summary as ``summary/<name>``.

    Parameters
    ----------
    summary : Mapping[str, Any]
        ``results.json``'s ``summary``.

    Returns
    -------
    dict[str, float]
        The metrics to log once, at the last round.
    """
    return {
        f"summary/{key}": number
        for key, value in summary.items()
        if (number := _number(value)) is not None
    }


__all__ = [
    "InBackground",
    "Tracker",
    "flat_params",
    "round_metrics",
    "summary_metrics",
]

"""How a run ends, and why replies or rounds were not used.

:class:`ReplyTally` counts the reasons (error texts, rejection kinds) per round
and per run; :func:`finish_run` ends ``start()``: a run that aggregated nothing
raises :class:`NoRoundAggregatedError` with them, counted, and keeps the initial
model in ``Result.arrays``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from flwr.app import ArrayRecord
from flwr.serverapp.strategy import Result

from ..contract.validation import ReplyRejected, ValidReply, client_error_text
from ..docstrings import inherit_parameters

# A reason longer than this is cut, saying by how much.
REASON_LIMIT = 600


def short_reason(text: str, limit: int = REASON_LIMIT) -> str:
    """Return an error text on one line, cut (saying by how much) past ``limit``.

    Flower's error format is unwrapped (:func:`client_error_text`); of a
    traceback only the last non-empty line is kept (the exception); whitespace
    is collapsed. A text longer than ``limit`` characters is cut at a word and
    ends with how many characters were left out, never mid-word.
    """
    text = client_error_text(text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines and lines[0].startswith("Traceback (most recent call last)"):
        lines = lines[-1:]
    text = " ".join(" ".join(lines).split())
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit)
    cut = cut if cut > limit // 2 else limit
    return f"{text[:cut]} [{len(text) - cut} more characters]"


@dataclass
class ReplyTally:
    """Why replies, or whole rounds, were not used: each reason counted.

    One tally per round (in the round's warning) and one per run (in
    :class:`NoRoundAggregatedError`, as ``err.reasons``). The strategies fill
    it; you read it.

    Parameters
    ----------
    failed : collections.Counter[str]
        Error-reply texts (one line each), counted. Default: empty.
    rejected : collections.Counter[str]
        Rejected replies, ``"kind: reason"``, counted. Default: empty.
    kept : collections.Counter[str]
        Why rounds were not aggregated, counted. Default: empty.
    nodes : set[int]
        The nodes whose replies were not used. Default: empty.
    aggregated : int (default: 0)
        Rounds aggregated.
    not_applied : collections.Counter[str]
        Replies averaged in although their client did not apply the
        algorithm's rule, counted by what the client did instead. Default:
        empty.
    not_applied_nodes : set[int]
        Their nodes. Default: empty.
    """

    failed: Counter[str] = field(default_factory=Counter)  # error-reply texts
    rejected: Counter[str] = field(default_factory=Counter)  # "kind: reason"
    kept: Counter[str] = field(default_factory=Counter)  # rounds not aggregated
    nodes: set[int] = field(default_factory=set)
    aggregated: int = 0
    not_applied: Counter[str] = field(default_factory=Counter)
    not_applied_nodes: set[int] = field(default_factory=set)

    def add_not_applied(self, replies: list[ValidReply], problem: str) -> None:
        """Count replies averaged in without the algorithm's rule, and why."""
        self.not_applied[problem] += len(replies)
        self.not_applied_nodes.update(reply.node_id for reply in replies)

    def describe_not_applied(self) -> str:
        """Say how many replies were averaged in without the rule (the run's end)."""
        total = sum(self.not_applied.values())
        nodes = sorted(self.not_applied_nodes)
        problems = "; ".join(self.not_applied)
        return (
            f"{total} repl{'y' if total == 1 else 'ies'} from {len(nodes)} node(s) "
            f"were averaged in without the algorithm's rule, as plain FedAvg "
            f"updates: {problems}. strict=True rejects such replies"
        )

    def add(self, node_id: int, err: ReplyRejected) -> None:
        """Count one reply that was not used."""
        if err.kind in ("error-reply", "no-reply"):
            reason = err.reason.removeprefix("error reply: ")
            self.failed[short_reason(reason)] += 1
        else:
            self.rejected[f"{err.kind}: {short_reason(err.reason)}"] += 1
        self.nodes.add(node_id)

    def update(self, other: ReplyTally) -> None:
        """Add another tally's reply counts (not its rounds)."""
        self.failed.update(other.failed)
        self.rejected.update(other.rejected)
        self.nodes |= other.nodes

    def describe(self, top: int = 3) -> str:
        """Say what was not used and why, most common reasons first.

        Parameters
        ----------
        top : int (default: 3)
            Reasons named per kind (failed, rejected); the rest are counted.

        Returns
        -------
        str
            One line, e.g. ``"4 replies failed: 4 x 'ValueError: ...' (from 4
            node(s): 1, 2, 3, 4)"``; ``"no reply arrived"`` when empty.
        """
        parts = []
        for label, counter in (("failed", self.failed), ("rejected", self.rejected)):
            total = sum(counter.values())
            if not total:
                continue
            common = counter.most_common(top)
            text = ", ".join(f"{n} x '{reason}'" for reason, n in common)
            if len(counter) > top:
                text += f", and {len(counter) - top} other reason(s)"
            parts.append(f"{total} repl{'y' if total == 1 else 'ies'} {label}: {text}")
        if not parts:
            return "no reply arrived"
        nodes = sorted(self.nodes)
        shown = ", ".join(map(str, nodes[:10])) + (", ..." if len(nodes) > 10 else "")
        return "; ".join(parts) + f" (from {len(nodes)} node(s): {shown})"


class AggregationStalledError(RuntimeError):
    """Rounds in a row ended without aggregating: the run stops, saying why.

    Raised by ``aggregate_train`` of the pack's strategies when
    ``max_rounds_without_aggregation`` rounds in a row (3 by default) kept the
    model because no reply was valid (or ``accept_failures=False`` refused
    the round). It is raised inside the round, so it stops any loop that calls
    the strategy (the pack's ``start()``, Flower's, or a ``start()`` of your
    own) and Flower marks the run ``finished:failed``. A run that never
    aggregated raises its subclass :class:`NoRoundAggregatedError`.

    Parameters
    ----------
    message : str
        The error message, with the counted reasons.
    result : Result
        What the run has to show: ``result.arrays`` is the last aggregated
        model (the initial model when none was).
    reasons : ~flwr_prox_strategies.extend.ReplyTally
        The counted reasons of the rounds that were not aggregated.

    Attributes
    ----------
    result : Result
        ``result.arrays`` is the last aggregated model, or the initial model.
        Raised from a round, its metric histories are empty (the loop that
        called the strategy holds them); raised at the end of the pack's
        ``start()``, they are Flower's.
    reasons : ~flwr_prox_strategies.extend.ReplyTally
        The counted reasons: ``reasons.failed`` (error-reply texts) and
        ``reasons.rejected`` (``"kind: reason"``) are ``collections.Counter``
        objects, ``reasons.nodes`` the nodes concerned, and
        ``reasons.describe()`` says it in one line.
    """

    def __init__(self, message: str, result: Result, reasons: ReplyTally) -> None:
        super().__init__(message)
        self.result = result
        self.reasons = reasons


@inherit_parameters(AggregationStalledError)
class NoRoundAggregatedError(AggregationStalledError):
    """A run ended, or stopped, without aggregating a single round.

    Raised by the pack's strategies (and by the central-DP wrappers and
    P-FedAvg around them) when a run meant to train (``num_rounds > 0``,
    ``fraction_train > 0``) aggregated no round: every reply failed, was
    rejected or never came. In any loop, ``aggregate_train`` raises it once
    ``max_rounds_without_aggregation`` rounds have passed so; at the end of
    the pack's ``start()`` (or of your loop, through
    :meth:`~flwr_prox_strategies.extend.ValidatedFedAvg.check_run`) it is
    raised whatever that option says. Flower's own strategies end such a run
    silently with an empty model. The message says, counted, why the rounds
    were kept (most common reasons first) and which nodes failed; each round's
    warning in the log says more.

    Attributes
    ----------
    result : Result
        The run's ``Result``: ``result.arrays`` is the initial model, and the
        per-round metrics are there as Flower recorded them (empty when
        raised from a round).
    reasons : ~flwr_prox_strategies.extend.ReplyTally
        The counted reasons, as :class:`AggregationStalledError`'s.
    """


class EveryClientRetiredError(RuntimeError):
    """Every connected node has spent its privacy budget: training cannot go on.

    Raised by ``configure_train`` of the round that would sample nobody, so a
    run stops instead of idling through its remaining rounds. A client retires
    when DP-SGD would take it past its ``target_epsilon`` (see
    :class:`~flwr_prox_strategies.DPSGD`); catch this around ``start()`` to
    treat a spent budget as the end of training rather than a crash, as the
    pack's ServerApp does.

    Parameters
    ----------
    message : str
        What happened, naming the round.
    result : Result
        The run's result so far (its ``arrays`` the last aggregated model).
    stopped_at : int
        The round that could not be trained.

    Attributes
    ----------
    result : Result
        ``result.arrays`` is the last aggregated model (the model that round
        would have trained); the per-round histories are in the log (and, in
        the pack's app, in results.json).
    stopped_at : int
        The round that could not be trained.
    """

    def __init__(self, message: str, result: Result, stopped_at: int) -> None:
        super().__init__(message)
        self.result = result
        self.stopped_at = stopped_at


def finish_run(
    owner: str,
    result: Result,
    initial_arrays: ArrayRecord,
    num_rounds: int,
    tally: ReplyTally,
    *,
    trains: bool = True,
) -> Result:
    """End ``start()``: keep the initial model if none was aggregated, and fail loudly.

    ``result.arrays`` becomes ``initial_arrays`` when no round was aggregated
    (Flower leaves it empty); then, if the run was meant to train (``trains``
    and ``num_rounds > 0``), :class:`NoRoundAggregatedError` is raised.
    """
    if tally.aggregated == 0:
        result.arrays = initial_arrays
        if trains and num_rounds > 0:
            kept = ", ".join(f"{n} x {why}" for why, n in tally.kept.most_common(3))
            raise NoRoundAggregatedError(
                f"{owner}: no round aggregated: {num_rounds} round(s), 0 "
                f"aggregated{f' ({kept})' if kept else ''}; {tally.describe()}. "
                "Result.arrays holds the initial model; each round's warning in "
                "the log says why that round was not aggregated.",
                result,
                tally,
            )
    return result


class StallGuard:
    """Counts the rounds in a row not aggregated; stops the run after too many.

    ``limit`` is the strategy's ``max_rounds_without_aggregation`` (None: never).
    A stall in the run's known final round (``final_round``, set by the pack's
    ``start()``) is left to the end-of-run check, which raises with Flower's
    whole ``Result``.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start counting afresh (a new run)."""
        self.stalled = 0
        self.tally = ReplyTally()
        self.final_round: int | None = None

    def aggregated(self) -> None:
        """Start the count again: a round was aggregated."""
        self.stalled = 0
        self.tally = ReplyTally()

    def kept(
        self,
        server_round: int,
        why: str,
        *,
        round_tally: ReplyTally,
        never_aggregated: bool,
        limit: int | None,
        owner: str,
        model: Callable[[bool], ArrayRecord | None],
    ) -> None:
        """Count a round not aggregated; raise after ``limit`` in a row.

        ``model(never_aggregated)`` is the model the error carries: the run's
        initial model, or the last aggregated one.
        """
        self.stalled += 1
        self.tally.update(round_tally)
        self.tally.kept[why] += 1
        if limit is None or self.stalled < limit or server_round == self.final_round:
            return
        first = server_round - self.stalled + 1
        error = NoRoundAggregatedError if never_aggregated else AggregationStalledError
        which = "the initial model" if never_aggregated else "the last aggregated model"
        raise error(
            f"{owner}: no round aggregated in {self.stalled} rounds in a row "
            f"(rounds {first}-{server_round}, max_rounds_without_aggregation="
            f"{limit}): {self.tally.describe()}. The run stops here; "
            f"err.result.arrays holds {which}. Fix the cause above, or set "
            "max_rounds_without_aggregation=None to let such a run go on.",
            Result(arrays=model(never_aggregated) or ArrayRecord()),
            self.tally,
        )

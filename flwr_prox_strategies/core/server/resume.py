"""A strategy's run: its beginning and end, and the checkpoint that resumes it.

:class:`RunState` gives the base strategy ``begin_run``/``check_run`` (a run that
aggregated nothing fails loudly, :func:`.outcome.finish_run`) and
``state_dict``/``load_state_dict``: what a checkpoint holds, how a restored run
continues and which checkpoints are refused: ``docs/howto/resume.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from logging import WARNING
from typing import TYPE_CHECKING, Any, ClassVar

from flwr.app import ArrayRecord
from flwr.common.logger import log
from flwr.serverapp.strategy import Result

from ..contract.fields import check_settings, load_fields, save_fields
from .commit import ClientBook
from .evaluation import Evaluation
from .outcome import ReplyTally, StallGuard, finish_run
from .population import Population

if TYPE_CHECKING:
    from ..contract.validation import ValidReply
    from .screening import ReplyScreen


@dataclass(frozen=True)
class Restored:
    """What a checkpoint gives back besides the parts it restores in place."""

    rounds_completed: int
    epsilon_totals: dict[int, float]
    retired_nodes: set[int]


def checkpoint(
    *,
    strategy: str,
    seed: int,
    rounds_completed: int,
    population: Population,
    epsilon_totals: Mapping[int, float],
    retired_nodes: set[int],
    book: ClientBook,
    fields: Mapping[str, Any],
) -> dict[str, Any]:
    """Return what :func:`restore` needs to resume the run (``fields``: declared)."""
    return {
        "strategy": strategy,
        "seed": seed,
        "rounds-completed": rounds_completed,
        "num-clients": population.size,
        "epsilon-totals": dict(epsilon_totals),
        "retired-nodes": sorted(retired_nodes),
        "num-clients-source": population.source,
        **book.state_dict(),
        **fields,
    }


def restore(
    state: Mapping[str, Any],
    *,
    strategy: str,
    seed: int,
    population: Population,
    book: ClientBook,
    check_settings: Callable[[Mapping[str, Any]], None],
) -> Restored:
    """Restore ``population`` and ``book`` from :func:`checkpoint`'s, or refuse it.

    ``check_settings(state)`` refuses a checkpoint made under other resume
    settings (after the strategy's name, before N and the seed).
    """
    if state.get("strategy") != strategy:
        raise ValueError(f"checkpoint is for {state.get('strategy')!r}, not {strategy}")
    check_settings(state)
    saved_k = population.restore(state)
    for key, mine, saved in (
        ("seed", seed, state.get("seed")),
        ("num-clients", population.size, saved_k),
    ):
        if saved != mine:
            raise ValueError(
                f"checkpoint was made with {key}={saved!r}, the strategy "
                f"has {mine!r}: the run would not resume identically"
            )
    book.load_state_dict(state)
    return Restored(
        rounds_completed=int(state["rounds-completed"]),
        epsilon_totals={
            int(k): float(v) for k, v in state.get("epsilon-totals", {}).items()
        },
        retired_nodes={int(n) for n in state.get("retired-nodes", [])},
    )


class RunState:
    """A strategy's run: begun, checked at its end, checkpointed, restored.

    The base of :class:`~flwr_prox_strategies.extend.ValidatedFedAvg` for
    everything a run keeps besides its rounds.
    """

    # Set by ValidatedFedAvg.__init__ (its parts and settings).
    screen: ReplyScreen
    book: ClientBook
    stall: StallGuard
    evaluation: Evaluation
    population: Population
    global_arrays: ArrayRecord | None
    rounds_completed: int
    round_offset: int
    epsilon_totals: dict[int, float]
    retired_nodes: set[int]
    fraction_train: float
    _run_initial: ArrayRecord | None
    state_fields: ClassVar[tuple[str, ...]]
    resume_settings: ClassVar[tuple[str, ...]]
    seed: int
    run_tally: ReplyTally
    round_tally: ReplyTally
    num_clients: int | None
    train_nodes: set[int] | None
    max_rounds_without_aggregation: int | None
    stateful_clients: ClassVar[bool]

    def begin_run(self, initial_arrays: ArrayRecord, num_rounds: int) -> None:
        """Start a run's diagnostics (:meth:`reset_run`); remember its initial model."""
        self.reset_run()
        self._run_initial = initial_arrays
        # A stall in the last round is left to end_run, which raises with
        # Flower's whole Result.
        self.stall.final_round = self.round_offset + num_rounds

    def end_run(
        self, result: Result, num_rounds: int, name: str | None = None
    ) -> Result:
        """Finish the run with :meth:`check_run`; ``name`` names the strategy."""
        return self.check_run(result, num_rounds=num_rounds, name=name)

    def check_run(
        self,
        result: Result | None = None,
        num_rounds: int | None = None,
        name: str | None = None,
    ) -> Result:
        """End a run: fail loudly if it aggregated nothing, say what it averaged in.

        The pack's ``start()`` ends with it; call it at the end of a
        ``start()`` of your own (after :meth:`reset_run` at its beginning).
        It repeats the warning about clients that did not apply the
        algorithm's rule, with the run's count, and, when the run trained
        (``num_rounds > 0`` and ``fraction_train > 0``) without aggregating a
        single round, raises :class:`~flwr_prox_strategies.NoRoundAggregatedError`
        with the counted reasons.

        Parameters
        ----------
        result : Result | None (default: None)
            The run's result; its ``arrays`` become the run's initial model
            when no round was aggregated (Flower leaves them empty). None: a
            new ``Result`` holding the last aggregated (or initial) model.
        num_rounds : int | None (default: None)
            The rounds the run was asked for; None: the rounds this strategy
            was called for since :meth:`reset_run`.
        name : str | None (default: None)
            How a failure names the strategy; None: its class name (a wrapper
            passes its own, e.g. ``SecAggPlus(FedAvg)``).

        Returns
        -------
        Result
            ``result``, its ``arrays`` set as above.

        Raises
        ------
        NoRoundAggregatedError
            If the run trained and aggregated no round.
        """
        tally = self.run_tally
        if result is None:
            result = Result(arrays=self.global_arrays or ArrayRecord())
        if tally.not_applied:
            log(WARNING, "%s: %s", type(self).__name__, tally.describe_not_applied())
        attempted = tally.aggregated + sum(tally.kept.values())
        return finish_run(
            name or type(self).__name__,
            result,
            self._run_initial if self._run_initial is not None else result.arrays,
            attempted if num_rounds is None else num_rounds,
            tally,
            trains=self.fraction_train > 0,
        )

    def reset_run(self) -> None:
        """Start a new run's diagnostics (reasons tally, the once-per-run warning)."""
        self.screen.reset_run()
        self.book.reset_run()
        self.stall.reset()
        self._run_initial = None
        self.evaluation.reset_run()

    def state_dict(self) -> dict[str, Any]:
        """Return the server state that resumes the run exactly.

        Returns
        -------
        dict[str, Any]
            The declared
            :attr:`~flwr_prox_strategies.extend.ValidatedFedAvg.state_fields`
            (kebab-case keys), the
            :attr:`~flwr_prox_strategies.extend.ValidatedFedAvg.resume_settings`,
            the rounds completed, N, ``seed``, the privacy ledger and the
            clients' commit bookkeeping: pass it to
            :meth:`load_state_dict` of a strategy built the same way.
        """
        return checkpoint(
            strategy=type(self).__name__,
            seed=self.seed,
            rounds_completed=self.rounds_completed,
            population=self.population,
            epsilon_totals=self.epsilon_totals,
            retired_nodes=self.retired_nodes,
            book=self.book,
            fields={
                **save_fields(self, self.resume_settings),
                **save_fields(self, self.state_fields),
            },
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, or refuse it naming why.

        Parameters
        ----------
        state : Mapping[str, Any]
            A :meth:`state_dict` of the same strategy class.

        Raises
        ------
        ValueError
            If the state was saved by another strategy class, or under other
            :attr:`~flwr_prox_strategies.extend.ValidatedFedAvg.resume_settings`,
            another seed or another N, naming the difference (the run would
            not resume identically).
        """
        restored = restore(
            state,
            strategy=type(self).__name__,
            seed=self.seed,
            population=self.population,
            book=self.book,
            check_settings=lambda s: check_settings(self, self.resume_settings, s),
        )
        self.rounds_completed = restored.rounds_completed
        self.epsilon_totals = restored.epsilon_totals
        self.retired_nodes = restored.retired_nodes
        self.round_offset = self.rounds_completed
        load_fields(self, self.state_fields, state)

    def keep_previous_model(
        self, server_round: int, why: str, k_before: int | None
    ) -> None:
        """Keep the previous model this round, saying ``why``; count the stall."""
        self.run_tally.kept[why] += 1
        self.num_clients = k_before  # as if the round's replies never came
        log(
            WARNING,
            "aggregate_train: round %d: %s; %s; keeping the previous model",
            server_round,
            why,
            self.round_tally.describe(),
        )
        if self.fraction_train > 0.0 and self.train_nodes:
            # (a round that sampled nobody for training is no failure)
            self.stall.kept(
                server_round,
                why,
                round_tally=self.round_tally,
                never_aggregated=self.run_tally.aggregated == 0,
                limit=self.max_rounds_without_aggregation,
                owner=type(self).__name__,
                model=lambda never: self._run_initial if never else self.global_arrays,
            )

    def commit_round(
        self,
        server_round: int,
        valid: list[ValidReply],
        state: Mapping[str, Any],
        k_before: int | None,
    ) -> None:
        """Commit an aggregated round: the clients' states, N grown, ``state`` kept.

        Raises
        ------
        TypeError
            If ``state`` holds a field not declared in ``state_fields``.
        """
        self.run_tally.aggregated += 1
        self.stall.aggregated()
        if self.stateful_clients:
            self.book.commit(server_round, valid)
            self.population.commit_growth(
                k_before,
                f"{len(self.book.client_keys_seen)} client keys seen, "
                f"{self.book.retired_states} retired state(s)",
            )
        if unknown := set(state) - set(self.state_fields):
            raise TypeError(
                f"{type(self).__name__}.server_update returned state {sorted(unknown)} "
                f"not declared in state_fields {self.state_fields}"
            )
        for name, value in state.items():
            setattr(self, name, value)

r"""P-FedAvg: federated averaging over M parameter servers on a graph.

Z. Zhong, Y. Zhou, D. Wu, X. Chen, M. Chen, C. Li and Q. Z. Sheng, "P-FedAvg:
Parallelizing Federated Learning with Theoretical Guarantees", IEEE INFOCOM
2021, Algorithm 1. Each server's inner strategy sees only its group through a
``GroupGrid`` view (all groups' messages go out in one ``send_and_receive``).
The update, the mixing matrices, the assignment, the rounds without replies and
the deviations: the pack's P-FedAvg page (``docs/algorithms/pfedavg.md``).
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from numpy.typing import NDArray

from ..core.contract.validation import reject_unknown_kwargs
from ..core.docstrings import with_parameters_of
from ..core.server.outcome import (
    AggregationStalledError,
    NoRoundAggregatedError,
    ReplyTally,
    finish_run,
)
from ..core.server.screening import reply_node
from ..core.server.strategy import ValidatedFedAvg
from ..core.transport.grid import PARTITION_ID_KEY as PARTITION_ID_KEY
from ..core.transport.grid import SERVER_ID_KEY as SERVER_ID_KEY
from ..core.transport.grid import GroupGrid, assign_groups
from ..core.transport.records import RecordSpec, dict_to_record, record_to_dict
from ..core.wrapper import RunLifecycle
from ..ops.aggregate import SUMMED_METRICS, merge_metric_values
from ..ops.checks import check_int
from ..ops.mixing import (
    ServerGraph,
    consensus_average,
    consensus_distance,
    consensus_model,
    graph_of,
    mix_models,
)
from ..ops.mixing import server_graph as server_graph
from .fedavg import FedAvg
from .fedprox import FedProx


class GraphServers(RunLifecycle):
    """What the logical P-FedAvg and one deployed server share: W, tallies, a run.

    ``inner`` holds the servers' strategies (one for a deployed server).
    """

    inner: list[Strategy]
    run_tally: ReplyTally
    _run_initial: ArrayRecord | None
    #: The run's end names the rounds this wrapper kept (and why).
    reports_kept = True

    def use_graph(self, graph: ServerGraph) -> None:
        """Keep the graph, W, its names and its consensus rate."""
        self.adjacency, self.weights = graph.adjacency, graph.weights
        self.topology, self.mixing, self.rho = graph.topology, graph.mixing, graph.rho

    #: One server's strategy when none is given: the pack's FedAvg.
    make_inner = functools.partial(
        FedAvg, min_available_nodes=1, min_train_nodes=1, min_evaluate_nodes=1
    )

    def validated(self) -> list[ValidatedFedAvg]:
        """Return the inner strategies that are the pack's (they keep tallies)."""
        return [s for s in self.inner if isinstance(s, ValidatedFedAvg)]

    def begin_run(self, initial_arrays: ArrayRecord, num_rounds: int) -> None:
        """Start the run's tallies, this wrapper's and every server's strategy's."""
        self.run_tally = ReplyTally()
        self._run_initial = initial_arrays
        for strategy in self.validated():
            strategy.reset_run()

    def end_run(
        self, result: Result, num_rounds: int, name: str | None = None
    ) -> Result:
        """Fail loudly if no round mixed, with every server's reasons, counted.

        ``Result.arrays`` is the last mixed model, or the initial one when no
        round mixed.
        """
        kept = Counter(self.run_tally.kept) if self.reports_kept else Counter()
        tally = ReplyTally(kept=kept, aggregated=self.run_tally.aggregated)
        tally.update(self.run_tally)
        for strategy in self.validated():
            tally.update(strategy.run_tally)
        return finish_run(
            name or type(self).__name__,
            result,
            self._run_initial if self._run_initial is not None else result.arrays,
            num_rounds,
            tally,
        )

    def check_weights(self, state: Mapping[str, Any]) -> None:
        """Refuse a checkpoint made with another mixing matrix."""
        if not np.array_equal(state["weights"], self.weights):
            raise ValueError("checkpoint was made with another mixing matrix")


@with_parameters_of(server_graph, after="servers")
class PFedAvg(GraphServers):
    r"""M logical parameter servers, one inner strategy each, mixed over a graph.

    P-FedAvg (Zhong et al., 2021, Algorithm 1) in one ServerApp. Server
    :math:`i` owns a disjoint group of clients; each round every server
    samples some of its clients and aggregates their replies into
    :math:`y_i` with its own **inner strategy** (the pack's FedAvg by default,
    or FedProx, FedDyn, ..., or Flower's own, each seeing only its group), and
    the servers mix with their neighbours only,
    :math:`x_i = \sum_j W_{ij} y_j`, :math:`W` symmetric and doubly stochastic
    on the graph's edges. All groups' messages go out in one round trip.
    Flower's global model is the consensus average
    :math:`\bar x = \frac{1}{M}\sum_i x_i`; every server's model is evaluated
    centrally and the consensus distance :math:`\sum_i\lVert x_i - \bar
    x\rVert^2` is logged per round. Nodes are assigned to servers by their
    ``server-id`` (else ``partition-id`` modulo :math:`M`) in
    ``node_config``, read once by a query that :func:`to_client_app` answers.
    For servers on separate deployments, see :class:`PFedAvgServer`.

    Parameters
    ----------
    servers : int
        :math:`M \ge 1`, the number of parameter servers (required).
    inner : callable | None (default: None)
        ``inner()`` builds one server's strategy, called :math:`M` times (its
        ``min_*_nodes`` count the nodes of one group); None: the pack's
        ``FedAvg(min_available_nodes=1, min_train_nodes=1,
        min_evaluate_nodes=1)``.
    assignment : Mapping[int, int] | None (default: None)
        ``{partition-id or node-id: server}``; None: from ``node_config``.
    max_rounds_without_aggregation : int | None (default: 3)
        Rounds in a row in which no server updated before
        ``aggregate_train`` raises
        :class:`~flwr_prox_strategies.AggregationStalledError` (or
        :class:`~flwr_prox_strategies.NoRoundAggregatedError`), in any loop.
        A server whose own group fails goes on mixing, so the inner
        strategies' own limit is turned off. None: never.

    Raises
    ------
    ValueError
        If ``servers`` is not an integer >= 1, the topology or mixing is
        unknown or cannot be built with the given ``degree``,
        ``probability`` or ``rows``, a given graph or matrix fails its checks,
        ``inner()`` returns the same strategy twice, or ``assignment`` maps
        to a server outside ``0 .. servers - 1`` (each naming the parameter).
    TypeError
        If a keyword is unknown.
    ImportError
        If ``mixing`` is ``"sdp"`` or ``"sdp-signed"`` and cvxpy is not
        installed.
    NoRoundAggregatedError
        From :meth:`start`, when no round mixed anything.

    References
    ----------
    Z. Zhong, Y. Zhou, D. Wu, X. Chen, M. Chen, C. Li and Q. Z. Sheng,
    "P-FedAvg: Parallelizing Federated Learning with Theoretical
    Guarantees", IEEE INFOCOM 2021.
    """

    def __init__(
        self,
        *,
        servers: int,
        topology: str = "ring",
        mixing: str = "metropolis",
        adjacency_matrix: Any = None,
        weights: Any = None,
        degree: int | None = None,
        probability: float | None = None,
        rows: int | None = None,
        inner: Callable[[], Strategy] | None = None,
        assignment: Mapping[int, int] | None = None,
        seed: int = 0,
        max_rounds_without_aggregation: int | None = 3,
        **unknown: Any,
    ) -> None:
        if max_rounds_without_aggregation is not None:
            check_int(
                "max_rounds_without_aggregation", max_rounds_without_aggregation, 1
            )
        reject_unknown_kwargs(
            type(self).__name__,
            unknown,
            [
                name
                for name in inspect.signature(PFedAvg.__init__).parameters
                if name not in ("self", "unknown")
            ],
        )
        self.use_graph(graph_of(servers, locals()))
        self.servers = servers
        factory = inner or self.make_inner
        self.inner = [factory() for _ in range(servers)]
        if len({id(s) for s in self.inner}) != servers:
            raise ValueError("inner() must build a new strategy at every call")
        # A server whose group fails goes on mixing with its neighbours: only
        # rounds in which no server updated count towards stopping the run.
        self.max_rounds_without_aggregation = max_rounds_without_aggregation
        self._stalled = 0
        for strategy in self.validated():
            strategy.max_rounds_without_aggregation = None
        self.assignment = (
            None
            if assignment is None
            else {int(k): int(v) for k, v in assignment.items()}
        )
        if self.assignment and not all(
            0 <= v < servers for v in self.assignment.values()
        ):
            raise ValueError(f"assignment maps to servers outside 0..{servers - 1}")
        self.groups: list[list[int]] | None = None
        self.server_of: dict[int, int] = {}
        self.models: list[dict[str, NDArray]] | None = None
        self.rejections: Counter[str] = Counter()
        self._accept_failures = True
        self._run_initial = None
        # This run's rounds mixed, stray replies, and rounds kept (and why).
        self.run_tally = ReplyTally()

    @property
    def accept_failures(self) -> bool:
        """When False, any failed or rejected reply keeps every server's model."""
        return self._accept_failures

    @accept_failures.setter
    def accept_failures(self, value: bool) -> None:
        self._accept_failures = bool(value)
        for strategy in self.inner:
            if hasattr(strategy, "accept_failures"):
                strategy.accept_failures = bool(value)

    # ------------------------------------------------------------------ info
    def __repr__(self) -> str:
        """Return the class name and its main settings."""
        return (
            f"PFedAvg(servers={self.servers}, topology={self.topology!r}, "
            f"mixing={self.mixing!r}, rho={self.rho:.4f})"
        )

    def summary(self) -> None:
        """Log the servers, the graph and the mixing weights."""
        log(
            INFO,
            "\t├──> P-FedAvg: %d servers, topology %s",
            self.servers,
            self.topology,
        )
        log(INFO, "\t│\t├── mixing: %s, rho(W) = %.4f", self.mixing, self.rho)
        log(INFO, "\t│\t└── inner strategy: %s", type(self.inner[0]).__name__)

    # ------------------------------------------------------------------- run
    def begin_run(self, initial_arrays: ArrayRecord, num_rounds: int) -> None:
        """Start the run's tallies, this wrapper's and every server's strategy's."""
        super().begin_run(initial_arrays, num_rounds)
        self._stalled = 0

    def assign_nodes(self, grid: Grid) -> list[list[int]]:
        """Split the connected nodes into M groups (once per run)."""
        groups = assign_groups(grid, self.servers, self.assignment)
        self.server_of = {n: s for s, group in enumerate(groups) for n in group}
        return groups

    # ----------------------------------------------------------------- train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Each server configures its own group with its own model."""
        if self.groups is None:
            self.groups = self.assign_nodes(grid)
        if self.models is None:
            initial = record_to_dict(arrays)
            self.models = [dict(initial) for _ in range(self.servers)]
        messages = self._per_group("train", server_round, config, grid)
        log(
            INFO,
            "P-FedAvg: round %d, %d messages to %d servers' groups",
            server_round,
            len(messages),
            self.servers,
        )
        return messages

    def _per_group(
        self, kind: str, server_round: int, config: ConfigRecord, grid: Grid
    ) -> list[Message]:
        """Let every server's strategy configure its own group with its model."""
        assert self.groups is not None and self.models is not None
        messages: list[Message] = []
        for server, strategy in enumerate(self.inner):
            configure = getattr(strategy, f"configure_{kind}")
            messages.extend(
                configure(
                    server_round,
                    dict_to_record(self.models[server]),
                    ConfigRecord(dict(config)),
                    GroupGrid(grid, self.groups[server]),
                )
            )
        return messages

    def _by_server(
        self, kind: str, replies: Iterable[Message]
    ) -> tuple[list[list[Message]], list[Message]]:
        """Return the replies sorted by their node's server, and the others."""
        # A dead node's error reply comes from the SuperLink (node 1): the
        # servers' strategies know which node the answered message went to.
        sent_to: dict[str, int] = {}
        for strategy in self.validated():
            sent_to.update(strategy.screen.sent_nodes(kind))
        by_server: list[list[Message]] = [[] for _ in range(self.servers)]
        strays: list[Message] = []
        for reply in replies:
            server = self.server_of.get(reply_node(reply, sent_to))
            (strays if server is None else by_server[server]).append(reply)
        return by_server, strays

    def expected_train_arrays(self, server_round: int) -> dict[str, RecordSpec]:
        """Return what a reply must carry (the inner strategies' expectation)."""
        return self.inner[0].expected_train_arrays(server_round)  # type: ignore[attr-defined]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate per server, then mix over the graph."""
        assert self.models is not None, "configure_train must run first"
        by_server, strays = self._by_server("train", replies)
        for reply in strays:
            self.rejections["aggregate_train:unsampled"] += 1
            self.run_tally.rejected["unsampled: node belongs to no server"] += 1
            log(
                WARNING,
                "P-FedAvg: reply from node %d, which belongs to no server",
                reply.metadata.src_node_id,
            )
        updated: list[dict[str, NDArray]] = []
        records: list[MetricRecord] = []
        fresh = 0
        for server, strategy in enumerate(self.inner):
            before = Counter(getattr(strategy, "rejections", Counter()))
            result, metrics = strategy.aggregate_train(server_round, by_server[server])
            after = Counter(getattr(strategy, "rejections", Counter()))
            self.rejections.update(after - before)
            if metrics is not None:
                records.append(metrics)
            if result is None:
                updated.append(self.models[server])
            else:
                fresh += 1
                updated.append(record_to_dict(result))
        metrics = merge_metrics(records)
        counts = {
            key: _count(metrics.get(key, 0))
            for key in ("replies-valid", "replies-failed", "replies-rejected")
        }
        counts["replies-rejected"] += len(strays)
        for key, value in counts.items():
            metrics[key] = value
        failures = counts["replies-failed"] + counts["replies-rejected"]
        if fresh == 0 or (failures and not self.accept_failures):
            why = (
                "no server updated"
                if fresh == 0
                else "accept_failures=False and some replies failed or were rejected"
            )
            self.run_tally.kept[why] += 1
            round_tally = ReplyTally()
            for strategy in self.validated():
                round_tally.update(strategy.round_tally)
            log(
                WARNING,
                "P-FedAvg: round %d: %s (%s); keeping all models",
                server_round,
                why,
                round_tally.describe(),
            )
            self._stalled += 1
            limit = self.max_rounds_without_aggregation
            if limit is not None and self._stalled >= limit:
                error = (
                    NoRoundAggregatedError
                    if self.run_tally.aggregated == 0
                    else AggregationStalledError
                )
                raise error(
                    f"P-FedAvg: no server updated in {self._stalled} rounds in a "
                    f"row (max_rounds_without_aggregation={limit}): "
                    f"{round_tally.describe()}",
                    Result(arrays=dict_to_record(consensus_average(self.models))),
                    round_tally,
                )
            return None, metrics
        self._stalled = 0
        self.models = self.mix(updated)
        self.run_tally.aggregated += 1
        average = consensus_average(self.models)
        distance = consensus_distance(self.models, average)
        metrics["consensus-distance"] = distance
        metrics["servers-updated"] = fresh
        log(
            INFO,
            "P-FedAvg: round %d: %d/%d servers updated, consensus distance %.4g",
            server_round,
            fresh,
            self.servers,
            distance,
        )
        return dict_to_record(consensus_model(self.models, average)), metrics

    def mix(self, models: list[dict[str, NDArray]]) -> list[dict[str, NDArray]]:
        r"""Return :math:`x_i = \sum_j W_{ij} y_j` (:func:`..ops.mixing.mix_models`)."""
        return mix_models(self.weights, models)

    def consensus_average(self) -> dict[str, NDArray]:
        """Return the mean of the servers' models (float arrays, float64)."""
        assert self.models is not None
        return consensus_average(self.models)

    def central_models(self) -> dict[str, ArrayRecord]:
        """Return every server's model, for central evaluation beside the consensus.

        Returns
        -------
        dict[str, ArrayRecord]
            ``"server-<i>"`` -> server :math:`i`'s model :math:`x_i` (empty
            before the first round).
        """
        if self.models is None:
            return {}
        return {f"server-{i}": dict_to_record(m) for i, m in enumerate(self.models)}

    # -------------------------------------------------------------- evaluate
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Each group evaluates its own server's model."""
        if self.groups is None or self.models is None:
            return []
        return self._per_group("evaluate", server_round, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Aggregate per group, then merge (sample-weighted)."""
        by_server, _ = self._by_server("evaluate", replies)
        records = [
            r
            for server, strategy in enumerate(self.inner)
            if (r := strategy.aggregate_evaluate(server_round, by_server[server]))
            is not None
        ]
        return merge_metrics(records) if records else None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Return what resumes the run: models, inner states, the mixing matrix.

        Returns
        -------
        dict[str, Any]
            The servers' models, every inner strategy's ``state_dict()`` and
            the mixing matrix (checked on restore).
        """
        return {
            "strategy": "PFedAvg",
            "servers": self.servers,
            "weights": self.weights.copy(),
            "models": {}
            if self.models is None
            else {
                str(i): {k: v.copy() for k, v in m.items()}
                for i, m in enumerate(self.models)
            },
            "inner": {
                str(i): s.state_dict() if hasattr(s, "state_dict") else {}
                for i, s in enumerate(self.inner)
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Parameters
        ----------
        state : Mapping[str, Any]
            A :meth:`state_dict` of a P-FedAvg with as many servers.

        Raises
        ------
        ValueError
            If the state is not a P-FedAvg state with as many servers, was
            made with another mixing matrix, or an inner strategy refuses its
            own state.
        """
        if state.get("strategy") != "PFedAvg" or state.get("servers") != self.servers:
            raise ValueError("checkpoint is not a P-FedAvg state with as many servers")
        self.check_weights(state)
        models = state["models"]
        self.models = (
            [
                {k: np.array(v) for k, v in models[str(i)].items()}
                for i in range(self.servers)
            ]
            if models
            else None
        )
        for i, strategy in enumerate(self.inner):
            if hasattr(strategy, "load_state_dict"):
                strategy.load_state_dict(state["inner"][str(i)])


def _count(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) else 0


def merge_metrics(records: list[MetricRecord]) -> MetricRecord:
    """Merge the servers' metrics into one record.

    Counts add up, ``*-max`` takes the max, ``*-min`` / ``*-worst`` the min (a
    privacy total or a worst client stays what it is over all servers), and
    every other metric is averaged weighted by ``num-examples``.
    """
    return MetricRecord(merge_metric_values(records, SUMMED_METRICS))


def _case(n: int, **options: Any) -> PFedAvg:
    inner = options.pop("inner", "fedavg")
    makers: dict[str, Callable[..., ValidatedFedAvg]] = {
        "fedavg": FedAvg,
        "fedprox": lambda **kw: FedProx(mu=0.1, **kw),
    }
    make = makers[inner]
    return PFedAvg(
        servers=4,
        inner=lambda: make(min_available_nodes=1, min_train_nodes=1),
        assignment={1001 + i: i % 4 for i in range(n)},
        **options,
    )


#: The configurations the conformance checks run (``flwr_prox_strategies.testing``),
#: name -> factory taking the number of nodes (ids 1001..): four servers.
CASES = {
    "ring": lambda n: _case(n, topology="ring"),
    "fedprox-sdp": lambda n: _case(n, topology="star", mixing="sdp", inner="fedprox"),
}

"""One P-FedAvg parameter server on its own Flower deployment.

Z. Zhong, Y. Zhou, D. Wu, X. Chen, M. Chen, C. Li and Q. Z. Sheng, "P-FedAvg:
Parallelizing Federated Learning with Theoretical Guarantees", IEEE INFOCOM
2021: the paper's servers as separate deployments. The exchange, the mixing of
the models at hand, the deadlines and restarts: the pack's pages on P-FedAvg
and on its deployment (``docs/howto/pfedavg-deployment.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from ..core.docstrings import with_parameters_of
from ..core.server.outcome import ReplyTally
from ..core.server.strategy import ValidatedFedAvg
from ..core.transport.records import dict_to_record, record_to_dict
from ..ops.checks import check_int, check_positive
from ..ops.mixing import graph_of, mix_row, server_graph
from ..pfedavg_deploy.exchange import PeerExchange
from ..pfedavg_deploy.security import PeerSecurity
from .pfedavg import GraphServers


@with_parameters_of(server_graph, after="addresses")
class PFedAvgServer(GraphServers):
    r"""Parameter server ``index`` of M, mixing with its graph neighbours over gRPC.

    :class:`PFedAvg` runs :math:`M` *logical* servers in one ServerApp, so
    every byte still crosses one SuperLink. Here server :math:`i` is a
    deployment of its own (a SuperLink, its SuperNodes, this ServerApp), so
    the clients' traffic is spread over :math:`M` links. Each round its inner
    strategy trains its own clients into :math:`y_i`, :math:`y_i` goes to
    its graph neighbours and theirs come back over gRPC with a deadline, and
    :math:`x_i = \sum_{j \in A} W_{ij} y_j / \sum_{j \in A} W_{ij}` over the
    models at hand :math:`A`. With every neighbour's model this is exactly
    the logical P-FedAvg's :math:`x_i`; a neighbour that did not deliver by
    the deadline is left out (logged) and the others' weights are scaled up.
    :math:`W` is derived on every server from the same settings, without
    exchanging it. A server restarted from its checkpoint catches up with
    :meth:`rejoin`.

    Parameters
    ----------
    index : int
        This server, :math:`0 \le i < M`.
    servers : int
        :math:`M`.
    addresses : Sequence[str] | str
        Every server's exchange address ``host:port`` in server order (a
        comma-separated string too), the same on every server; this one listens
        on ``addresses[index]``.
    inner : Strategy | callable | None (default: None)
        This server's strategy over its own SuperNodes, or a factory of it;
        None: the pack's ``FedAvg(min_available_nodes=1, min_train_nodes=1,
        min_evaluate_nodes=1)``.
    federation : str (default: "pfedavg")
        Names the federation; a neighbour's message of another is refused.
    timeout : float (default: 60.0)
        Seconds a round waits for its neighbours' models.
    rejoin_grace : float (default: 10.0)
        Seconds a round waits for a neighbour that missed the previous round or
        is unreachable.
    join_timeout : float (default: 120.0)
        Seconds the run's start waits for the neighbours to answer (servers start
        at different moments); the run goes on with those that did.
    root_certificates, certificate, private_key : str | None (default: None)
        PEM files for mutual TLS between servers (all three, or none).
    token_file : str | None (default: None)
        File holding a shared secret every server-to-server call must carry.

    Raises
    ------
    ValueError
        If the graph settings are invalid (as :class:`PFedAvg`), ``index`` is
        not in ``0 .. servers - 1``, ``addresses`` does not name all
        ``servers`` exchanges, ``timeout``, ``rejoin_grace`` or
        ``join_timeout`` is not > 0, or only some of the three TLS files are
        given.
    NoRoundAggregatedError
        From :meth:`start`, when no round mixed anything.

    References
    ----------
    Zhong et al., "P-FedAvg", IEEE INFOCOM 2021 (in full: :class:`PFedAvg`).
    """

    #: Its kept rounds are its own, not the federation's: the run's end (the
    #: same as before the shared base) names only the replies' reasons.
    reports_kept = False

    def __init__(
        self,
        *,
        index: int,
        servers: int,
        addresses: Sequence[str] | str,
        topology: str = "ring",
        mixing: str = "metropolis",
        adjacency_matrix: Any = None,
        weights: Any = None,
        degree: int | None = None,
        probability: float | None = None,
        rows: int | None = None,
        seed: int = 0,
        inner: Strategy | Callable[[], Strategy] | None = None,
        federation: str = "pfedavg",
        timeout: float = 60.0,
        rejoin_grace: float = 10.0,
        join_timeout: float = 120.0,
        root_certificates: str | None = None,
        certificate: str | None = None,
        private_key: str | None = None,
        token_file: str | None = None,
    ) -> None:
        self.use_graph(graph_of(servers, locals()))
        check_int("index", index, 0)
        if index >= servers:
            raise ValueError(f"index must be < servers={servers}, got {index}")
        if isinstance(addresses, str):
            addresses = [a.strip() for a in addresses.split(",") if a.strip()]
        if len(addresses) != servers:
            raise ValueError(
                f"addresses must name all {servers} servers' exchanges in order, "
                f"got {len(addresses)}: {list(addresses)}"
            )
        check_positive("timeout", timeout)
        check_positive("rejoin_grace", rejoin_grace)
        check_positive("join_timeout", join_timeout)
        self.index, self.servers = index, servers
        self.addresses = list(addresses)
        self.neighbours = [
            int(j) for j in np.flatnonzero(self.weights[index]) if int(j) != index
        ]
        inner = self.make_inner if inner is None else inner
        local = inner if isinstance(inner, Strategy) else inner()
        # A list, as P-FedAvg's: what reads a composite's strategies reads this.
        self.inner: list[Strategy] = [local]
        self.join_timeout = float(join_timeout)
        self.security = PeerSecurity.from_files(
            root_certificates=root_certificates,
            certificate=certificate,
            private_key=private_key,
            token_file=token_file,
        )
        self.exchange = PeerExchange(
            index=index,
            addresses=self.addresses,
            neighbours=self.neighbours,
            federation=federation,
            timeout=timeout,
            rejoin_grace=rejoin_grace,
            security=self.security,
        )
        self._started = False
        self._joined: dict[int, tuple[int, ArrayRecord | None]] | None = None
        self.rounds_completed = 0
        self.round_offset = 0
        self.model: ArrayRecord | None = None  # x_i sent this round
        self._run_initial = None
        self.run_tally = ReplyTally()

    @property
    def local(self) -> Strategy:
        """Return the strategy over this server's own clients (``inner[0]``)."""
        return self.inner[0]

    @property
    def rejections(self) -> Mapping[str, int]:
        """The inner strategy's counts of replies not used."""
        return getattr(self.local, "rejections", {})

    @property
    def accept_failures(self) -> bool:
        """When False, any failed or rejected reply keeps the inner model."""
        return bool(getattr(self.local, "accept_failures", True))

    @accept_failures.setter
    def accept_failures(self, value: bool) -> None:
        if hasattr(self.local, "accept_failures"):
            self.local.accept_failures = bool(value)

    def __repr__(self) -> str:
        """Return the class name and its main settings."""
        return (
            f"PFedAvgServer(index={self.index}, servers={self.servers}, "
            f"topology={self.topology!r}, mixing={self.mixing!r}, "
            f"neighbours={self.neighbours})"
        )

    def summary(self) -> None:
        """Log this server's place in the graph, its weights and its links."""
        row = ", ".join(
            f"{j}: {self.weights[self.index, j]:.4g}"
            for j in [self.index, *self.neighbours]
        )
        log(
            INFO,
            "\t├──> P-FedAvg server %d of %d, topology %s",
            self.index,
            self.servers,
            self.topology,
        )
        log(
            INFO,
            "\t│\t├── mixing: %s, rho(W) = %.4f, row %s",
            self.mixing,
            self.rho,
            row,
        )
        log(
            INFO,
            "\t│\t├── exchange: %s, %s",
            self.addresses[self.index],
            self.security.describe(),
        )
        log(INFO, "\t│\t└── inner strategy: %s", type(self.local).__name__)

    # ------------------------------------------------------------------- run
    def _ensure_exchange(self, model: ArrayRecord) -> None:
        if not self._started:
            self.exchange.start(max_message_bytes=2 * model.count_bytes() + (8 << 20))
            self._started = True

    def _join(self, model: ArrayRecord) -> dict[int, tuple[int, ArrayRecord | None]]:
        """Open the exchange and wait for the neighbours (once per run)."""
        self._ensure_exchange(model)
        self._joined = self.exchange.wait_for_neighbours(self.join_timeout)
        missing = sorted(set(self.neighbours) - set(self._joined))
        log(
            INFO,
            "P-FedAvg server %d: neighbours %s answered%s",
            self.index,
            sorted(self._joined),
            f"; {missing} did not within {self.join_timeout:.0f} s" if missing else "",
        )
        return self._joined

    def rejoin(self, arrays: ArrayRecord, done: int) -> tuple[ArrayRecord, int]:
        """Catch up with neighbours that are ahead: return (model, rounds done).

        Called before :meth:`start` by a server that starts late or resumes
        from a checkpoint of round ``done``. When neighbours report a later
        round, the server skips to their latest round with the mix of their
        models of it (re-normalised over those that gave one); otherwise
        ``(arrays, done)`` is returned unchanged.

        Parameters
        ----------
        arrays : ArrayRecord
            This server's model (its checkpoint's, or the initial one).
        done : int
            The rounds it has completed.

        Returns
        -------
        tuple[ArrayRecord, int]
            The model to start from and the rounds done.
        """
        statuses = self._join(arrays)
        latest = max((rnd for rnd, _ in statuses.values()), default=0)
        if latest <= done:
            return arrays, done
        ahead = {j: m for j, (rnd, m) in statuses.items() if rnd == latest and m}
        if not ahead:
            return arrays, done
        row = self.weights[self.index].copy()
        row[self.index] = 0.0  # its own model is rounds old: not mixed in
        row /= row.sum()  # a row of weights summing to one, as mix_row expects
        first = min(ahead)
        models = {j: record_to_dict(m) for j, m in ahead.items()}
        mixed, _ = mix_row(row, first, models)
        log(
            INFO,
            "P-FedAvg server %d: neighbours %s are at round %d, this server at %d: "
            "skipping to round %d with their mixed models",
            self.index,
            sorted(ahead),
            latest,
            done,
            latest,
        )
        self.rounds_completed = latest
        self.round_offset = latest
        if isinstance(self.local, ValidatedFedAvg):
            self.local.rounds_completed = latest
            self.local.round_offset = latest
        return dict_to_record(mixed), latest

    # ------------------------------------------------------------------- run
    def begin_run(self, initial_arrays: ArrayRecord, num_rounds: int) -> None:
        """Start the run's tallies; open the exchange and wait for the neighbours."""
        super().begin_run(initial_arrays, num_rounds)
        if self._joined is None:
            self._join(initial_arrays)

    def close_run(self, failed: bool) -> None:
        """Close the exchange (a run that failed included)."""
        self.exchange.stop()
        self._started, self._joined = False, None

    # ----------------------------------------------------------------- train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Let the inner strategy configure this server's clients with x_i."""
        self.model = arrays
        self.exchange.begin_round(server_round + self.round_offset)
        return self.local.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate this server's clients, exchange with the neighbours, mix."""
        assert self.model is not None, "configure_train must run first"
        rnd = server_round + self.round_offset
        aggregated, metrics = self.local.aggregate_train(server_round, replies)
        own = self.model if aggregated is None else aggregated
        exchanged = self.exchange.exchange(rnd, own)
        models = {self.index: record_to_dict(own)}
        models.update({j: record_to_dict(m) for j, m in exchanged.models.items()})
        mixed, weight = mix_row(self.weights[self.index], self.index, models)
        record = dict_to_record(mixed)
        self.exchange.publish(rnd, record)
        self.rounds_completed = rnd
        if aggregated is not None or exchanged.models:
            self.run_tally.aggregated += 1
        else:
            self.run_tally.kept["no valid reply and no neighbour's model"] += 1
        metrics = metrics if metrics is not None else MetricRecord()
        metrics["server-updated"] = int(aggregated is not None)
        metrics["neighbours-answered"] = len(exchanged.models)
        metrics["neighbours-missing"] = len(exchanged.missing)
        metrics["mixing-weight-at-hand"] = weight
        metrics["exchange-bytes-sent"] = exchanged.bytes_sent
        metrics["exchange-bytes-received"] = exchanged.bytes_received
        metrics["exchange-s"] = exchanged.seconds
        log(
            INFO,
            "P-FedAvg server %d: round %d: %s, mixed with %s (weight at hand %.3f)%s",
            self.index,
            rnd,
            "own clients aggregated" if aggregated is not None else "model kept",
            sorted(exchanged.models) or "no neighbour",
            weight,
            f", missing {exchanged.missing}" if exchanged.missing else "",
        )
        return record, metrics

    # -------------------------------------------------------------- evaluate
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Let the inner strategy evaluate x_i on this server's clients."""
        return self.local.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Return the inner strategy's evaluation metrics."""
        return self.local.aggregate_evaluate(server_round, replies)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Return the server's place, W, its rounds and its inner strategy's state."""
        return {
            "strategy": "PFedAvgServer",
            "index": self.index,
            "servers": self.servers,
            "weights": self.weights.copy(),
            "rounds-completed": self.rounds_completed,
            "inner": self.local.state_dict()
            if hasattr(self.local, "state_dict")
            else {},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (same server, same W)."""
        if (
            state.get("strategy") != "PFedAvgServer"
            or state.get("index") != self.index
            or state.get("servers") != self.servers
        ):
            raise ValueError(
                f"checkpoint is not P-FedAvg server {self.index} of {self.servers}: "
                f"{state.get('strategy')!r} {state.get('index')!r} of "
                f"{state.get('servers')!r}"
            )
        self.check_weights(state)
        if hasattr(self.local, "load_state_dict"):
            self.local.load_state_dict(state["inner"])
        self.rounds_completed = int(state["rounds-completed"])
        self.round_offset = self.rounds_completed

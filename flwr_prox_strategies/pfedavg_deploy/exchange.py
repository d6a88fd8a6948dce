"""P-FedAvg's server-to-server exchange: gRPC, neighbours only, deadlines, TLS.

The service's methods ``Deliver`` and ``Status``: ``docs/reference/wire-protocol.md``;
the deadlines, the rejoin grace: ``docs/howto/pfedavg-deployment.md``. Nothing
here ever waits without a deadline. Security: :class:`~.security.PeerSecurity`.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, NoReturn

import grpc
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.common.logger import log
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from ..core.transport.records import record_is_finite, spec_of
from .security import TOKEN_METADATA as TOKEN_METADATA
from .security import PeerSecurity as PeerSecurity
from .security import open_channel as open_channel

SERVICE = "flwr_prox_strategies.ModelExchange"
# A neighbour's model may arrive this many rounds before this server needs it.
ROUNDS_AHEAD = 2
# Mixed models kept for Status (a catching-up neighbour, the launcher's reads).
KEPT_ROUNDS = 3


@dataclass
class Exchanged:
    """What one round's exchange gave: the neighbours' models and its costs."""

    models: dict[int, ArrayRecord]
    missing: list[int]
    rejected: list[int] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


def _encode(meta: Mapping[str, Any], model: ArrayRecord | None = None) -> bytes:
    content = RecordDict({"meta": ConfigRecord(dict(meta))})
    if model is not None:
        content["model"] = model
    return bytes(recorddict_to_proto(content).SerializeToString())


def _decode(payload: bytes) -> tuple[dict[str, Any], ArrayRecord | None]:
    proto = ProtoRecordDict()
    proto.ParseFromString(payload)
    content = recorddict_from_proto(proto)
    meta = dict(content.config_records["meta"])
    model = content.array_records.get("model")
    return meta, model


def _identity(payload: bytes) -> bytes:
    return payload


def _unary(channel: grpc.Channel, method: str) -> Callable[..., Any]:
    return channel.unary_unary(
        f"/{SERVICE}/{method}",
        request_serializer=_identity,
        response_deserializer=_identity,
    )


def _ask_status(
    call: Callable[[bytes], bytes], federation: str, server_round: int | None
) -> tuple[int, ArrayRecord | None] | None:
    """Return a server's round and mixed model (None: the call failed)."""
    meta: dict[str, Any] = {"federation": federation}
    if server_round is not None:
        meta["round"] = server_round
    try:
        answer, model = _decode(call(_encode(meta)))
    except grpc.RpcError:
        return None
    return int(answer["round"]), model


def _refuse(context: grpc.ServicerContext, code: grpc.StatusCode, why: str) -> NoReturn:
    """End the call with ``code`` (``abort`` raises; the raise below is for mypy)."""
    context.abort(code, why)
    raise RuntimeError(why)


class PeerExchange:
    r"""One parameter server's end of the exchange with its graph neighbours.

    Parameters
    ----------
    index : int
        This server, :math:`i`.
    addresses : sequence of str
        ``host:port`` of every server's exchange, in server order (the same
        list on every server); this server listens on ``addresses[index]``.
    neighbours : iterable of int
        The servers :math:`j \ne i` with :math:`W_{ij} \ne 0`.
    federation : str (default: "pfedavg")
        Names the federation; a message from another is refused.
    timeout : float (default: 60.0)
        Seconds a round waits for its neighbours' models after sending its own.
    rejoin_grace : float (default: 10.0)
        Seconds a round waits for a neighbour that missed the previous round or
        cannot be reached.
    security : PeerSecurity | None (default: None)
        TLS and token; None: insecure.
    """

    def __init__(
        self,
        *,
        index: int,
        addresses: Sequence[str],
        neighbours: Iterable[int],
        federation: str = "pfedavg",
        timeout: float = 60.0,
        rejoin_grace: float = 10.0,
        security: PeerSecurity | None = None,
    ) -> None:
        self.index = index
        self.addresses = list(addresses)
        self.neighbours = sorted(int(j) for j in neighbours)
        if not 0 <= index < len(self.addresses):
            raise ValueError(
                f"index {index} outside the {len(self.addresses)} addresses"
            )
        if any(not 0 <= j < len(self.addresses) or j == index for j in self.neighbours):
            raise ValueError(f"neighbours {self.neighbours} of server {index}")
        self.federation = federation
        self.timeout = float(timeout)
        self.rejoin_grace = min(float(rejoin_grace), self.timeout)
        self.security = security or PeerSecurity()
        self._cond = threading.Condition()
        self._inbox: dict[int, dict[int, tuple[ArrayRecord, int]]] = {
            j: {} for j in self.neighbours
        }
        self._waiting_round = 1  # older rounds are stale
        self._absent: set[int] = set()  # missed the last round
        self._unreachable: set[int] = set()  # connection refused this round
        self._published: dict[int, ArrayRecord] = {}  # round -> x_i
        self._server: grpc.Server | None = None
        self._channels: dict[int, grpc.Channel] = {}
        self._senders: futures.ThreadPoolExecutor | None = None
        self._sends: list[futures.Future[str]] = []
        self._stopping = threading.Event()

    # ------------------------------------------------------------- lifecycle
    def start(self, max_message_bytes: int) -> None:
        """Listen on this server's address and open channels to the neighbours."""
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # A restarted neighbour is found again within a few seconds, not
            # after gRPC's default backoff of up to two minutes.
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2 * len(self.neighbours) + 4),
            # gRPC binds with SO_REUSEPORT by default on Linux: a second server
            # on a taken port would start, and the kernel would share the
            # neighbours' calls between the two. Refuse the port instead.
            options=[*options, ("grpc.so_reuseport", 0)],
        )
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                answer, request_deserializer=_identity, response_serializer=_identity
            )
            for name, answer in (
                ("Deliver", self._on_deliver),
                ("Status", self._on_status),
            )
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),)
        )
        address = self.addresses[self.index]
        try:
            if self.security.tls:
                credentials = grpc.ssl_server_credentials(
                    [(self.security.private_key, self.security.certificate)],
                    root_certificates=self.security.root_certificates,
                    require_client_auth=True,
                )
                bound = server.add_secure_port(address, credentials)
            else:
                bound = server.add_insecure_port(address)
        except RuntimeError:  # grpcio raises where older versions returned 0
            bound = 0
        if not bound:
            raise RuntimeError(
                f"P-FedAvg server {self.index}: cannot listen on {address} "
                "(taken by another process?)"
            )
        server.start()
        self._server = server
        self._stopping.clear()
        for j in self.neighbours:
            self._channels[j] = open_channel(self.addresses[j], self.security, options)
        self._senders = futures.ThreadPoolExecutor(
            max_workers=max(1, len(self.neighbours))
        )
        log(
            INFO,
            "P-FedAvg server %d: exchange on %s with neighbours %s (%s)",
            self.index,
            address,
            self.neighbours,
            self.security.describe(),
        )

    def stop(self) -> None:
        """Finish the deliveries in flight, stop listening, close the channels.

        The last round's model must still reach the neighbours (a server that
        found theirs waiting ends its run before its own sends ran); a
        neighbour that cannot be reached is not retried any longer.
        """
        self._stopping.set()
        if self._senders is not None:
            futures.wait(self._sends, timeout=self.timeout)
            self._senders.shutdown(wait=False, cancel_futures=True)
        self._sends = []
        for channel in self._channels.values():
            channel.close()
        if self._server is not None:
            self._server.stop(grace=1.0).wait(2.0)
        self._server, self._channels, self._senders = None, {}, None

    # ------------------------------------------------------------- receiving
    def _authorised(self, context: grpc.ServicerContext) -> None:
        if self.security.token is None:
            return
        given = dict(context.invocation_metadata()).get(TOKEN_METADATA, "")
        if not hmac.compare_digest(str(given), self.security.token):
            _refuse(context, grpc.StatusCode.UNAUTHENTICATED, "wrong or missing token")

    def _parse(
        self, payload: bytes, context: grpc.ServicerContext
    ) -> tuple[dict[str, Any], ArrayRecord | None]:
        try:
            meta, model = _decode(payload)
        except Exception as err:  # a hostile or broken peer: say so, keep serving
            _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"undecodable: {err}")
        if meta.get("federation") != self.federation:
            _refuse(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"federation {meta.get('federation')!r}, expected {self.federation!r}",
            )
        return meta, model

    def _on_deliver(self, payload: bytes, context: grpc.ServicerContext) -> bytes:
        self._authorised(context)
        meta, model = self._parse(payload, context)
        sender, rnd = meta.get("sender"), meta.get("round")
        if not isinstance(sender, int) or sender not in self._inbox:
            _refuse(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"server {sender!r} is not a neighbour of server {self.index}",
            )
        if not isinstance(rnd, int) or model is None:
            _refuse(
                context, grpc.StatusCode.INVALID_ARGUMENT, "no integer round or model"
            )
        with self._cond:
            floor = self._waiting_round
            if rnd < floor:
                if sender in self._absent:
                    # Alive, only late: wait for it in full from the next round,
                    # or a server that rejoined a few seconds behind its
                    # neighbours would stay behind their grace, mixed out for good.
                    self._absent.discard(sender)
                    log(
                        INFO,
                        "P-FedAvg server %d: server %d is alive (its round %d came "
                        "late); the next round waits for it in full",
                        self.index,
                        sender,
                        rnd,
                    )
                return _encode({"status": "stale", "round": floor})
            if rnd > floor + ROUNDS_AHEAD:
                return _encode({"status": "too-early", "round": floor})
            self._inbox[sender][rnd] = (model, len(payload))
            self._cond.notify_all()
        return _encode({"status": "ok", "round": floor})

    def _on_status(self, payload: bytes, context: grpc.ServicerContext) -> bytes:
        self._authorised(context)
        meta, _ = self._parse(payload, context)
        with self._cond:
            if not self._published:
                return _encode({"round": 0, "index": self.index})
            wanted = meta.get("round")
            rnd = max(self._published) if wanted is None else int(wanted)
            model = self._published.get(rnd)
        if model is None:
            return _encode({"round": max(self._published), "index": self.index})
        return _encode({"round": rnd, "index": self.index}, model)

    # --------------------------------------------------------------- sending
    def _call(self, j: int, method: str, payload: bytes, timeout: float) -> bytes:
        call = _unary(self._channels[j], method)
        return bytes(call(payload, timeout=timeout, metadata=self.security.metadata))

    def _deliver(self, j: int, rnd: int, payload: bytes, deadline: float) -> str:
        """Send one model to neighbour ``j``, retrying while it is unreachable."""
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                meta, _ = _decode(self._call(j, "Deliver", payload, remaining))
                return str(meta.get("status"))
            except grpc.RpcError as err:
                code = err.code()  # type: ignore[attr-defined]
                if code == grpc.StatusCode.UNAVAILABLE:
                    with self._cond:
                        self._unreachable.add(j)
                        self._cond.notify_all()
                    if self._stopping.wait(min(0.5, max(remaining, 0.0))):
                        return "unreachable"
                    continue
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return "timeout"
                log(
                    WARNING,
                    "P-FedAvg server %d: round %d: server %d refused the model: %s %s",
                    self.index,
                    rnd,
                    j,
                    code.name,
                    err.details(),  # type: ignore[attr-defined]
                )
                return "refused"
        return "timeout"

    def exchange(
        self, server_round: int, model: ArrayRecord, spec_of_model: Any = None
    ) -> Exchanged:
        """Send ``model`` (:math:`y_i`) to the neighbours; return theirs of this round.

        Waits as the module docstring says; a neighbour's model whose arrays do
        not match ``model``'s keys, shapes and dtypes, or hold NaN or inf, is
        rejected (logged) and counted as missing.
        """
        start = time.monotonic()
        deadline = start + self.timeout
        grace_end = start + self.rejoin_grace
        payload = _encode(
            {
                "federation": self.federation,
                "sender": self.index,
                "round": server_round,
            },
            model,
        )
        with self._cond:
            self._waiting_round = server_round
            self._unreachable = set()
            for inbox in self._inbox.values():  # older rounds can no longer be used
                for rnd in [r for r in inbox if r < server_round]:
                    del inbox[rnd]
        assert self._senders is not None, "start() the exchange first"
        self._sends = [f for f in self._sends if not f.done()] + [
            self._senders.submit(self._deliver, j, server_round, payload, deadline)
            for j in self.neighbours
        ]
        with self._cond:
            while True:
                missing = [
                    j for j in self.neighbours if server_round not in self._inbox[j]
                ]
                now = time.monotonic()
                slow = self._absent | self._unreachable
                awaited = [j for j in missing if j not in slow or now < grace_end]
                if not missing or not awaited or now >= deadline:
                    break
                until = deadline if all(j not in slow for j in awaited) else grace_end
                self._cond.wait(max(0.0, min(until, deadline) - now))
            arrived = {
                j: self._inbox[j].pop(server_round)
                for j in self.neighbours
                if server_round in self._inbox[j]
            }
            self._waiting_round = server_round + 1
        expected = spec_of(model) if spec_of_model is None else spec_of_model
        models, rejected = {}, []
        for j, (record, _) in arrived.items():
            problem = None
            if spec_of(record) != expected:
                problem = "its arrays do not match this server's model"
            elif not record_is_finite(record):
                problem = "it holds NaN or inf"
            if problem is None:
                models[j] = record
                continue
            rejected.append(j)
            log(
                WARNING,
                "P-FedAvg server %d: round %d: model of server %d not used: %s",
                self.index,
                server_round,
                j,
                problem,
            )
        missing = [j for j in self.neighbours if j not in models]
        with self._cond:
            for j in missing:
                if j not in rejected and j not in self._absent:
                    log(
                        WARNING,
                        "P-FedAvg server %d: round %d: no model from server %d "
                        "within %.0f s (%s); mixing without it",
                        self.index,
                        server_round,
                        j,
                        self.timeout
                        if j not in self._unreachable
                        else self.rejoin_grace,
                        "unreachable" if j in self._unreachable else "no delivery",
                    )
            for j in models:
                if j in self._absent:
                    log(INFO, "P-FedAvg server %d: server %d is back", self.index, j)
            self._absent = set(missing)
        return Exchanged(
            models=models,
            missing=missing,
            rejected=rejected,
            bytes_sent=len(payload) * len(self.neighbours),
            bytes_received=sum(size for _, size in arrived.values()),
            seconds=time.monotonic() - start,
        )

    def begin_round(self, server_round: int) -> None:
        """Accept models of ``server_round`` on (older ones are stale from now)."""
        with self._cond:
            self._waiting_round = max(self._waiting_round, server_round)

    def publish(self, server_round: int, model: ArrayRecord) -> None:
        """Keep this round's mixed model :math:`x_i` for ``Status`` calls."""
        with self._cond:
            self._published[server_round] = model
            for rnd in sorted(self._published)[:-KEPT_ROUNDS]:
                del self._published[rnd]

    # ---------------------------------------------------------------- status
    def neighbour_status(
        self, j: int, timeout: float, server_round: int | None = None
    ) -> tuple[int, ArrayRecord | None] | None:
        """Ask neighbour ``j`` for its round and mixed model (None: no answer)."""
        return _ask_status(
            lambda payload: self._call(j, "Status", payload, timeout),
            self.federation,
            server_round,
        )

    def wait_for_neighbours(
        self, timeout: float
    ) -> dict[int, tuple[int, ArrayRecord | None]]:
        """Return the status of every neighbour that answers within ``timeout`` s.

        Polls until all answered or the time is up (servers of one federation
        start at different moments).
        """
        deadline = time.monotonic() + timeout
        answers: dict[int, tuple[int, ArrayRecord | None]] = {}
        while True:
            for j in self.neighbours:
                if j not in answers:
                    remaining = max(0.1, min(2.0, deadline - time.monotonic()))
                    status = self.neighbour_status(j, remaining)
                    if status is not None:
                        answers[j] = status
            if len(answers) == len(self.neighbours) or time.monotonic() >= deadline:
                return answers
            time.sleep(0.5)


def read_status(
    address: str,
    *,
    federation: str = "pfedavg",
    security: PeerSecurity | None = None,
    server_round: int | None = None,
    timeout: float = 5.0,
) -> tuple[int, ArrayRecord | None] | None:
    """Ask the server at ``address`` for its round and mixed model (launcher's read)."""
    security = security or PeerSecurity()
    with open_channel(address, security) as channel:
        call = _unary(channel, "Status")
        return _ask_status(
            lambda payload: bytes(
                call(payload, timeout=timeout, metadata=security.metadata)
            ),
            federation,
            server_round,
        )

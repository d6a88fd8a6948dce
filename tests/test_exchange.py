"""P-FedAvg's server-to-server exchange on loopback: neighbours, deadlines, hostiles, TLS.

Real gRPC servers on 127.0.0.1, one per parameter server, in this process.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import socket
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from flwr.app import ArrayRecord

from flwr_prox_strategies.pfedavg_deploy.exchange import (
    SERVICE,
    TOKEN_METADATA,
    PeerExchange,
    PeerSecurity,
    _encode,
    read_status,
)

from .helpers import record

MB = 1 << 20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def model(value: float, shape=(3, 2)) -> ArrayRecord:
    return record({"w": np.full(shape, value, np.float32), "b": np.arange(2.0)})


@contextlib.contextmanager
def servers(count, started=None, neighbours=None, **kwargs):
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(count)]
    started = range(count) if started is None else started
    exchanges = {}
    try:
        for i in started:
            mine = neighbours[i] if neighbours else [j for j in range(count) if j != i]
            exchanges[i] = PeerExchange(
                index=i, addresses=addresses, neighbours=mine, **kwargs
            )
            exchanges[i].start(4 * MB)
        yield addresses, exchanges
    finally:
        for exchange in exchanges.values():
            exchange.stop()


def run_round(exchanges, rnd, models):
    out = {}

    def one(i):
        out[i] = exchanges[i].exchange(rnd, models[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return out


def values(rec: ArrayRecord) -> float:
    return float(rec["w"].numpy()[0, 0])


def test_every_server_gets_its_neighbours_models_only() -> None:
    # A path 0 - 1 - 2: server 0 never hears from server 2.
    path = {0: [1], 1: [0, 2], 2: [1]}
    with servers(3, neighbours=path, timeout=20) as (_, ex):
        got = run_round(ex, 1, {i: model(i + 1.0) for i in range(3)})
    assert {i: sorted(r.models) for i, r in got.items()} == {0: [1], 1: [0, 2], 2: [1]}
    assert values(got[1].models[0]) == 1.0 and values(got[1].models[2]) == 3.0
    np.testing.assert_array_equal(got[0].models[1]["b"].numpy(), np.arange(2.0))
    assert got[1].bytes_sent > 2 * 6 * 4 and got[1].bytes_received == got[1].bytes_sent
    assert all(not r.missing for r in got.values())


def test_a_dead_neighbour_costs_the_grace_then_rejoins() -> None:
    """Server 2 is down (nothing listens): 0 and 1 wait the 1 s grace, not the
    20 s deadline, mix without it, and take it back when it delivers again."""
    with servers(3, started=[0, 1], timeout=20, rejoin_grace=1.0) as (addresses, ex):
        start = time.monotonic()
        got = run_round(ex, 1, {0: model(1.0), 1: model(2.0)})
        assert time.monotonic() - start < 10
        assert got[0].missing == [2] and sorted(got[0].models) == [1]
        got = run_round(ex, 2, {0: model(1.0), 1: model(2.0)})
        assert got[1].missing == [2]
        back = PeerExchange(index=2, addresses=addresses, neighbours=[0, 1], timeout=20)
        back.start(4 * MB)
        back.begin_round(3)
        try:
            ex[2] = back
            got = run_round(ex, 3, {0: model(1.0), 1: model(2.0), 2: model(3.0)})
        finally:
            back.stop()
    assert all(not r.missing for r in got.values())
    assert values(got[0].models[2]) == 3.0


def test_a_neighbour_late_behind_the_grace_is_waited_for_once_heard() -> None:
    """Server 1 rejoined 2 s behind server 0 (grace 0.5 s): its round-1 model comes
    after server 0 closed round 1; from then on server 0 waits for it in full, so
    round 2 has it although it is 2 s late again (not mixed out for good)."""
    with servers(2, timeout=20, rejoin_grace=0.5) as (_, ex):
        ex[0]._absent = {1}  # as after a round it missed
        late = {}

        def lagging(rnd):
            time.sleep(2.0)
            late[rnd] = ex[1].exchange(rnd, model(2.0))

        thread = threading.Thread(target=lagging, args=(1,))
        thread.start()
        first = ex[0].exchange(1, model(1.0))
        thread.join(30)
        assert first.missing == [1]  # 0.5 s grace: round 1 goes on without it
        deadline = time.monotonic() + 10  # server 1's send is asynchronous
        while 1 in ex[0]._absent and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 1 not in ex[0]._absent  # its stale round-1 model says it is alive
        thread = threading.Thread(target=lagging, args=(2,))
        thread.start()
        start = time.monotonic()
        second = ex[0].exchange(2, model(1.0))
        thread.join(30)
    assert second.missing == [] and values(second.models[1]) == 2.0
    assert 1.5 < time.monotonic() - start < 15


def test_a_silent_neighbour_is_left_out_at_the_deadline() -> None:
    # Server 1 listens but never sends: server 0 waits the deadline, 1.5 s.
    with servers(2, timeout=1.5) as (_, ex):
        start = time.monotonic()
        got = ex[0].exchange(1, model(1.0))
        elapsed = time.monotonic() - start
    assert got.missing == [1] and not got.models
    assert 1.4 <= elapsed < 5


def test_an_early_model_waits_in_the_mailbox_and_a_stale_one_is_refused() -> None:
    with servers(2, timeout=5) as (_, ex):
        ex[1].begin_round(2)
        threading.Thread(target=ex[1].exchange, args=(2, model(2.0))).start()
        time.sleep(0.5)  # server 1's round-2 model reaches 0 before 0 is at round 2
        first = ex[0].exchange(1, model(1.0))  # server 1 sent nothing for round 1
        second = ex[0].exchange(2, model(1.5))
        assert first.missing == [1] and values(second.models[1]) == 2.0
        # Round 1 is over for server 1: a late model of it is stale.
        assert (
            ex[0]._deliver(1, 1, _encode(_meta(0, 1), model(9.0)), time.monotonic() + 5)
            == "stale"
        )


def _meta(sender, rnd, federation="pfedavg"):
    return {"federation": federation, "sender": sender, "round": rnd}


def _raw_call(address, payload, metadata=()):
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            f"/{SERVICE}/Deliver",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        return call(payload, timeout=5, metadata=metadata)


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"\x00garbage\xff", grpc.StatusCode.INVALID_ARGUMENT),
        (_encode(_meta(7, 1), model(1.0)), grpc.StatusCode.PERMISSION_DENIED),
        (
            _encode(_meta(1, 1, "another"), model(1.0)),
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        (_encode(_meta(1, 1)), grpc.StatusCode.INVALID_ARGUMENT),  # no model
        (
            _encode({"federation": "pfedavg", "sender": 1, "round": "1"}, model(1.0)),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ],
)
def test_a_hostile_delivery_is_refused_and_the_server_goes_on(payload, code) -> None:
    with servers(2, timeout=3) as (addresses, ex):
        with pytest.raises(grpc.RpcError) as err:
            _raw_call(addresses[0], payload)
        assert err.value.code() == code
        got = run_round(ex, 1, {0: model(1.0), 1: model(2.0)})
    assert values(got[0].models[1]) == 2.0


@pytest.mark.parametrize("bad", ["shape", "nan", "dtype"])
def test_a_model_that_does_not_match_is_not_used(bad) -> None:
    wrong = {
        "shape": model(2.0, shape=(2, 2)),
        "nan": model(float("nan")),
        "dtype": record({"w": np.full((3, 2), 2.0), "b": np.arange(2.0)}),
    }[bad]
    with servers(2, timeout=5) as (_, ex):
        got = run_round(ex, 1, {0: model(1.0), 1: wrong})
    assert got[0].missing == [1] and got[0].rejected == [1]


def test_a_token_is_required_when_set() -> None:
    security = PeerSecurity(token="s3cret")
    with servers(2, timeout=5, security=security) as (addresses, ex):
        for metadata in ((), ((TOKEN_METADATA, "wrong"),)):
            with pytest.raises(grpc.RpcError) as err:
                _raw_call(addresses[0], _encode(_meta(1, 1), model(1.0)), metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        got = run_round(ex, 1, {0: model(1.0), 1: model(2.0)})
        assert not got[0].missing
        assert read_status(addresses[0], security=PeerSecurity()) is None
        ex[0].publish(1, model(5.0))
        rnd, latest = read_status(addresses[0], security=security)
    assert rnd == 1 and values(latest) == 5.0


def test_status_gives_the_last_kept_rounds() -> None:
    with servers(1) as (addresses, ex):
        assert read_status(addresses[0]) == (0, None)
        for rnd in range(1, 6):
            ex[0].publish(rnd, model(float(rnd)))
        rnd, latest = read_status(addresses[0])
        assert rnd == 5 and values(latest) == 5.0
        assert values(read_status(addresses[0], server_round=3)[1]) == 3.0
        assert read_status(addresses[0], server_round=1) == (5, None)  # not kept


def make_mtls(folder: Path) -> tuple[Path, list[tuple[Path, Path]]]:
    """A CA and two server certificates for 127.0.0.1, for server and client auth."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(text):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    def key_pem(key):
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("test CA"))
        .issuer_name(name("test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    (folder / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pairs = []
    for i in range(2):
        key = ec.generate_private_key(ec.SECP384R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(f"server-{i}"))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        pem, key_file = folder / f"server{i}.pem", folder / f"server{i}.key"
        pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(key_pem(key))
        pairs.append((pem, key_file))
    return folder / "ca.pem", pairs


def test_mutual_tls_between_servers(tmp_path) -> None:
    ca, pairs = make_mtls(tmp_path)
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    ex = {}
    try:
        for i, (cert, key) in enumerate(pairs):
            security = PeerSecurity.from_files(
                root_certificates=ca, certificate=cert, private_key=key
            )
            assert security.tls and "mutual TLS" in security.describe()
            ex[i] = PeerExchange(
                index=i,
                addresses=addresses,
                neighbours=[1 - i],
                timeout=10,
                security=security,
            )
            ex[i].start(4 * MB)
        got = run_round(ex, 1, {0: model(1.0), 1: model(2.0)})
        assert values(got[0].models[1]) == 2.0 and values(got[1].models[0]) == 1.0
        # Without a certificate, or in plain text, nothing gets through.
        with pytest.raises(grpc.RpcError):
            _raw_call(addresses[0], _encode(_meta(1, 1), model(1.0)))
        assert read_status(addresses[0]) is None
    finally:
        for exchange in ex.values():
            exchange.stop()


def test_security_needs_all_three_tls_files_or_none() -> None:
    with pytest.raises(ValueError, match="together"):
        PeerSecurity(root_certificates=b"x")
    with pytest.raises(ValueError, match="index 3 outside"):
        PeerExchange(index=3, addresses=["a:1"], neighbours=[])
    with pytest.raises(ValueError, match="neighbours"):
        PeerExchange(index=0, addresses=["a:1", "b:2"], neighbours=[0])


def test_a_taken_address_is_refused_not_shared() -> None:
    # gRPC's default SO_REUSEPORT would let a second server bind the same port and
    # the kernel split the neighbours' calls between two federations.
    with servers(2) as (addresses, _):
        twin = PeerExchange(index=0, addresses=addresses, neighbours=[1])
        with pytest.raises(RuntimeError, match="cannot listen on"):
            twin.start(4 * MB)

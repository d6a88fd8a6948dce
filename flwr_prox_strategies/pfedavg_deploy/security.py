"""Security of P-FedAvg's server-to-server links: mutual TLS and a shared token.

Without certificates nothing between servers is encrypted (loopback, trusted
networks). With ``root_certificates``, ``certificate`` and ``private_key``,
every connection is mutual TLS: the models and metadata are encrypted, each
server proves itself with a certificate signed by the federation's CA, and a
caller without one is refused by the TLS handshake. A shared ``token`` (sent as
call metadata, compared in constant time by :mod:`.exchange`) adds a check on
top; without TLS it travels in the clear.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

TOKEN_METADATA = "x-pfedavg-token"


@dataclass(frozen=True)
class PeerSecurity:
    """Credentials of the server-to-server links (see the module docstring).

    Attributes
    ----------
    root_certificates : bytes | None
        PEM of the CA that signed every server's certificate.
    certificate, private_key : bytes | None
        PEM of this server's certificate (valid for its address, for both server
        and client authentication) and key.
    token : str | None
        Shared secret every call must carry.
    """

    root_certificates: bytes | None = None
    certificate: bytes | None = None
    private_key: bytes | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        given = [
            x is not None
            for x in (self.root_certificates, self.certificate, self.private_key)
        ]
        if any(given) and not all(given):
            raise ValueError(
                "TLS between servers needs root_certificates, certificate and "
                "private_key together (mutual TLS), or none of them"
            )
        if self.token is not None and not self.token:
            raise ValueError("token must be a non-empty string or None")

    @property
    def tls(self) -> bool:
        """True when the links are mutual TLS."""
        return self.root_certificates is not None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata every call carries: the token, when there is one."""
        return () if self.token is None else ((TOKEN_METADATA, self.token),)

    @classmethod
    def from_files(
        cls,
        *,
        root_certificates: str | Path | None = None,
        certificate: str | Path | None = None,
        private_key: str | Path | None = None,
        token_file: str | Path | None = None,
    ) -> PeerSecurity:
        """Read the credentials from PEM files (and a token file), None: unset."""

        def read(path: str | Path | None) -> bytes | None:
            return None if path in (None, "") else Path(str(path)).read_bytes()

        token = read(token_file)
        return cls(
            root_certificates=read(root_certificates),
            certificate=read(certificate),
            private_key=read(private_key),
            token=None if token is None else token.decode().strip(),
        )

    def describe(self) -> str:
        """Say in words what is and is not protected."""
        if self.tls:
            return "mutual TLS (models encrypted, servers authenticated by the CA)"
        return "no TLS: models and metadata travel unencrypted" + (
            " (the token in the clear too)" if self.token else ""
        )


def open_channel(
    address: str, security: PeerSecurity, options: list[tuple[str, Any]] | None = None
) -> grpc.Channel:
    """Open a channel to a server's exchange with the federation's credentials."""
    if security.tls:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=security.root_certificates,
            private_key=security.private_key,
            certificate_chain=security.certificate,
        )
        return grpc.secure_channel(address, credentials, options=options)
    return grpc.insecure_channel(address, options=options)

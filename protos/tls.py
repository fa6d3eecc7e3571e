"""TLS for every port: one value, read from the same flags / environment variables on
every command, turned into gRPC credentials and the bulk channel's ssl contexts.

A server needs its certificate and key; with `require_client_cert` (mTLS) it also
needs the CA that signed its clients'. A client needs the CA that signed the
servers' certificates (or none: the system's roots), and its own certificate and
key when the servers require one. The same-host paths (Unix socket, shared memory)
never use TLS: they do not leave the host, and the peer is checked by its ticket.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from .errors import InvalidArgument

ENV = {
    "cert_file": "PAGEDKV_TLS_CERT",
    "key_file": "PAGEDKV_TLS_KEY",
    "ca_file": "PAGEDKV_TLS_CA",
    "require_client_cert": "PAGEDKV_TLS_CLIENT_AUTH",
    "server_name": "PAGEDKV_TLS_SERVER_NAME",
}


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"TLS {what} {path}: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class TlsConfig:
    cert_file: str = ""  # PEM chain of this side's certificate (a server's; a client's under mTLS)
    key_file: str = ""  # PEM private key of cert_file
    ca_file: str = ""  # PEM CA bundle that verifies the peer ("" on a client: the system's roots)
    require_client_cert: bool = False  # server: mutual TLS, clients must present a cert ca_file signed
    server_name: str = ""  # client: the name expected in servers' certificates (default: the host dialled)

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise InvalidArgument("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
        if self.require_client_cert and not self.ca_file:
            raise InvalidArgument("mutual TLS (--tls-client-auth require) needs --tls-ca to verify clients")
        for path, what in ((self.cert_file, "certificate"), (self.key_file, "key"), (self.ca_file, "CA")):
            if path:
                _read(path, what)  # fail at start, naming the file, not at the first connection

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TlsConfig | None:
        """The PAGEDKV_TLS_* variables' config; None when none is set (plaintext)."""
        env = os.environ if environ is None else environ
        values = {name: env.get(var, "") for name, var in ENV.items()}
        if not any(values.values()):
            return None
        auth = values.pop("require_client_cert").lower()
        if auth not in ("", "none", "require"):
            raise InvalidArgument(f"$PAGEDKV_TLS_CLIENT_AUTH {auth!r}: 'none' or 'require'")
        return cls(**values, require_client_cert=auth == "require")

    @property
    def can_serve(self) -> bool:
        return bool(self.cert_file)

    def _pair(self) -> tuple[bytes, bytes] | tuple[None, None]:
        if not self.cert_file:
            return None, None
        return _read(self.key_file, "key"), _read(self.cert_file, "certificate")

    def _ca(self) -> bytes | None:
        return _read(self.ca_file, "CA") if self.ca_file else None

    # -- gRPC ---------------------------------------------------------------------

    def server_credentials(self) -> grpc.ServerCredentials:
        if not self.can_serve:
            raise InvalidArgument("a TLS server needs --tls-cert and --tls-key")
        key, cert = self._pair()
        assert key is not None and cert is not None
        return grpc.ssl_server_credentials(
            [(key, cert)],
            root_certificates=self._ca() if self.require_client_cert else None,
            require_client_auth=self.require_client_cert,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        key, cert = self._pair()
        return grpc.ssl_channel_credentials(
            root_certificates=self._ca(), private_key=key, certificate_chain=cert
        )

    def channel_options(self) -> list[tuple[str, object]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    # -- the bulk channel's TCP socket -----------------------------------------------

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert_file, self.key_file)
        if self.require_client_cert:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(self.ca_file)
        return ctx

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file or None)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


def secure_channel(
    address: str, tls: TlsConfig | None, options: list[tuple[str, object]] | None = None
) -> grpc.Channel:
    """A gRPC channel to address: TLS when `tls` is given, else plaintext."""
    opts = list(options or ())
    if tls is None:
        return grpc.insecure_channel(address, options=opts)
    return grpc.secure_channel(address, tls.channel_credentials(), options=opts + tls.channel_options())

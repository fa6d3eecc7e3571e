"""`pagedkv health HOST:PORT`: exit 0 when the server's gRPC health service
reports SERVING (for docker healthchecks and scripts), 1 otherwise. Over TLS when
the PAGEDKV_TLS_* variables (or --tls-* flags) say so, as the server reads them."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .protos.tls import TlsConfig, secure_channel
from .trust_args import add_trust_args, tls_from_args
from .usage import Parser, run


def check(address: str, service: str = "", timeout_s: float = 2.0, tls: TlsConfig | None = None) -> str:
    """The serving status name, or 'UNREACHABLE'."""
    with secure_channel(address, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="pagedkv health", description=__doc__)
    parser.add_argument("address", help="host:port of a pagedkv node or coordinator")
    parser.add_argument("--service", default="", help="service name to ask about ('' = the whole server)")
    parser.add_argument("--timeout-s", type=float, default=2.0, help="deadline of the check (default 2)")
    add_trust_args(parser, secret=False)
    args = parser.parse_args(argv)
    tls: list[TlsConfig | None] = []
    run("pagedkv health", lambda: tls.append(tls_from_args(args)))
    # (a server's own cert and key make a client cert: mTLS servers probe themselves this way)
    status = check(args.address, args.service, args.timeout_s, tls[0])
    print(status)
    raise SystemExit(0 if status == "SERVING" else 1)

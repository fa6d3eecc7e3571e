"""One set of security flags for every command (node, coordinator, up, demo, status,
health), each with its PAGEDKV_* environment variable, so a container is configured
by env alone and every process of a cluster reads the same names.

    --cluster-secret-file PATH  [PAGEDKV_CLUSTER_SECRET_FILE, or the value itself in
                                 PAGEDKV_CLUSTER_SECRET]  the coordinator's and the
                                 nodes' shared secret: tickets, node authentication
    --tls-cert PATH --tls-key PATH  [PAGEDKV_TLS_CERT, PAGEDKV_TLS_KEY]  this process's
                                 certificate: a server's, or a client's under mTLS
    --tls-ca PATH               [PAGEDKV_TLS_CA]  the CA that verifies peers
    --tls-client-auth none|require  [PAGEDKV_TLS_CLIENT_AUTH]  servers: mutual TLS
    --tls-server-name NAME      [PAGEDKV_TLS_SERVER_NAME]  clients: the name expected
                                 in servers' certificates (default: the host dialled)

A mistake (a missing file, a short secret, a key without a certificate) is one line
and exit code 2, before anything starts (usage.py). Imports neither torch nor a role.
"""

from __future__ import annotations

import argparse
import os

from .protos.errors import InvalidArgument
from .protos.tickets import SECRET_ENV, SECRET_FILE_ENV, ClusterKeys
from .protos.tls import ENV as TLS_ENV
from .protos.tls import TlsConfig
from .usage import UsageError


def add_trust_args(p: argparse.ArgumentParser, *, secret: bool = True) -> None:
    env = os.environ.get
    g = p.add_argument_group(
        "security (deploy/README.md, Security; every flag also reads its PAGEDKV_* variable)"
    )
    if secret:
        g.add_argument(
            "--cluster-secret-file",
            default=env(SECRET_FILE_ENV, ""),
            help=f"the cluster secret shared by the coordinator and the nodes, one key per line (the first "
            f"signs, every one verifies: rotation) [{SECRET_FILE_ENV}; or the value in ${SECRET_ENV}]",
        )
    g.add_argument(
        "--tls-cert", default=env(TLS_ENV["cert_file"], ""), help="PEM certificate chain [PAGEDKV_TLS_CERT]"
    )
    g.add_argument(
        "--tls-key", default=env(TLS_ENV["key_file"], ""), help="PEM private key [PAGEDKV_TLS_KEY]"
    )
    g.add_argument(
        "--tls-ca",
        default=env(TLS_ENV["ca_file"], ""),
        help="PEM CA bundle that verifies peers (clients: the servers'; servers under mTLS: the clients') "
        "[PAGEDKV_TLS_CA]",
    )
    g.add_argument(
        "--tls-client-auth",
        choices=["none", "require"],
        default=env(TLS_ENV["require_client_cert"], "") or "none",
        help="require: servers accept only clients with a certificate --tls-ca signed (mTLS) "
        "[PAGEDKV_TLS_CLIENT_AUTH]",
    )
    g.add_argument(
        "--tls-server-name",
        default=env(TLS_ENV["server_name"], ""),
        help="the name expected in servers' certificates (default: the host dialled) "
        "[PAGEDKV_TLS_SERVER_NAME]",
    )


def tls_from_args(args: argparse.Namespace, *, server: bool = False) -> TlsConfig | None:
    """The TLS config of the flags; None when no TLS flag is set. A server needs a
    certificate and key (UsageError otherwise)."""
    if not (args.tls_cert or args.tls_key or args.tls_ca or args.tls_client_auth == "require"):
        return None
    try:
        tls = TlsConfig(
            args.tls_cert,
            args.tls_key,
            args.tls_ca,
            args.tls_client_auth == "require",
            args.tls_server_name,
        )
    except InvalidArgument as exc:
        raise UsageError(str(exc)) from None
    if server and not tls.can_serve:
        raise UsageError("TLS on this server needs --tls-cert and --tls-key (a CA alone verifies peers)")
    return tls


def keys_from_args(args: argparse.Namespace) -> ClusterKeys | None:
    """The cluster secret of --cluster-secret-file or $PAGEDKV_CLUSTER_SECRET; None when unset."""
    try:
        return ClusterKeys.from_env(path=args.cluster_secret_file)
    except InvalidArgument as exc:
        raise UsageError(f"{exc} (--cluster-secret-file / ${SECRET_ENV})") from None


def trust_env(args: argparse.Namespace) -> dict[str, str]:
    """The PAGEDKV_* variables that hand these flags to a child process (pagedkv up)."""
    out = {
        TLS_ENV["cert_file"]: args.tls_cert,
        TLS_ENV["key_file"]: args.tls_key,
        TLS_ENV["ca_file"]: args.tls_ca,
        TLS_ENV["require_client_cert"]: args.tls_client_auth if args.tls_client_auth == "require" else "",
        TLS_ENV["server_name"]: args.tls_server_name,
    }
    if getattr(args, "cluster_secret_file", ""):
        out[SECRET_FILE_ENV] = args.cluster_secret_file
    return {k: v for k, v in out.items() if v}

"""Who is calling the coordinator, and what it hands out.

Workers: the tenants file (JSON) maps bearer tokens to tenants and tenants to
quotas:

    {"tokens": {"s3cret-token": "acme"}, "quotas": {"acme": 4096}}

With no tokens configured, authentication is off and every caller is the
tenant "default" (a local cluster). The tenant comes from the
`authorization: Bearer <token>` metadata, never from a request field; with
tenants configured, sequence ids are the tenant's own (`scoped`): the coordinator
and the nodes know a sequence by "tenant/id", so another tenant's id answers
exactly as one nobody opened.

Nodes and the cluster secret (`ClusterAccess`): with a cluster secret
(protos/tickets.py) a node's calls must carry a NODE ticket for its own id, the
coordinator's calls to a node carry an ADMIN ticket for that node's registration,
and every open, fork, describe and swap-in hands the worker a ticket for the
sequence on its node. TLS (protos/tls.py) covers the coordinator's channels to
the nodes; its own port is the server's business (service.create_server).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from ..protos import pagedkv_pb2 as pb
from ..protos.errors import InvalidArgument, PermissionDenied, Unauthenticated
from ..protos.tickets import (
    RIGHT_ADMIN,
    RIGHT_DATA,
    RIGHT_NODE,
    TICKET_KEY,
    ClusterKeys,
    Minter,
    Ticket,
    Verifier,
    bearer_in,
    issue,
    order_tag,
    seal_salt,
    tickets_in,
)
from ..protos.tls import TlsConfig, secure_channel
from .records import NodeInfo

DEFAULT_TENANT = "default"
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # never "/": it scopes sequence ids
DEFAULT_TICKET_TTL_S = 24 * 3600.0
# An open order is sent on at once; its life covers clock skew between hosts, and bounds
# how long a node must remember it was used (a replay is refused).
ORDER_TTL_S = 300.0


@dataclass(frozen=True)
class Tenants:
    tokens: Mapping[str, str] = field(default_factory=dict)  # bearer token -> tenant
    quotas: Mapping[str, int] = field(default_factory=dict)  # tenant -> max blocks

    @classmethod
    def load(cls, path: str | Path | None) -> Tenants:
        if not path:
            return cls()
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"tenants file {path}: {exc}") from None
        if not isinstance(raw, dict):
            raise InvalidArgument(f"tenants file {path}: expected a JSON object with 'tokens' and 'quotas'")
        tokens, quotas = raw.get("tokens", {}), raw.get("quotas", {})
        if not isinstance(tokens, dict) or not all(isinstance(v, str) and v for v in tokens.values()):
            raise InvalidArgument(f"tenants file {path}: 'tokens' must map token strings to tenant names")
        if not isinstance(quotas, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in quotas.values()
        ):
            raise InvalidArgument(f"tenants file {path}: 'quotas' must map tenants to block counts >= 0")
        for name in {*tokens.values(), *quotas}:
            if not TENANT_NAME.fullmatch(name):
                raise InvalidArgument(
                    f"tenants file {path}: tenant name {name!r}: letters, digits, '.', '_', '-' only "
                    "(at most 128, no '/')"
                )
        return cls(dict(tokens), dict(quotas))

    @property
    def is_enabled(self) -> bool:
        return bool(self.tokens)

    def tenant_for(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The calling tenant; Unauthenticated when auth is on and the token is missing or unknown."""
        if not self.is_enabled:
            return DEFAULT_TENANT
        token = bearer_in(metadata)
        if token is None:
            raise Unauthenticated("missing 'authorization: Bearer <token>' metadata")
        tenant = self.tokens.get(token)
        if tenant is None:
            raise Unauthenticated("unknown bearer token")
        return tenant

    def scoped(self, tenant: str, seq_id: str) -> str:
        """The id the coordinator and the nodes know a tenant's sequence by."""
        return f"{tenant}/{seq_id}" if self.is_enabled else seq_id


class ClusterAccess:
    """The coordinator's side of the cluster secret and of TLS to the nodes. Without
    a secret every method is a no-op (a trusted network: no tickets)."""

    def __init__(
        self,
        keys: ClusterKeys | None = None,
        tls: TlsConfig | None = None,
        *,
        ticket_ttl_s: float = DEFAULT_TICKET_TTL_S,
    ) -> None:
        if not ticket_ttl_s > 0:
            raise InvalidArgument(f"ticket_ttl_s must be > 0, got {ticket_ttl_s}")
        self.keys, self.tls, self.ticket_ttl_s = keys, tls, ticket_ttl_s
        self._verifier = None if keys is None else Verifier(keys)
        self._admin = None if keys is None else Minter(keys, ttl_s=600.0)

    @property
    def is_secure(self) -> bool:
        return self.keys is not None

    def channel(self, address: str, options: list[tuple[str, object]] | None = None) -> grpc.Channel:
        return secure_channel(address, self.tls, options)

    def node_metadata(self, node: NodeInfo) -> tuple[tuple[str, bytes], ...]:
        """The ADMIN ticket of this coordinator's calls to `node` (its current registration)."""
        if self._admin is None:
            return ()
        return ((TICKET_KEY, self._admin.get(RIGHT_ADMIN, node.node_id, node.epoch)),)

    def ticket(self, tenant: str, seq_id: str, node: NodeInfo | None) -> bytes:
        """A worker's ticket for sequence `seq_id` (the node's id of it) on `node`; b"" without
        a secret or a live node."""
        if self.keys is None or node is None:
            return b""
        expires = int(time.time() + self.ticket_ttl_s)
        return issue(self.keys, Ticket(RIGHT_DATA, expires, node.epoch, tenant, seq_id, node.node_id))

    def sign_open(self, request: pb.OpenRequest, node: NodeInfo) -> pb.SignedOpen:
        """The node Open a worker carries (CoordOpenRequest.worker_opens): `request`
        serialized and, with a secret, signed for the node's registration."""
        expires = int(time.time() + ORDER_TTL_S)
        if self.keys is None:
            order, tag = request.SerializeToString(), b""
        else:  # the worker carries the order but never reads its tenant's salt
            where = (node.node_id, node.epoch, expires, request.seq_id)
            request.tenant_salt = seal_salt(self.keys, request.tenant_salt, *where)
            order = request.SerializeToString()
            tag = order_tag(self.keys, order, node.node_id, node.epoch, expires)
        return pb.SignedOpen(order=order, tag=tag, expires_at=expires, epoch=node.epoch, node_id=node.node_id)

    def check_node(
        self, metadata: Iterable[tuple[str, str | bytes]] | None, node_id: str, method: str
    ) -> None:
        """A node's call: a live NODE ticket for `node_id`, signed with the cluster secret."""
        if self._verifier is None:
            return
        raws = tickets_in(metadata)
        if not raws:
            raise Unauthenticated(f"{method} is for cache nodes: the call carries no cluster credential")
        t = self._verifier.verify(raws[0])
        if not t.rights & RIGHT_NODE:
            raise PermissionDenied(f"{method} is for cache nodes: the credential is not a node's")
        if t.node_id != node_id:
            raise PermissionDenied(f"{method}: a credential of node {t.node_id!r} used for node {node_id!r}")
        if t.expires_at < time.time():
            raise Unauthenticated(f"{method}: the node credential expired (clock skew?)")

"""Capabilities: what the coordinator signs and a node checks (DESIGN.md, Trust).

The coordinator and the nodes share a cluster secret: one or more keys, the first
signs and every one verifies, so a key is rotated by adding the new one second
everywhere, then moving it first, then dropping the old one (deploy/README.md).

A ticket is a short signed statement, HMAC-SHA256 (truncated to 128 bits) over

    rights | expiry | the node's registration epoch | tenant | sequence | node

Three kinds, by their rights (and one signed statement that is not a ticket: the open
order a worker carries from the coordinator to a node, `order_tag`):
- READ / WRITE on one sequence of one node's registration: what a worker presents
  on every data call (the coordinator issues it on open, fork, describe, swap-in);
- ADMIN on one node's registration: the coordinator's own calls to that node
  (Open with the tenant's salt, Fork, Free, swaps, pins);
- NODE: a node speaking to the coordinator (Register, Heartbeat, ReportEvents,
  Reserve), minted by the node itself.

Checking is cheap on the hot path: `Verifier.verify` computes the MAC once per
distinct ticket and remembers the result, so a call carrying a ticket seen before
costs a dictionary lookup (a node checks expiry and epoch per use, two compares).
Pure functions and data: both sides import this module.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from .errors import InvalidArgument, Unauthenticated

RIGHT_READ, RIGHT_WRITE, RIGHT_ADMIN, RIGHT_NODE = 1, 2, 4, 8
RIGHT_DATA = RIGHT_READ | RIGHT_WRITE
TICKET_KEY = "pagedkv-ticket-bin"  # gRPC metadata, one value per ticket ("-bin": raw bytes)
SECRET_ENV, SECRET_FILE_ENV = "PAGEDKV_CLUSTER_SECRET", "PAGEDKV_CLUSTER_SECRET_FILE"
MIN_SECRET_BYTES = 32
MAC_BYTES = 16
KEY_ID_BYTES = 4
MAX_TICKET_BYTES = 4096
_MAGIC = b"PKT1"
_HEAD = struct.Struct("<4sBQQHHH")  # magic, rights, expires_at (unix s), epoch, len(tenant, seq, node)


class ClusterKeys:
    """The cluster secret: keys[0] signs, every key verifies (rotation). Each key is
    at least MIN_SECRET_BYTES bytes; a ticket names its key by a 4-byte id."""

    def __init__(self, secrets: Sequence[bytes]) -> None:
        keys = [bytes(s) for s in secrets]
        if not keys:
            raise InvalidArgument("the cluster secret holds no key")
        for key in keys:
            if len(key) < MIN_SECRET_BYTES:
                raise InvalidArgument(
                    f"a cluster secret key of {len(key)} bytes is too short (at least {MIN_SECRET_BYTES}: "
                    "e.g. `openssl rand -hex 32`)"
                )
        self._by_id = {_key_id(k): k for k in keys}
        if len(self._by_id) != len(keys):
            raise InvalidArgument("the cluster secret lists the same key twice")
        self._signing_id = _key_id(keys[0])
        self._signing = keys[0]

    @classmethod
    def from_text(cls, text: str, where: str = "the cluster secret") -> ClusterKeys:
        """One key per line (or comma-separated), blank lines and '#' comments ignored."""
        keys = [
            part.strip().encode()
            for line in text.splitlines()
            if not line.strip().startswith("#")
            for part in line.split(",")
            if part.strip()
        ]
        try:
            return cls(keys)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{where}: {exc}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> ClusterKeys:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"cluster secret file {path}: {exc}") from None
        return cls.from_text(text, f"cluster secret file {path}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, path: str = "") -> ClusterKeys | None:
        """The keys of `path`, else of $PAGEDKV_CLUSTER_SECRET_FILE, else of
        $PAGEDKV_CLUSTER_SECRET; None when none is set (no cluster secret)."""
        env = os.environ if environ is None else environ
        path = path or env.get(SECRET_FILE_ENV, "")
        if path:
            return cls.from_file(path)
        value = env.get(SECRET_ENV, "")
        return cls.from_text(value, f"${SECRET_ENV}") if value else None

    @property
    def num_keys(self) -> int:
        return len(self._by_id)

    def mac(self, body: bytes) -> bytes:
        """key id + MAC of body under the signing key."""
        return self._signing_id + _mac(self._signing, body)

    @property
    def signing_key(self) -> bytes:
        return self._signing

    def key_of(self, tag: bytes) -> bytes | None:
        """The key a tag (key id + MAC) names, if it is one of these."""
        return self._by_id.get(tag[:KEY_ID_BYTES])

    def check(self, body: bytes, tag: bytes) -> bool:
        """True when tag (key id + MAC) is body's MAC under one of the keys."""
        key = self._by_id.get(tag[:KEY_ID_BYTES])
        return key is not None and hmac.compare_digest(_mac(key, body), tag[KEY_ID_BYTES:])


def _key_id(key: bytes) -> bytes:
    return hashlib.sha256(b"pagedkv key id\0" + key).digest()[:KEY_ID_BYTES]


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()[:MAC_BYTES]


class Ticket(NamedTuple):
    """What a ticket says. seq_id is the id the node knows the sequence by (tenant-
    scoped in a cluster); "" in ADMIN and NODE tickets."""

    rights: int
    expires_at: int  # unix seconds
    epoch: int  # the node's registration epoch (0 in NODE tickets)
    tenant: str
    seq_id: str
    node_id: str

    def covers(self, rights: int) -> bool:
        return self.rights & rights == rights


def issue(keys: ClusterKeys, ticket: Ticket) -> bytes:
    """The signed bytes of `ticket`; InvalidArgument for a field the format cannot carry."""
    try:
        texts = [s.encode() for s in (ticket.tenant, ticket.seq_id, ticket.node_id)]
        body = _HEAD.pack(_MAGIC, ticket.rights, ticket.expires_at, ticket.epoch, *map(len, texts))
    except (struct.error, UnicodeEncodeError, AttributeError) as exc:
        raise InvalidArgument(f"cannot issue ticket {ticket}: {exc}") from None
    body += b"".join(texts)
    return body + keys.mac(body)


def parse(raw: bytes) -> Ticket:
    """A ticket's fields WITHOUT checking its MAC (a client reads its own tickets'
    expiry this way); InvalidArgument when malformed."""
    try:
        magic, rights, expires_at, epoch, *lens = _HEAD.unpack_from(raw, 0)
        if magic != _MAGIC:
            raise ValueError("not a pagedkv ticket")
        at, texts = _HEAD.size, []
        for n in lens:
            texts.append(raw[at : at + n].decode())
            at += n
        if len(raw) != at + KEY_ID_BYTES + MAC_BYTES:
            raise ValueError(f"{len(raw)} bytes, its fields take {at + KEY_ID_BYTES + MAC_BYTES}")
    except (struct.error, ValueError, UnicodeDecodeError, TypeError) as exc:
        raise InvalidArgument(f"malformed ticket: {exc}") from None
    return Ticket(rights, expires_at, epoch, *texts)


class Verifier:
    """Checks tickets against the cluster keys, remembering the ones that passed
    (`capacity` at most: the oldest are forgotten first), so a ticket is MACed
    once however often it is presented. Thread-safe."""

    def __init__(self, keys: ClusterKeys, capacity: int = 65536) -> None:
        self.keys = keys
        self._seen: dict[bytes, Ticket] = {}
        self._capacity = capacity
        self._lock = threading.Lock()

    def verify(self, raw: bytes) -> Ticket:
        """The ticket's fields; Unauthenticated when it is malformed or not signed by
        a cluster key. Expiry, node and epoch are the caller's to check."""
        ticket = self._seen.get(raw)
        if ticket is not None:
            return ticket
        if not isinstance(raw, bytes) or len(raw) > MAX_TICKET_BYTES:
            raise Unauthenticated("malformed ticket")
        try:
            ticket = parse(raw)
        except InvalidArgument as exc:
            raise Unauthenticated(str(exc)) from None
        cut = len(raw) - KEY_ID_BYTES - MAC_BYTES
        if not self.keys.check(raw[:cut], raw[cut:]):
            raise Unauthenticated("ticket not signed by this cluster's key (forged, or another cluster's)")
        with self._lock:
            if len(self._seen) >= self._capacity:
                for old in list(self._seen)[: self._capacity // 4]:
                    del self._seen[old]
            self._seen[raw] = ticket
        return ticket


class Minter:
    """Tickets this side signs, made once and reused until half their life is gone
    (the node's NODE ticket, the coordinator's ADMIN ticket per node registration)."""

    def __init__(self, keys: ClusterKeys, ttl_s: float) -> None:
        self.keys, self.ttl_s = keys, ttl_s
        self._made: dict[tuple[int, int, str, str, str], tuple[bytes, float]] = {}
        self._lock = threading.Lock()

    def get(self, rights: int, node_id: str, epoch: int = 0, tenant: str = "", seq_id: str = "") -> bytes:
        key = (rights, epoch, node_id, tenant, seq_id)
        now = time.time()
        made = self._made.get(key)
        if made is not None and made[1] > now:
            return made[0]
        raw = issue(self.keys, Ticket(rights, int(now + self.ttl_s), epoch, tenant, seq_id, node_id))
        with self._lock:
            if len(self._made) > 4096:
                self._made.clear()
            self._made[key] = (raw, now + self.ttl_s / 2)
        return raw


_ORDER_HEAD = struct.Struct("<8sqQH")  # magic, expires_at, epoch, len(node_id)


def _order_body(order: bytes, node_id: str, epoch: int, expires_at: int) -> bytes:
    node = node_id.encode()
    return _ORDER_HEAD.pack(b"PKORDER1", expires_at, epoch, len(node)) + node + order


def order_tag(keys: ClusterKeys, order: bytes, node_id: str, epoch: int, expires_at: int) -> bytes:
    """The MAC of a signed open order (SignedOpen): the serialized OpenRequest bound to
    the node's registration and an expiry, so a worker delivers it unchanged."""
    return keys.mac(_order_body(order, node_id, epoch, expires_at))


def check_order(
    keys: ClusterKeys, order: bytes, tag: bytes, node_id: str, epoch: int, expires_at: int
) -> bool:
    """True when `tag` is order_tag(...) under one of the keys."""
    try:
        body = _order_body(order, node_id, epoch, expires_at)
    except (struct.error, UnicodeEncodeError):
        return False
    return keys.check(body, tag)


def _pad(key: bytes, n: int, node_id: str, epoch: int, expires_at: int, seq_id: str) -> bytes:
    """n bytes of HMAC keystream for one order (unique per sequence, node registration
    and expiry): what hides the tenant salt inside the order from the worker carrying it."""
    head = b"pagedkv salt\0" + _ORDER_HEAD.pack(b"PKSALT01", expires_at, epoch, 0) + node_id.encode() + b"\0"
    head += seq_id.encode()
    out = b"".join(hmac.new(key, head + bytes([i]), hashlib.sha256).digest() for i in range(-(-n // 32)))
    return out[:n]


def seal_salt(
    keys: ClusterKeys, salt: bytes, node_id: str, epoch: int, expires_at: int, seq_id: str
) -> bytes:
    """The salt an order carries, XORed with the signing key's keystream for it."""
    pad = _pad(keys.signing_key, len(salt), node_id, epoch, expires_at, seq_id)
    return bytes(a ^ b for a, b in zip(salt, pad, strict=True))


def unseal_salt(
    keys: ClusterKeys, sealed: bytes, tag: bytes, node_id: str, epoch: int, expires_at: int, seq_id: str
) -> bytes:
    """seal_salt undone with the key that signed the order (named by its tag)."""
    key = keys.key_of(tag)
    if key is None:
        return sealed  # the tag's check refuses such an order first
    pad = _pad(key, len(sealed), node_id, epoch, expires_at, seq_id)
    return bytes(a ^ b for a, b in zip(sealed, pad, strict=True))


def tickets_in(metadata: Iterable[tuple[str, str | bytes]] | None) -> list[bytes]:
    """The ticket values of a call's gRPC metadata."""
    return [v for k, v in metadata or () if k == TICKET_KEY and isinstance(v, bytes)]


def bearer_in(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The bearer token of a call's `authorization` metadata; None when absent."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            return token if scheme.lower() == "bearer" else ""
    return None

"""The credentials a client holds for one node, presented by every transport.

In a cluster with a cluster secret the coordinator answers each open, fork,
describe and swap-in with the id the node knows the sequence by (tenant-scoped)
and a ticket for it there (routing.py's Route); the client translates the ids of
its data calls and presents the tickets: in each gRPC call's metadata, and once
per bulk connection and sequence (AUTH, link.py). A standalone node started with
a token gets that token instead. Without either (a trusted network) the ids go
as they are and nothing is presented: one dictionary check per call.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ...protos.errors import PagedKVError
from ...protos.tickets import TICKET_KEY

MAX_GRANTS = 1 << 16  # sequences remembered per node (closed ones are forgotten at once)


class Wallet:
    def __init__(self, token: str = "") -> None:
        self.token = token  # a standalone node's bearer token ("" : none)
        self._ids: dict[str, str] = {}  # the worker's sequence id -> the node's
        self._workers: dict[str, str] = {}  # and back
        self._tickets: dict[str, bytes] = {}  # the node's sequence id -> its ticket
        self._lock = threading.Lock()

    @property
    def is_empty(self) -> bool:
        return not self._tickets and not self.token

    def add(self, seq_id: str, node_seq_id: str, ticket: bytes) -> None:
        """What the coordinator answered for `seq_id`."""
        with self._lock:
            if len(self._ids) >= MAX_GRANTS:
                for old in list(self._ids)[: MAX_GRANTS // 4]:
                    self._workers.pop(self._ids[old], None)
                    self._tickets.pop(self._ids.pop(old), None)
            if node_seq_id and node_seq_id != seq_id:
                self._ids[seq_id] = node_seq_id
                self._workers[node_seq_id] = seq_id
            if ticket:
                self._tickets[node_seq_id or seq_id] = ticket

    def forget(self, seq_id: str) -> None:
        with self._lock:
            node_seq_id = self._ids.pop(seq_id, seq_id)
            self._workers.pop(node_seq_id, None)
            self._tickets.pop(node_seq_id, None)

    def node_id(self, seq_id: str) -> str:
        """The id the node knows `seq_id` by (itself when the coordinator scoped nothing;
        a value that is no id at all is left for the call's checks to refuse)."""
        if not self._ids or not isinstance(seq_id, str):
            return seq_id
        return self._ids.get(seq_id, seq_id)

    def node_ids(self, seq_ids: Sequence[str]) -> list[str]:
        ids = self._ids
        if not ids:
            return seq_ids if type(seq_ids) is list else list(seq_ids)  # type: ignore[return-value]
        return [ids.get(s, s) if isinstance(s, str) else s for s in seq_ids]

    def tickets(self, node_seq_ids: Sequence[str]) -> list[bytes]:
        """The tickets of these sequences (node ids) that the wallet holds."""
        tickets = self._tickets
        if not tickets:
            return []
        return [t for t in map(tickets.get, node_seq_ids) if t is not None]

    def worker_ids(self, node_seq_ids: Sequence[str]) -> list[str]:
        """The worker's ids of these node sequence ids (each itself when not scoped)."""
        workers = self._workers
        return [workers.get(s, s) for s in node_seq_ids]

    def worker_error(self, exc: PagedKVError) -> PagedKVError:
        """exc (a node's answer) naming the worker's id of its sequence, not the node's."""
        node_seq_id = getattr(exc, "seq_id", None)
        seq_id = self._workers.get(node_seq_id) if isinstance(node_seq_id, str) else None
        if seq_id is None:
            return exc
        err = PagedKVError.__new__(type(exc))
        Exception.__init__(err, str(exc).replace(repr(node_seq_id), repr(seq_id)))
        err.__dict__.update(exc.__dict__)
        err.seq_id = seq_id  # type: ignore[attr-defined]
        return err

    def metadata(self, node_seq_ids: Sequence[str]) -> tuple[tuple[str, str | bytes], ...]:
        """A gRPC call's credentials for these sequences."""
        if self.token:
            return (("authorization", f"Bearer {self.token}"),)
        return tuple((TICKET_KEY, t) for t in self.tickets(node_seq_ids))

"""Open orders a worker carried from the coordinator (OpenSigned): each runs once.

A retry of an order whose sequence is still open answers what the first run answered
(the worker resent it after a lost reply); a replay of one whose sequence was freed
since is refused, so a worker cannot bring a closed sequence back on a node behind
the coordinator's back. An order is remembered until it expires (its life is the
coordinator's ORDER_TTL_S), at most `capacity` of them (the oldest forgotten first:
a replay past that makes an orphan, which reconciliation frees).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from ..protos import pagedkv_pb2 as pb
from ..protos.errors import FailedPrecondition

MAX_ORDERS = 1 << 17


def order_digest(order: bytes) -> bytes:
    return hashlib.blake2b(order, digest_size=16).digest()


class OpenOrders:
    def __init__(self, capacity: int = MAX_ORDERS, clock: Callable[[], float] = time.time) -> None:
        self._done: OrderedDict[bytes, tuple[int, str, pb.OpenResponse]] = OrderedDict()
        self._capacity = capacity
        self._clock = clock
        self._lock = threading.Lock()

    def prior(self, digest: bytes, is_open: Callable[[str], bool]) -> pb.OpenResponse | None:
        """What an earlier run of this order answered, if its sequence is still open;
        None if the order never ran; FailedPrecondition if its sequence is gone."""
        with self._lock:
            entry = self._done.get(digest)
        if entry is None:
            return None
        _, seq_id, reply = entry
        if is_open(seq_id):
            return reply
        raise FailedPrecondition(
            f"the open order of sequence {seq_id!r} ran already and the sequence was freed since: "
            "open it again through the coordinator"
        )

    def ran(self, digest: bytes, expires_at: int, seq_id: str, reply: pb.OpenResponse) -> None:
        """Remember a successful run (forgetting the expired ones, and the oldest past capacity)."""
        now = self._clock()
        with self._lock:
            self._done[digest] = (expires_at, seq_id, reply)
            while self._done:
                first = next(iter(self._done.values()))
                if first[0] >= now and len(self._done) <= self._capacity:
                    break
                self._done.popitem(last=False)

"""Node Opens this worker carries for the coordinator (CoordOpenRequest.worker_opens).

The coordinator answers an open with the node Open signed for the node (SignedOpen)
and sends nothing itself; the worker sends it on from a sender thread without waiting,
so open() still costs one round trip and the coordinator no node rpc. What the coordinator did for
its own asynchronous Open moves here: a refusal is remembered and is what the
sequence's next data call (routing.explain) and its close raise; the page table is
dropped so the id can be opened again (a reopen by this client waits for that). A
close does not wait: a Free that overtakes the Open waits for it at the node.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc

from ..protos import pagedkv_pb2 as pb
from ..protos.errors import PagedKVError, SequenceLost, Unavailable
from ..protos.status import error_from_rpc

MAX_REMEMBERED = 1 << 14  # failed opens kept for their next call (the oldest forgotten first)
MAX_SENDERS = 8  # node Opens in flight at once (a node that stopped answering holds its for the deadline)
Send = Callable[[str, pb.SignedOpen, float], Any]  # (address, order, timeout) -> the node's reply


class NodeOpens:
    def __init__(self, send: Send, drop: Callable[[str], None], timeout_s: float) -> None:
        """send: the node's OpenSigned (blocking, run on a sender thread); drop(seq_id): the
        coordinator's Close of a sequence whose node Open failed (best effort)."""
        self._send, self._drop, self.timeout_s = send, drop, timeout_s
        self._pending: dict[str, Future[None]] = {}  # seq_id -> settles once answered (and dropped)
        self._failed: OrderedDict[str, PagedKVError] = OrderedDict()
        self._lock = threading.Lock()
        self._dropper: ThreadPoolExecutor | None = None
        self._sender: ThreadPoolExecutor | None = None

    def send(self, seq_id: str, address: str, order: pb.SignedOpen) -> None:
        settled: Future[None] = Future()
        with self._lock:
            self._pending[seq_id] = settled
            self._failed.pop(seq_id, None)
            if self._sender is None:
                self._sender = ThreadPoolExecutor(MAX_SENDERS, thread_name_prefix="pagedkv-node-opens")
            sender = self._sender
        sender.submit(self._deliver, seq_id, address, order, settled)

    def _deliver(self, seq_id: str, address: str, order: pb.SignedOpen, settled: Future[None]) -> None:
        """On a sender thread: a sync channel's future() would start a thread per call."""
        where = f"node {order.node_id!r} ({address}), open of {seq_id!r}"
        error: PagedKVError | None = None
        try:
            self._send(address, order, self.timeout_s)
        except grpc.RpcError as err:
            error = error_from_rpc(err, where)
        except Exception as exc:  # noqa: BLE001 - never lose an outcome
            error = Unavailable(f"{where}: {exc!r}")
        if isinstance(error, Unavailable):  # as the coordinator words an Open it could not deliver
            reason = f"its open could not be delivered to node {order.node_id} ({error})"
            error = SequenceLost(seq_id, reason, order.node_id)
        self._answered(seq_id, settled, error)

    def _answered(self, seq_id: str, settled: Future[None], error: PagedKVError | None) -> None:
        if error is None:
            self._settle(seq_id, settled)
            return
        with self._lock:
            self._failed[seq_id] = error
            while len(self._failed) > MAX_REMEMBERED:
                self._failed.popitem(last=False)
            if self._dropper is None:
                self._dropper = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-open-drops")
            dropper = self._dropper
        dropper.submit(self._drop_then_settle, seq_id, settled)

    def _drop_then_settle(self, seq_id: str, settled: Future[None]) -> None:
        try:
            self._drop(seq_id)
        finally:
            self._settle(seq_id, settled)

    def _settle(self, seq_id: str, settled: Future[None]) -> None:
        with self._lock:
            if self._pending.get(seq_id) is settled:
                del self._pending[seq_id]
        settled.set_result(None)

    def wait(self, seq_id: str, timeout_s: float | None = None) -> None:
        """Wait until this worker's node Open of `seq_id` (if one is in flight) was answered,
        and a failed one's page table dropped."""
        with self._lock:
            settled = self._pending.get(seq_id)
        if settled is not None:
            try:
                settled.result(timeout=self.timeout_s if timeout_s is None else timeout_s)
            except TimeoutError:
                raise Unavailable(f"the node open of {seq_id!r} is still in flight; retry") from None

    def failure(self, seq_id: str) -> PagedKVError | None:
        """The error of this worker's failed node Open of `seq_id`, if it failed."""
        with self._lock:
            return self._failed.get(seq_id)

    def forget(self, seq_id: str) -> PagedKVError | None:
        """Forget (and return) a failed open's error: the sequence was closed."""
        with self._lock:
            return self._failed.pop(seq_id, None)

    def close(self) -> None:
        with self._lock:
            sender, self._sender = self._sender, None
            dropper, self._dropper = self._dropper, None
        if sender is not None:
            sender.shutdown(wait=True)
        if dropper is not None:
            dropper.shutdown(wait=True)

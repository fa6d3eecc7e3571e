"""Node rpcs the coordinator sends without waiting (the node Open of an open, the Free of
a close), mixed into Coordinator (core.py): each is a NodeCall in `_inflight` until it
settles, so a later call on the same sequence waits for it, a failed Open drops its page
table, and a failed Free is retried so no block leaks."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..protos import pagedkv_pb2 as pb
from ..protos.errors import NotFound, PagedKVError, SequenceLost, SequenceNotFound, Unavailable
from ..protos.keys import KEY_BYTES
from .node_calls import NodeCalls
from .records import NodeInfo
from .store import Store

log = logging.getLogger("pagedkv.coordinator")


class NodeCall:
    """A node rpc of one sequence sent without waiting for it (the Open of an open).

    `settled` resolves once it finished and its consequences are applied (None, or
    the node's error after the page table was dropped); `then(fn)` runs fn(error)
    after it finishes (at once if it has). `is_recorded` says the page table was
    written: after that, a failure is cleaned up by the completion callback, before
    it by the open itself -- exactly one of the two, decided under the lock."""

    def __init__(self, seq_id: str) -> None:
        self.seq_id = seq_id
        self.settled: Future[None] = Future()
        self.error: PagedKVError | None = None
        self.is_finished = False
        self.is_recorded = False
        self.host_hit_tokens = 0  # what the node reported, once finished
        self._then: list[Callable[[PagedKVError | None], None]] = []
        self._lock = threading.Lock()

    def finish(self, error: PagedKVError | None) -> bool:
        """Record the outcome, run the `then` callbacks; True if the failure is the
        caller's to clean up (the page table was already written)."""
        with self._lock:
            self.error, self.is_finished = error, True
            then, self._then = self._then, []
        for fn in then:
            fn(error)
        return error is not None and self.is_recorded

    def mark_recorded(self) -> PagedKVError | None:
        """The page table is written; returns the node's error if the call already failed
        (then the caller cleans up)."""
        with self._lock:
            self.is_recorded = True
            return self.error if self.is_finished else None

    def then(self, fn: Callable[[PagedKVError | None], None]) -> None:
        with self._lock:
            if not self.is_finished:
                self._then.append(fn)
                return
        fn(self.error)


@dataclass(frozen=True)
class NamedPrompt:
    """A prompt an order names instead of holding (the worker carries its tokens to the
    node): its length and the chain key of the last cached block (b"" when none is)."""

    num_tokens: int
    last_cached_key: bytes


def order_prompt(
    token_ids: Any, num_tokens: int, keys: bytes, num_cached: int, block_size: int, named: bool
) -> Any:
    """What a node Open holds of the prompt: the tokens, or with `named` a NamedPrompt
    (`keys`: the prompt's packed chain keys, covering at least the cached blocks;
    `num_tokens`: its length, which `token_ids` need not hold: prompt_refs.py)."""
    if not named:
        return token_ids
    last = num_cached // block_size
    return NamedPrompt(num_tokens, keys[(last - 1) * KEY_BYTES : last * KEY_BYTES] if last else b"")


def node_open_request(
    seq_id: str, prompt: Any, salt: bytes, num_cached: int, attention: Any, request_id: str = ""
) -> pb.OpenRequest:
    """The node Open of an open (sent from here, or signed for the worker to carry);
    `prompt`: its token ids or a NamedPrompt (order_prompt); `request_id`: the open's,
    which makes its signed order unique (random without one)."""
    request = pb.OpenRequest(
        seq_id=seq_id,
        tenant_salt=salt,
        expect_cached_tokens=num_cached,
        attention=attention,
        order_nonce=request_id.encode()[:64] or os.urandom(12),
    )
    if isinstance(prompt, NamedPrompt):
        request.prompt_tokens, request.prompt_key = prompt.num_tokens, prompt.last_cached_key
    else:  # an array (a packed prompt) goes in as a list: the field would convert id by id
        request.token_ids.extend(prompt.tolist() if isinstance(prompt, np.ndarray) else prompt)
    return request


class DeferredCalls:
    """Mixed into Coordinator, which sets the attributes declared here in its __init__."""

    store: Store
    config: Any  # CoordinatorConfig (core.py imports this module)
    counters: dict[str, int]
    _lock: threading.Lock
    _stop: threading.Event
    _inflight: dict[str, NodeCall]
    _background: ThreadPoolExecutor
    _node_calls: NodeCalls
    _release_active: Callable[[str, int], None]

    def _send_open(
        self, node: NodeInfo, request: pb.OpenRequest, call: NodeCall, quota_tenant: str | None
    ) -> None:
        """Send the node Open as a future; its completion applies a failure (drops the
        page table, releases the quota, counts it): the record exists by then."""

        def done(reply: Any, error: PagedKVError | None) -> None:  # on a NodeCalls sender thread
            if reply is not None:
                call.host_hit_tokens = int(reply.num_host_hit_tokens)
            if call.finish(error):  # recorded: drop the page table first, then settle
                self._background.submit(self._drop_failed_open, call, quota_tenant)
            else:  # success, or a failure open() itself undoes (it had not recorded yet)
                self._settled(call)

        where = f"node {node.node_id} ({node.address})"
        meta = self.config.access.node_metadata(node)
        self._node_calls.send(node.address, "Open", request, where, done, metadata=meta)

    def _drop_failed_open(self, call: NodeCall, quota_tenant: str | None) -> None:
        """A node refused an open whose page table was written: delete it and release the
        quota (only if we deleted it: a concurrent close that deleted it released it).
        An Open that did not reach the node (Unavailable) left it no tombstone to answer
        the worker's data calls with, so its record is marked lost instead (expiring):
        Describe, every data call's NOT_FOUND and the close then answer SequenceLost."""
        try:
            try:
                if isinstance(call.error, Unavailable):
                    reason = f"its open could not be delivered to {call.error}"
                    dropped = self.store.mark_lost(call.seq_id, reason, self.config.lost_ttl_s)
                else:
                    dropped = self.store.delete_sequence(call.seq_id)
            except SequenceNotFound:
                dropped = None
            if dropped is not None:
                self._release_active(dropped.extents[0].node_id, dropped.num_blocks)
            if dropped is not None and quota_tenant is not None:
                self.store.release_blocks(quota_tenant, dropped.num_blocks)
            self.counters["open_failures"] += 1
            kept = "marked lost" if isinstance(call.error, Unavailable) else "dropped"
            log.info("open of %s failed on its node, page table %s: %s", call.seq_id, kept, call.error)
        except PagedKVError as exc:  # the store is down: the record stays, its node says why
            log.warning("could not drop the page table of failed open %s: %s", call.seq_id, exc)
        finally:
            self._settled(call)

    def _settled(self, call: NodeCall) -> None:
        """Resolve `call.settled` (once) and forget it."""
        with self._lock:
            if self._inflight.get(call.seq_id) is call:
                del self._inflight[call.seq_id]
            if call.settled.done():
                return
            if call.error is None:
                call.settled.set_result(None)
            else:
                call.settled.set_exception(call.error)

    def _settle(self, seq_id: str, *, raise_error: bool = True) -> None:
        """Wait for the in-flight node call (Open, or the Free of a close) of `seq_id` in
        this process, if any; raises its error when it failed (unless raise_error=False)."""
        with self._lock:
            call = self._inflight.get(seq_id)
        if call is None:
            return
        try:
            call.settled.result(timeout=self.config.node_rpc_timeout_s * (2 + self.config.free_retries))
        except PagedKVError:
            if raise_error:
                raise
        except TimeoutError:
            raise Unavailable(f"the node call of sequence {seq_id!r} is still in flight; retry") from None

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Wait until no node call sent without waiting (Opens, Frees) is in flight in this
        process, e.g. before inspecting node state in a test. Raises Unavailable on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                calls = list(self._inflight.values())
            if not calls:
                return
            for call in calls:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Unavailable(f"{len(calls)} node calls still in flight after {timeout_s} s")
                try:
                    call.settled.result(timeout=left)
                except PagedKVError:
                    pass
                except TimeoutError:
                    continue

    def _send_free(
        self, node: NodeInfo, seq_id: str, after: NodeCall | None = None, keep_prefix: int | None = None
    ) -> None:
        """Free `seq_id` on the node without waiting; with `after` (its node Open still in
        flight), once that Open has succeeded (a failed one left nothing to free). A
        failure other than NOT_FOUND and SequenceLost (the node holds nothing of it) is
        retried (free_retries, backoff) so blocks never leak on a transient error. The
        Free is in `_inflight` from this call on, before it is sent, so a reopen of the
        same id waits for it and never overtakes it."""
        call = NodeCall(seq_id)
        request = pb.SeqRequest(seq_id=seq_id, keep_prefix=keep_prefix)
        with self._lock:
            self._inflight[seq_id] = call
        if after is None:
            self._free_attempt(node, call, request, 0)
            return

        def send_when_opened(error: PagedKVError | None) -> None:
            if error is None:
                self._free_attempt(node, call, request, 0)
            else:
                call.finish(None)
                self._settled(call)

        after.then(send_when_opened)

    def _free_attempt(self, node: NodeInfo, call: NodeCall, request: pb.SeqRequest, attempt: int) -> None:
        def done(reply: Any, error: PagedKVError | None) -> None:  # on a NodeCalls sender thread
            if error is not None and not isinstance(error, (NotFound, SequenceLost)):  # already gone
                if attempt < self.config.free_retries and not self._stop.is_set():
                    self._background.submit(self._retry_free, node, call, request, attempt + 1)
                    return
                self.counters["free_failures"] += 1
                log.warning("Free %s failed %d times: %s", call.seq_id, attempt + 1, error)
            call.finish(None)
            self._settled(call)

        where = f"node {node.node_id} ({node.address})"
        meta = self.config.access.node_metadata(node)
        self._node_calls.send(node.address, "Free", request, where, done, metadata=meta)

    def _retry_free(self, node: NodeInfo, call: NodeCall, request: pb.SeqRequest, attempt: int) -> None:
        if not self._stop.wait(0.1 * 2**attempt):
            self._free_attempt(node, call, request, attempt)
            return
        call.finish(None)
        self._settled(call)

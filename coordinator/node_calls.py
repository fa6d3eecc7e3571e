"""NodeCalls: node rpcs the coordinator sends without waiting for them.

The asynchronous node Open of an open (and the Free of a close) must cost the
handler next to nothing. A sync gRPC channel's `.future()` does not: with no
other call in flight it starts a fresh "channel spin" thread per call and waits
for it to start (0.5 ms, 2/3 of an open's handler time in bench/control.py). So
these calls go through grpc.aio channels on one event-loop thread owned here;
sending is one `call_soon_threadsafe`. Completion callbacks run on that loop
thread: they must not block (hand Redis work to an executor).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

import grpc

from ..protos import pagedkv_pb2_grpc as pb_grpc
from ..protos.errors import PagedKVError, Unavailable
from ..protos.status import error_from_rpc

log = logging.getLogger("pagedkv.coordinator.node_calls")
Done = Callable[[Any, PagedKVError | None], None]  # (reply or None, error or None)


class NodeCalls:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._stubs: dict[str, tuple[grpc.aio.Channel, pb_grpc.CacheNodeStub]] = {}
        self._thread = threading.Thread(target=self._loop.run_forever, name="node-calls", daemon=True)
        self._thread.start()
        self._is_closed = False

    def send(self, address: str, method: str, request: Any, where: str, done: Done) -> None:
        """Send `method(request)` to the node at `address`; `done(reply, error)` runs on
        the loop thread when it finishes (error: the domain error, prefixed by `where`).
        Never raises: a call that cannot be sent reports Unavailable through `done`."""
        if self._is_closed:
            done(None, Unavailable(f"{where}: coordinator shutting down, {method} not sent"))
            return
        try:
            self._loop.call_soon_threadsafe(self._start, address, method, request, where, done)
        except RuntimeError as exc:  # the loop closed meanwhile
            done(None, Unavailable(f"{where}: {method} not sent: {exc}"))

    def _start(self, address: str, method: str, request: Any, where: str, done: Done) -> None:
        self._loop.create_task(self._run(address, method, request, where, done))

    async def _run(self, address: str, method: str, request: Any, where: str, done: Done) -> None:
        reply, error = None, None
        try:
            reply = await getattr(self._stub(address), method)(request, timeout=self.timeout_s)
        except grpc.RpcError as err:
            error = error_from_rpc(err, where)
        except Exception as exc:  # noqa: BLE001 - never lose an outcome
            error = Unavailable(f"{where}: {method} failed: {exc!r}")
        try:
            done(reply, error)
        except Exception:  # a bug in a callback must not kill the loop
            log.exception("completion of %s %s failed", method, where)

    def _stub(self, address: str) -> pb_grpc.CacheNodeStub:
        entry = self._stubs.get(address)  # loop thread only: no lock needed
        if entry is None:
            channel = grpc.aio.insecure_channel(address)
            entry = self._stubs[address] = (channel, pb_grpc.CacheNodeStub(channel))
        return entry[1]

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the channels (calls in flight end CANCELLED) and stop the loop thread."""
        if self._is_closed:
            return
        self._is_closed = True

        async def shutdown() -> None:
            for channel, _ in self._stubs.values():
                await channel.close(grace=0.5)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout_s)
        except Exception as exc:  # noqa: BLE001 - best effort at shutdown
            log.warning("closing node channels: %r", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)

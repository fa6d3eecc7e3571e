"""The client's transport seam: what every way of reaching a node's data plane
offers, and the one policy that picks among them.

A transport is one way to carry the data calls to one node (gRPC, a socket, shared
memory). Each takes the call's arguments already validated (calls.py: the codec
checks them once, whatever carries them) and either answers exactly as the node's
rpc would (same result, same errors) or raises TransportUnavailable having sent
nothing, so that the next transport in the list takes the call. `Fallback` walks
the list; it is the only place where one transport gives way to another. A call
that fails after its request left raises Unavailable instead: it may have landed,
so it is never silently sent again.

Adding a transport is one file here (and its listener on the node); adding a data
call is one method on each transport that carries it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ...protos.errors import PagedKVError
from ..types import AttentionResult, OpenResult

if TYPE_CHECKING:
    from .calls import AppendCall, AttendCall, OpenCall, PrefillCall, ReadCall

KV = tuple[torch.Tensor, torch.Tensor]


class TransportUnavailable(PagedKVError):
    """This transport cannot carry this call (off, unreachable, too small a transfer to
    be worth it, or an op the node's listener does not serve). Nothing was sent: the
    next transport takes the call."""

    status_name = "UNAVAILABLE"


class Reply(Protocol):
    """A call's request sent, its answer still to come: `result()` waits for it and
    returns what the blocking call returns, or raises what it raises. Asked once;
    every started call must be asked (it holds a connection until then)."""

    def result(self) -> Any: ...


class Transport(Protocol):
    """One way to carry data calls to one node. Every method either answers as the
    node's rpc does or raises TransportUnavailable with nothing sent. `timeout_s`
    bounds each blocking step (a transfer that stops progressing for that long fails
    with Unavailable). Methods may be called from several threads at once."""

    name: str  # "grpc", "tcp", "unix", "shm": what ClientConfig.transports lists

    def open(self, call: OpenCall, timeout_s: float) -> OpenResult:
        """Open a sequence on the node (direct mode); the engine's errors."""
        ...

    def append(self, call: AppendCall, timeout_s: float) -> int:
        """Append K/V with their token ids; returns the sequence's new length."""
        ...

    def attend(self, call: AttendCall, timeout_s: float) -> AttentionResult:
        """A decode step (call.num_tokens empty) or a prefill batch of one layer."""
        ...

    def attend_prefill(self, call: PrefillCall, timeout_s: float) -> AttentionResult:
        """n query tokens of one sequence attending causally."""
        ...

    def start_attend(self, call: AttendCall, timeout_s: float) -> Reply:
        """attend's request sent now, its answer read by the Reply: one thread can have
        calls out on several nodes at once (a sharded step). TransportUnavailable as
        attend raises it (nothing sent)."""
        ...

    def start_attend_prefill(self, call: PrefillCall, timeout_s: float) -> Reply:
        """attend_prefill, started as start_attend starts attend."""
        ...

    def read_kv(self, call: ReadCall, timeout_s: float) -> KV:
        """K and V of a range, into call.out when given."""
        ...

    def connect(self, timeout_s: float) -> None:
        """Open now what the first call would open; a failure is left for that call."""
        ...

    def close(self) -> None:
        """Close idle connections; the transport stays usable (reconnects on demand)."""
        ...


class Fallback:
    """Tries a node's transports in order; the first that does not raise
    TransportUnavailable answers. The last one (gRPC) carries every call.
    `errors(exc, call)` rewrites the node's errors for the caller (the worker's
    sequence ids instead of the node's: transport/tickets.py; what a cluster's
    coordinator says of the call's sequences: data.py), off the success path."""

    def __init__(
        self,
        transports: Sequence[Transport],
        errors: Callable[[PagedKVError, Any], PagedKVError] | None = None,
    ) -> None:
        if not transports:
            raise ValueError("a node needs at least one transport")
        self.transports = list(transports)
        self._errors = errors

    def call(self, method: str, call: Any, timeout_s: float) -> Any:
        try:
            return self._first(method, call, timeout_s)
        except PagedKVError as exc:
            raise self.rewrite(exc, call) from exc.__cause__

    def start(self, method: str, call: Any, timeout_s: float) -> Reply:
        """`call` in two halves (Transport.start_attend): the request sent by the first
        transport that can carry it; the Reply's errors rewritten as `call`'s are."""
        try:
            reply = self._first(f"start_{method}", call, timeout_s)
        except PagedKVError as exc:
            raise self.rewrite(exc, call) from exc.__cause__
        return reply if self._errors is None else Rewritten(reply, self.rewrite, call)

    def _first(self, method: str, call: Any, timeout_s: float) -> Any:
        for transport in self.transports[:-1]:
            try:
                return getattr(transport, method)(call, timeout_s)
            except TransportUnavailable:
                continue
        return getattr(self.transports[-1], method)(call, timeout_s)

    def rewrite(self, exc: PagedKVError, call: Any) -> PagedKVError:
        """The node's error as the caller should see it (itself when nothing changes)."""
        if self._errors is None or isinstance(exc, TransportUnavailable):
            return exc
        return self._errors(exc, call)

    def connect(self, timeout_s: float) -> None:
        for transport in self.transports:
            transport.connect(timeout_s)

    def close(self) -> None:
        for transport in self.transports:
            transport.close()

    def get(self, name: str) -> Transport | None:
        return next((t for t in self.transports if t.name == name), None)


class Rewritten:
    """A Reply whose error is rewritten for the caller (Fallback's `errors`)."""

    __slots__ = ("_reply", "_rewrite", "_call")

    def __init__(self, reply: Reply, rewrite: Callable[[PagedKVError, Any], PagedKVError], call: Any) -> None:
        self._reply, self._rewrite, self._call = reply, rewrite, call

    def result(self) -> Any:
        try:
            return self._reply.result()
        except PagedKVError as exc:
            raise self._rewrite(exc, self._call) from exc.__cause__

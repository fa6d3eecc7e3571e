"""One error hierarchy for every role.

Each error names the gRPC status code it travels as (`status_name`), so the
server side and the client side each translate in one function (protos/status.py)
and agree on the mapping. Errors carry the ids they are about (`exc.seq_id`), on
the client side too: the ids travel beside the message. Builtins
(ConnectionError, TimeoutError) are never shadowed.
"""

from __future__ import annotations


class PagedKVError(Exception):
    """Root of every pagedkv error."""

    status_name = "UNKNOWN"


class InvalidArgument(PagedKVError):
    """The request itself is malformed: wrong shape, dtype, size or value."""

    status_name = "INVALID_ARGUMENT"


class SpecMismatch(InvalidArgument):
    """A request was made for a model shape this node does not serve."""


class NotFound(PagedKVError):
    status_name = "NOT_FOUND"


class SequenceNotFound(NotFound):
    def __init__(self, seq_id: str | int, detail: str = "") -> None:
        self.seq_id = seq_id
        super().__init__(f"unknown sequence {seq_id!r}" + (f": {detail}" if detail else ""))


class CapacityExceeded(PagedKVError):
    """Not enough free blocks (device or host) for the request; nothing was changed."""

    status_name = "RESOURCE_EXHAUSTED"

    def __init__(self, what: str, requested: int, available: int) -> None:
        self.what = what
        self.requested = requested
        self.available = available
        super().__init__(f"{what}: requested {requested} blocks, only {available} available")


class QuotaExceeded(PagedKVError):
    status_name = "RESOURCE_EXHAUSTED"

    def __init__(self, tenant: str, requested: int, quota: int, used: int) -> None:
        self.tenant = tenant
        self.requested = requested
        self.quota = quota
        self.used = used
        super().__init__(
            f"tenant {tenant!r} over quota: {used} blocks used + {requested} requested > quota {quota}"
        )


class FailedPrecondition(PagedKVError):
    """The request is well formed but the target is in the wrong state (e.g. swapped out)."""

    status_name = "FAILED_PRECONDITION"


class OpenFailed(FailedPrecondition):
    """The node could not complete an open the coordinator had already answered.

    A cluster open returns once the coordinator has placed the sequence and written
    its page table; the node opens it in the background. If that fails, the
    sequence does not exist: the first data call on it raises this error (the node
    remembers the failure for a while) and the coordinator drops its record and
    quota. What to do: open the sequence again (a new open re-reads the prefix
    index), then append what it says is not cached."""

    def __init__(self, seq_id: str, reason: str) -> None:
        self.seq_id = seq_id
        super().__init__(f"open of sequence {seq_id!r} failed on its node: {reason}; open it again")


class PrefixEvicted(OpenFailed):
    """The node no longer held the cached prefix the coordinator promised (evicted
    since the prefix index was read): nothing was opened. Open the sequence again."""

    def __init__(self, seq_id: str, num_held_tokens: int, num_promised_tokens: int) -> None:
        self.num_held_tokens = num_held_tokens
        self.num_promised_tokens = num_promised_tokens
        super().__init__(
            seq_id,
            f"prefix evicted: node holds {num_held_tokens} of {num_promised_tokens} promised tokens",
        )


class SequenceExists(FailedPrecondition):
    """An open or fork was given a sequence id that is already taken (nothing was changed)."""

    def __init__(self, seq_id: str) -> None:
        self.seq_id = seq_id
        super().__init__(f"sequence {seq_id!r} already exists")


class PrefixUnknown(FailedPrecondition):
    """An open named its prompt's start by a ref (CoordOpenRequest.prefix_ref) that this
    coordinator does not hold (it restarted, dropped it for newer ones, or never gave it to
    this tenant): nothing was changed. Send the prompt whole."""

    def __init__(self, seq_id: str) -> None:
        self.seq_id = seq_id
        super().__init__(
            f"open of sequence {seq_id!r} names a prompt this coordinator does not hold: send it whole"
        )


class NodeNotLive(FailedPrecondition):
    """The call needs a live node (registered, heartbeat not lapsed) and this one is not."""

    def __init__(self, node_id: str, what: str) -> None:
        self.node_id = node_id
        super().__init__(f"node {node_id!r} is not live (unknown or heartbeat lapsed): {what}")


class SequenceLost(FailedPrecondition):
    """A sequence's KV is gone: its node died, restarted, or was declared dead while cut
    off (its lease lapsed). The one error a worker gets for it, from every data call and
    from close (close also drops the record: a second close succeeds). `node_id` names the
    node ("" when unknown). What to do: open the sequence again and recompute its KV."""

    def __init__(self, seq_id: str, reason: str, node_id: str = "") -> None:
        self.seq_id = seq_id
        self.node_id = node_id
        super().__init__(f"sequence {seq_id!r} was lost: {reason}")


NodeLost = SequenceLost  # the name before #18: the same error


class Unavailable(PagedKVError):
    """A node, the coordinator or Redis cannot be reached; the call may succeed later."""

    status_name = "UNAVAILABLE"


class Unauthenticated(PagedKVError):
    status_name = "UNAUTHENTICATED"


class PermissionDenied(PagedKVError):
    status_name = "PERMISSION_DENIED"


class IntegrityError(PagedKVError):
    """An internal invariant does not hold (a bug, never bad input)."""

    status_name = "INTERNAL"


# status name -> the class a client raises for it (most specific generic class).
ERROR_FOR_STATUS: dict[str, type[PagedKVError]] = {
    "INVALID_ARGUMENT": InvalidArgument,
    "NOT_FOUND": NotFound,
    "RESOURCE_EXHAUSTED": CapacityExceeded,
    "FAILED_PRECONDITION": FailedPrecondition,
    "UNAVAILABLE": Unavailable,
    "UNAUTHENTICATED": Unauthenticated,
    "PERMISSION_DENIED": PermissionDenied,
    "INTERNAL": IntegrityError,
}

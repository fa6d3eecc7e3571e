"""The node's bulk listener (docs/bulk-protocol.md): listener.py owns the sockets and
dispatches each op; attend.py serves the per-step calls, kv.py the KV ranges,
protos/wire/limits.py what bounds them (connections, time, memory)."""

from ...protos.wire.limits import BulkLimits
from .listener import BulkServer, bulk_host

__all__ = ["BulkLimits", "BulkServer", "bulk_host"]

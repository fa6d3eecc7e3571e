"""The node's bulk listener (docs/bulk-protocol.md): listener.py owns the sockets and
dispatches each op; attend.py serves the per-step calls, kv.py the KV ranges."""

from .listener import BulkServer, bulk_host

__all__ = ["BulkServer", "bulk_host"]

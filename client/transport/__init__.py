"""How the client reaches a node's data plane: the Transport seam and its fallback
(base), the checked call arguments (calls), and one file per transport: grpc,
socket (TCP and the same-host Unix socket), shm (the same-host shared region)."""

from .base import Fallback, Transport, TransportUnavailable

__all__ = ["Fallback", "Transport", "TransportUnavailable"]

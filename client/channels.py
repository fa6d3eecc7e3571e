"""One channel per (address, options), shared by every client in the process.

gRPC channels are expensive (a TCP connection, HTTP/2 state) and multiplex
any number of concurrent calls, so clients borrow them from here and give them
back; the last release closes the channel.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc

from ..protos.tls import secure_channel
from .config import ClientConfig

_lock = threading.Lock()
_sync: dict[tuple[str, str], list[Any]] = {}  # key -> [channel, refcount]


def _key(address: str, config: ClientConfig) -> tuple[str, str]:
    return address, repr((config.channel_options(), config.tls))


def acquire(address: str, config: ClientConfig) -> grpc.Channel:
    key = _key(address, config)
    with _lock:
        entry = _sync.get(key)
        if entry is None:
            entry = _sync[key] = [_channel(address, config), 0]
        entry[1] += 1
        return entry[0]


def _channel(address: str, config: ClientConfig) -> grpc.Channel:
    """TLS when the config has it (its server-name override is among the options)."""
    options = [o for o in config.channel_options() if o[0] != "grpc.ssl_target_name_override"]
    return secure_channel(address, config.tls, options)


def release(address: str, config: ClientConfig) -> None:
    key = _key(address, config)
    with _lock:
        entry = _sync.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _sync[key]
    entry[0].close()

"""One channel per (address, options), shared by every client in the process.

gRPC channels are expensive (a TCP connection, HTTP/2 state) and multiplex
any number of concurrent calls, so clients borrow them from here and give them
back; the last release closes the channel.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc

from .config import ClientConfig

_lock = threading.Lock()
_sync: dict[tuple[str, str], list[Any]] = {}  # key -> [channel, refcount]


def _key(address: str, config: ClientConfig) -> tuple[str, str]:
    return address, repr(config.channel_options())


def acquire(address: str, config: ClientConfig) -> grpc.Channel:
    key = _key(address, config)
    with _lock:
        entry = _sync.get(key)
        if entry is None:
            entry = _sync[key] = [grpc.insecure_channel(address, options=config.channel_options()), 0]
        entry[1] += 1
        return entry[0]


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

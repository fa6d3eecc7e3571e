"""Block keys: the 128-bit chained hash every role computes the same way.

A full block's key is blake2b-128 over (parent key || the block's token ids as
little-endian int64). The first parent is derived from the tenant's salt, so two
tenants never produce the same key for the same tokens (prefix hits never cross
tenants; see vLLM CVE-2025-46570 for the timing side channel this closes).
Stable across processes and machines: never Python's hash().
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

import numpy as np

KEY_BYTES = 16
_TOKEN_BYTES = 8


def root_key(salt: bytes | str = b"") -> bytes:
    """The parent key of a sequence's first block, derived from the tenant salt."""
    if isinstance(salt, str):
        salt = salt.encode()
    return hashlib.blake2b(b"pagedkv-root\0" + salt, digest_size=KEY_BYTES).digest()


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids in the canonical wire form (little-endian int64).

    struct.pack is ~2x faster than numpy for Python lists (the common case)."""
    if isinstance(token_ids, np.ndarray):
        return token_ids.astype("<i8", copy=False).tobytes()
    return struct.pack(f"<{len(token_ids)}q", *token_ids)


def chain_keys(
    parent: bytes, token_ids: Sequence[int] | np.ndarray, block_size: int, start_block: int = 0
) -> list[bytes]:
    """Keys of every full block of `token_ids`, starting at block `start_block`.

    `parent` is the key of block `start_block - 1` (or the root key when 0).
    A trailing partial block gets no key. Pure; O(number of full blocks).
    """
    data = token_bytes(token_ids)
    step = block_size * _TOKEN_BYTES
    keys: list[bytes] = []
    append = keys.append
    # Copying a fresh blake2b-128 state is cheaper than building one from
    # keyword arguments per block; update(parent) + update(block) hashes the
    # same bytes as the concatenation.
    fresh = _FRESH.copy
    for off in range(start_block * step, len(data) - step + 1, step):
        h = fresh()
        h.update(parent)
        h.update(data[off : off + step])
        parent = h.digest()
        append(parent)
    return keys


def block_hasher(block_size: int) -> Callable[[bytes, Sequence[int]], bytes]:
    """A function (parent, one block's token ids) -> that block's key, the same as
    chain_keys(parent, token_ids, block_size)[0], with the packing precompiled
    for the hot path (one key per decode step that fills a block)."""
    pack = struct.Struct(f"<{block_size}q").pack
    fresh = _FRESH.copy

    def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
        h = fresh()
        h.update(parent)
        h.update(pack(*token_ids))
        return h.digest()

    return block_key


_FRESH = hashlib.blake2b(digest_size=KEY_BYTES)

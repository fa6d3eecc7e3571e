"""Block keys: the 128-bit chained hash every role computes the same way.

A full block's key is SHA-256 over (parent key || the block's token ids as
little-endian int64), truncated to 128 bits. The first parent is derived from
the tenant's salt, so two
tenants never produce the same key for the same tokens (prefix hits never cross
tenants; see vLLM CVE-2025-46570 for the timing side channel this closes).
Stable across processes and machines: never Python's hash().

chain_keys() hashes a prompt's blocks in one call to a small C library
(csrc/chain_keys.c, built and loaded by keys_native.py) when a C compiler is
available, else with hashlib (chain_keys_python); both give the same keys.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import struct
from collections.abc import Callable, Sequence

import numpy as np

from .keys_native import get_chain

KEY_BYTES = 16
_TOKEN_BYTES = 8


def root_key(salt: bytes | str = b"") -> bytes:
    """The parent key of a sequence's first block, derived from the tenant salt."""
    if isinstance(salt, str):
        salt = salt.encode()
    return hashlib.sha256(b"pagedkv-root\0" + salt).digest()[:KEY_BYTES]


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
    Hashes in compiled code (csrc/chain_keys.c, one call for all the blocks)
    when it could be built, else with hashlib; the keys are the same.
    Raises ValueError for a block size < 1, a start block < 0, a parent that is
    not 16 bytes, or a token id that is not an int in the int64 range.
    """
    native = _native
    if native is None:
        return chain_keys_python(parent, token_ids, block_size, start_block)
    _check_chain_args(parent, block_size, start_block)
    num_blocks = len(token_ids) // block_size - start_block
    if num_blocks <= 0:
        return []
    first = start_block * block_size
    try:
        if type(token_ids) is list:  # the usual case: no packing, the keys come back as a list
            return native.from_list(parent, token_ids, first, block_size, num_blocks)
        data = token_bytes(token_ids[first : first + num_blocks * block_size])
    except (TypeError, OverflowError, struct.error) as exc:
        raise ValueError(f"token ids must be ints in the int64 range: {exc}") from exc
    out = _new_buffer(num_blocks * KEY_BYTES)
    native.from_bytes(parent, data, block_size, num_blocks, out)
    return list(_key_splitter(num_blocks)(out))


def chain_keys_packed(parent: bytes, token_ids: Sequence[int] | np.ndarray, block_size: int) -> bytes:
    """chain_keys(parent, token_ids, block_size) concatenated (16 bytes per full block),
    for callers that ship keys packed (the coordinator's Redis scripts). Takes what numpy
    turns into an integer array in one C-level step: an int array, a list of ints, or a
    protobuf repeated int field (whose element-by-element copy into a list costs more
    than hashing it). Raises ValueError like chain_keys."""
    _check_chain_args(parent, block_size, 0)
    arr = np.asarray(token_ids)
    if arr.ndim != 1 or (arr.size and (arr.dtype.kind not in "iu" or arr.dtype == np.uint64)):
        raise ValueError(
            f"token ids must be ints in the int64 range: got an array of {arr.dtype} {arr.shape}"
        )
    num_blocks = len(arr) // block_size
    data = arr[: num_blocks * block_size].astype("<i8", copy=False)
    native = _native
    if native is None:
        return b"".join(chain_keys_python(parent, data, block_size))
    out = _new_buffer(num_blocks * KEY_BYTES)
    native.from_bytes(parent, data.tobytes(), block_size, num_blocks, out)
    return out.raw


def chain_keys_python(
    parent: bytes, token_ids: Sequence[int] | np.ndarray, block_size: int, start_block: int = 0
) -> list[bytes]:
    """chain_keys() with hashlib only: the reference the compiled chain is tested against,
    and the path taken where no C compiler is available."""
    _check_chain_args(parent, block_size, start_block)
    try:
        data = token_bytes(token_ids)
    except (TypeError, OverflowError, struct.error) as exc:
        raise ValueError(f"token ids must be ints in the int64 range: {exc}") from exc
    step = block_size * _TOKEN_BYTES
    keys: list[bytes] = []
    append = keys.append
    # Copying a fresh state is cheaper than building one per block; update(parent)
    # + update(block) hashes the same bytes as the concatenation.
    fresh = _FRESH.copy
    for off in range(start_block * step, len(data) - step + 1, step):
        h = fresh()
        h.update(parent)
        h.update(data[off : off + step])
        parent = h.digest()[:KEY_BYTES]
        append(parent)
    return keys


def _check_chain_args(parent: bytes, block_size: int, start_block: int) -> None:
    if block_size < 1 or start_block < 0 or len(parent) != KEY_BYTES:
        raise ValueError(
            f"chain_keys needs block_size >= 1, start_block >= 0 and a {KEY_BYTES}-byte parent; "
            f"got {block_size}, {start_block}, {len(parent)} bytes"
        )


@functools.lru_cache(maxsize=4096)
def _key_splitter(num_blocks: int) -> Callable[[ctypes.Array[ctypes.c_char]], tuple[bytes, ...]]:
    """Splits num_blocks * 16 bytes into num_blocks keys, in one C-level call."""
    return struct.Struct(f"{KEY_BYTES}s" * num_blocks).unpack_from


def block_hasher(block_size: int) -> Callable[[bytes, Sequence[int]], bytes]:
    """A function (parent, one block's token ids) -> that block's key, the same as
    chain_keys(parent, token_ids, block_size)[0], with the packing precompiled
    for the hot path (one key per decode step that fills a block). hashlib, not the
    compiled chain: for one block the foreign call costs more than it saves."""
    pack = struct.Struct(f"<{block_size}q").pack
    fresh = _FRESH.copy

    def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
        h = fresh()
        h.update(parent)
        h.update(pack(*token_ids))
        return h.digest()[:KEY_BYTES]

    return block_key


_FRESH = hashlib.sha256()
_native = get_chain()[0]  # None: hashlib only (no compiler, or PAGEDKV_PURE_KEYS=1)
_new_buffer = ctypes.create_string_buffer

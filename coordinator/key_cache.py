"""The chain keys of recent prompts, reused by the opens that share their prefix.

An open hashes its prompt's full blocks into chain keys (protos/keys.py: SHA-256 over the parent
key and 128 bytes of tokens, a block): ~78 us at 8k tokens and ~300 at 32k, the largest single
part of a long open's coordinator CPU. Opens that share a system prompt hash the same blocks
again each time. This keeps, per (root, block size, first block's tokens), the tokens and keys
of the last prompt seen there; an open compares its tokens with them in one vectorized pass,
takes the keys of the full blocks they share and hashes only the rest, from the last shared key.

Nothing but equal tokens is trusted: a key comes from here only when every token of its block
and of every block before it equals the cached prompt's, under the same root (the tenant's
salt), so the keys are exactly those chain_keys_packed computes (a property test checks).
Bounded by the tokens it holds (least recently used first out). Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from ..protos.keys import KEY_BYTES, chain_keys_packed

MAX_TOKENS = 4 << 20  # held over every entry (~32 MiB of int64 tokens at most)
MIN_BLOCKS = 2  # shorter prompts hash in less time than a lookup takes


class ChainKeyCache:
    def __init__(self, max_tokens: int = MAX_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[bytes, int, bytes], tuple[np.ndarray, bytes]] = OrderedDict()
        self._num_tokens = 0
        self._lock = threading.Lock()
        self.hashed_blocks = 0  # blocks hashed here (the rest came from the cache)
        self.reused_blocks = 0

    def keys(self, root: bytes, token_ids: Sequence[int] | np.ndarray, block_size: int) -> bytes:
        """chain_keys_packed(root, token_ids, block_size): the same bytes, the same errors."""
        tokens = np.asarray(token_ids)
        num_blocks = len(tokens) // block_size if block_size > 0 and tokens.ndim == 1 else 0
        if num_blocks < MIN_BLOCKS or tokens.dtype.kind not in "iu" or tokens.dtype == np.uint64:
            return chain_keys_packed(root, token_ids, block_size)  # (which refuses what it must)
        full = tokens[: num_blocks * block_size]
        slot = (bytes(root), block_size, full[:block_size].astype("<i8").tobytes())
        with self._lock:
            entry = self._entries.get(slot)
            if entry is not None:
                self._entries.move_to_end(slot)
        shared = 0
        if entry is not None:
            held, held_keys = entry
            n = min(len(held), len(full))
            differ = np.flatnonzero(held[:n] != full[:n])
            shared = (int(differ[0]) if len(differ) else n) // block_size
        if shared == num_blocks:
            keys = held_keys[: num_blocks * KEY_BYTES]
        else:
            parent = held_keys[(shared - 1) * KEY_BYTES : shared * KEY_BYTES] if shared else root
            rest = chain_keys_packed(parent, full[shared * block_size :], block_size)
            keys = held_keys[: shared * KEY_BYTES] + rest if shared else rest
            self._keep(slot, full, keys)
        with self._lock:
            self.hashed_blocks += num_blocks - shared
            self.reused_blocks += shared
        return keys

    def _keep(self, slot: tuple[bytes, int, bytes], full: np.ndarray, keys: bytes) -> None:
        """The newest prompt of its slot (the next one likely continues it). Its tokens are held
        as they are when they view a bytes object (a request's packed prompt: immutable), else
        copied: a caller's array may change after the call."""
        base = full
        while isinstance(base.base, np.ndarray):
            base = base.base
        held = full.view() if isinstance(base.base, bytes) else full.copy()
        held.flags.writeable = False
        with self._lock:
            old = self._entries.pop(slot, None)
            if old is not None:
                self._num_tokens -= len(old[0])
            self._entries[slot] = (held, keys)
            self._num_tokens += len(held)
            while self._num_tokens > self.max_tokens and self._entries:
                _, (gone, _) = self._entries.popitem(last=False)
                self._num_tokens -= len(gone)

    @property
    def num_tokens(self) -> int:
        """Tokens held over every entry."""
        return self._num_tokens

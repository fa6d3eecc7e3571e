"""The prompts this worker sent lately, so that an open names the start it shares with one of
them instead of sending those tokens again (CoordOpenRequest.prefix_ref; the coordinator's
side is coordinator/prompt_refs.py).

A worker's prompts mostly start alike (a system prompt, a conversation that goes on): at 32k
tokens that start is 128 KB on every open, which the coordinator receives and compares only
to find keys it holds. Each open that carried its prompt is answered with a ref to it; the
next open sends the ref and the whole blocks it shares with that prompt, and the rest. The
comparison happens here, on the worker (one vectorized pass a held prompt). A ref the
coordinator no longer holds (it restarted) costs one more round trip: the open is sent
whole and every ref held here is dropped. Thread-safe.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import numpy as np

from ..protos.prompt import PACKED_TOKEN_BYTES

KEPT = 4  # prompts held: a worker interleaving a few conversations still finds its own
MIN_REF_TOKENS = 64  # a shorter start is sent for less than the comparison costs
_INT32 = np.dtype("<i4")


class _Sent(NamedTuple):
    tokens: np.ndarray  # its first ref_tokens tokens (a view of the packed prompt sent)
    ref: bytes
    block_size: int


class SentPrompts:
    def __init__(self) -> None:
        self._held: tuple[_Sent, ...] = ()
        self._lock = threading.Lock()

    def name(self, packed: bytes) -> tuple[bytes, int]:
        """(ref, tokens) for the held prompt sharing the most whole blocks with the start of
        `packed` (a prompt as packed int32s); (b"", 0) when none shares MIN_REF_TOKENS."""
        held = self._held
        if not held or len(packed) < MIN_REF_TOKENS * PACKED_TOKEN_BYTES:
            return b"", 0
        tokens = np.frombuffer(packed, _INT32)
        best: tuple[bytes, int] = (b"", 0)
        for sent in held:
            n, bs = min(len(sent.tokens), len(tokens)), sent.block_size
            if n - n % bs <= best[1]:
                continue
            step = best[1] - best[1] % bs  # it beats the best only if the block past it is shared too
            if best[1] and not np.array_equal(sent.tokens[step : step + bs], tokens[step : step + bs]):
                continue
            differ = np.flatnonzero(sent.tokens[:n] != tokens[:n])
            shared = int(differ[0]) if len(differ) else n
            shared -= shared % sent.block_size
            if shared > best[1]:
                best = (sent.ref, shared)
        return best if best[1] >= MIN_REF_TOKENS else (b"", 0)

    def fill(self, request: Any, packed: bytes) -> int:
        """Name the start of `packed` (the whole prompt) in an open request (a CoordOpenRequest
        that carries its prompt): prefix_ref, prefix_tokens and the rest as packed_token_ids.
        The tokens named; 0 leaves the request as it is."""
        ref, named = self.name(packed)
        if named:
            request.prefix_ref, request.prefix_tokens = ref, named
            request.packed_token_ids = packed[named * PACKED_TOKEN_BYTES :]
        return named

    def learn(self, packed: bytes, reply: Any) -> None:
        """Hold the prompt an open sent whole or in part (`packed`: all of it) under the ref
        its reply (a CoordOpenResponse) gave, if any; a reply that does not fit is ignored."""
        ref, num_tokens, block_size = reply.prompt_ref, reply.prompt_ref_tokens, reply.block_size
        if not ref or block_size <= 0 or num_tokens <= 0 or num_tokens % block_size:
            return
        if num_tokens * PACKED_TOKEN_BYTES > len(packed):
            return
        sent = _Sent(np.frombuffer(packed, _INT32, num_tokens), ref, block_size)
        with self._lock:
            self._held = (sent, *(s for s in self._held if s.ref != ref))[:KEPT]

    def forget(self) -> None:
        """Drop every held prompt (the coordinator answered that it holds a ref no longer)."""
        with self._lock:
            self._held = ()

"""Prompts a worker names instead of sending them again (CoordOpenRequest.prefix_ref).

A worker's next prompt mostly starts with one it sent before (a system prompt, a conversation
that goes on): at 32k tokens that is 128 KB the coordinator receives, parses and compares on
every open only to find keys it holds already. An open whose worker carries its prompt is
answered with a ref (the chain key of its last full block) and the tokens it covers; a later
open of the same tenant sends the ref and a whole number of blocks instead of those tokens,
and the rest of its prompt as before.

Trust: a ref is honoured only under the root (the tenant's salt) and block size that made it,
so a tenant names nothing but keys this coordinator hashed from tokens that tenant sent; any
other ref answers PrefixUnknown as one never given. The worker still carries the prompt to
the node, which hashes the cached prefix it receives and refuses one that does not end at
the order's key (OpenRequest.prompt_key): a worker that names one prefix and carries another
opens nothing. Bounded by the key bytes held: over it, the tenant holding the most gives up
its least recently used (a tenant flooding long prompts evicts its own refs, not another's).
Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from ..protos.errors import InvalidArgument, PrefixUnknown
from ..protos.keys import KEY_BYTES, chain_keys_packed

MAX_KEY_BYTES = 32 << 20  # ~1,000 prompts of 32k tokens at 16-token blocks
MIN_REF_BLOCKS = 4  # a shorter prompt is sent for less than its ref costs to hold


class _Tenant:
    """One root's refs, least recently used first, and the key bytes they hold."""

    __slots__ = ("held", "num_bytes")

    def __init__(self) -> None:
        self.held: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()  # ref -> block size, keys
        self.num_bytes = 0


class PromptRefs:
    """Refs per tenant root. Over the bound, the tenant holding the most gives up its oldest:
    a tenant that opens many long prompts pushes out its own refs before another's."""

    def __init__(self, max_key_bytes: int = MAX_KEY_BYTES) -> None:
        self.max_key_bytes = max_key_bytes
        self._tenants: dict[bytes, _Tenant] = {}
        self._num_bytes = 0
        self._lock = threading.Lock()

    def keep(self, root: bytes, block_size: int, keys: bytes) -> bytes:
        """Hold a prompt's packed chain keys; its ref (b"" when too short to be worth one)."""
        if len(keys) < MIN_REF_BLOCKS * KEY_BYTES:
            return b""
        ref = keys[-KEY_BYTES:]
        with self._lock:
            tenant = self._tenants.get(root)
            if tenant is None:
                tenant = self._tenants[root] = _Tenant()
            if ref in tenant.held:  # the same prompt again (its keys are the same)
                tenant.held.move_to_end(ref)
                return ref
            tenant.held[ref] = (block_size, keys)
            tenant.num_bytes += len(keys)
            self._num_bytes += len(keys)
            while self._num_bytes > self.max_key_bytes:
                largest = max(self._tenants.values(), key=lambda t: t.num_bytes)
                _, (_, gone) = largest.held.popitem(last=False)
                largest.num_bytes -= len(gone)
                self._num_bytes -= len(gone)
            if not tenant.held:  # (its one prompt was larger than the bound)
                del self._tenants[root]
                return b""
        return ref

    def keys(
        self,
        seq_id: str,
        root: bytes,
        block_size: int,
        ref: bytes,
        prefix_tokens: int,
        tail: Sequence[int] | np.ndarray,
        num_blocks: int,
    ) -> bytes:
        """The packed chain keys of a prompt's first `num_blocks` blocks, where its first
        `prefix_tokens` tokens are those of the prompt `ref` names and `tail` the rest:
        exactly chain_keys_packed over the whole prompt. InvalidArgument for a prefix that
        is no whole number of the ref's blocks; PrefixUnknown for a ref not held under this
        root and block size."""
        if prefix_tokens <= 0 or prefix_tokens % block_size:
            raise InvalidArgument(
                f"prefix_tokens must be a positive multiple of the block size ({block_size}), "
                f"got {prefix_tokens}"
            )
        with self._lock:
            tenant = self._tenants.get(root)
            held = None if tenant is None else tenant.held.get(ref)
            if held is not None:
                tenant.held.move_to_end(ref)  # type: ignore[union-attr]  # (held implies tenant)
        if held is None or held[0] != block_size:
            raise PrefixUnknown(seq_id)
        keys = held[1]
        prefix_blocks = prefix_tokens // block_size
        if prefix_blocks * KEY_BYTES > len(keys):
            raise InvalidArgument(
                f"prefix_tokens {prefix_tokens} is more than the {len(keys) // KEY_BYTES * block_size} "
                "tokens its prefix_ref names"
            )
        if num_blocks <= prefix_blocks:
            return keys[: num_blocks * KEY_BYTES]
        last = keys[(prefix_blocks - 1) * KEY_BYTES : prefix_blocks * KEY_BYTES]
        rest = chain_keys_packed(last, tail[: (num_blocks - prefix_blocks) * block_size], block_size)
        return keys[: prefix_blocks * KEY_BYTES] + rest

    @property
    def num_bytes(self) -> int:
        """Key bytes held over every ref."""
        return self._num_bytes

"""The prefix cache: block keys, finding a prompt's cached prefix, and publishing full blocks.

A full block's key chains the tenant's root key (from its salt) and every token before it
(protos/keys.py). This module computes prompts' keys (reusing the keys of prefixes that
already hit, so a shared system prompt is hashed once), finds the longest cached chain
(device tier first, then host), and makes blocks that became full findable under their
keys (STORED events), or holds them back while their K/V is still being written layer by
layer. Keys that leave the node go through removed() (REMOVED events).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from itertools import repeat

from ...protos.keys import block_hasher, chain_keys, root_key
from ..block_core import get_core
from ..block_pool import BlockPool
from .events import EventLog
from .sequence import HeldBlocks, Sequence

# Runs an iterator of side effects to its end, in C.
_consume: Callable[..., None] = deque(maxlen=0).extend


class PrefixCache:
    def __init__(
        self, block_size: int, device: BlockPool, host: BlockPool, events: EventLog, native: bool
    ) -> None:
        self.block_size = block_size
        self.device, self.host, self.events = device, host, events
        self._roots: dict[bytes, bytes] = {}
        # Shared prefixes: for a held key (device or host tier) that a prompt hit, the
        # (tokens, keys) lists of that prompt, so the next prompt with the same prefix takes
        # the keys after one list comparison instead of hashing every block again (a
        # 1024-token system prompt: 64 hashes -> 1). Only hit chains get an entry, so prompts
        # that share nothing are not retained; entries go with the key (removed()).
        # keys[i] covers tokens[i * bs : (i + 1) * bs], and keys are only taken for token
        # blocks equal to those they were computed from, so the result is exactly chain_keys'.
        self._origin: dict[bytes, tuple[list[int], list[bytes]]] = {}
        self._block_key = block_hasher(block_size)
        # One block's key straight from the token list (no slice, no packing) when compiled.
        core = get_core()[0] if native else None
        self._c_block_key = core.block_key if core is not None and core.has_chain else None
        # While set, blocks that become full get their keys in seq.keys but are not yet
        # findable (no key map entry, no STORED event): see publish_held().
        self.hold_publish = False
        self._held: list[HeldBlocks] = []

    # -- keys -------------------------------------------------------------------

    def root(self, salt: bytes) -> bytes:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = root_key(salt)
        return root

    def block_keys(self, token_ids: list[int], salt: bytes = b"") -> list[bytes]:
        """Keys of every full block of `token_ids` under `salt`. Pure."""
        return chain_keys(self.root(salt), token_ids, self.block_size)

    def prompt_keys(self, root: bytes, tokens: list[int]) -> tuple[list[bytes], int]:
        """chain_keys(root, tokens): the same keys, hashing only blocks that no shared prefix
        already covers with equal tokens. Also returns the index of the first key that no
        shared prefix indexes (index_hit() covers the rest after a hit)."""
        bs = self.block_size
        nblocks = len(tokens) // bs
        origin = self._origin
        if not origin:  # no shared prefix indexed: hash them all
            return chain_keys(root, tokens, bs), 0
        keys: list[bytes] = []
        parent = root
        i = 0
        while i < nblocks:
            key = self._block_key(parent, tokens[i * bs : (i + 1) * bs])
            keys.append(key)
            i += 1
            run = origin.get(key)
            if run is None:  # no shared prefix continues from here: hash the rest
                if i < nblocks:
                    keys += chain_keys(key, tokens[i * bs : nblocks * bs], bs)
                return keys, i - 1
            run_tokens, run_keys = run
            hi = min(nblocks, len(run_keys))
            if i > hi or run_keys[i - 1] != key:  # not the same chain position (never, short of a collision)
                parent = key
                continue
            if hi > i:
                # Blocks [i, hi) of the run continue this prompt while their tokens agree.
                if tokens[i * bs : hi * bs] == run_tokens[i * bs : hi * bs]:
                    same = hi
                else:  # binary search for the first block that differs
                    same, bad = i, hi
                    while bad - same > 1:
                        mid = (same + bad) // 2
                        if tokens[same * bs : mid * bs] == run_tokens[same * bs : mid * bs]:
                            same = mid
                        else:
                            bad = mid
                if same > i:
                    keys += run_keys[i:same]
                    i = same
            parent = keys[-1]
        return keys, nblocks

    def index_hit(self, keys: list[bytes], start: int, stop: int, run: tuple[list[int], list[bytes]]) -> None:
        """keys[start:stop] were hit: later prompts take their keys from `run` (tokens, keys)."""
        origin = self._origin
        for key in keys[start:stop]:
            origin[key] = run

    def match(self, keys: list[bytes]) -> tuple[list[int], list[int]]:
        """The longest cached chain: device blocks first, then host blocks that continue it.
        Changes nothing."""
        if not keys:
            return [], []
        dev = self.device.match(keys)
        host: list[int] = []
        if len(dev) < len(keys) and self.host.num_blocks:
            host = self.host.match(keys[len(dev) :])
        return dev, host

    def removed(self, keys: list[bytes]) -> None:
        """These keys left the node (no tier holds them any more)."""
        if self._origin:
            _consume(map(self._origin.pop, keys, repeat(None, len(keys))))
        self.events.removed(keys)

    # -- publishing ---------------------------------------------------------------

    def publish(self, seq: Sequence, first: int, stop: int) -> None:
        """Key blocks [first, stop) of the table, which just became full."""
        bs = self.block_size
        tokens = seq.tokens
        new_keys: list[bytes] = []
        hint = seq.hint
        if hint is not None:  # reuse open()'s keys while the tokens agree
            hint_tokens, hint_keys = hint
            top = min(stop, len(hint_keys))
            if top <= first:
                same = False
            elif first == 0 and top == len(hint_keys):  # a whole prompt after a miss: one slice
                same = tokens[: top * bs] == hint_tokens
            else:
                same = tokens[first * bs : top * bs] == hint_tokens[first * bs : top * bs]
            if same:
                new_keys = hint_keys[first:top]
            else:
                i = first
                while i < top and tokens[i * bs : (i + 1) * bs] == hint_tokens[i * bs : (i + 1) * bs]:
                    new_keys.append(hint_keys[i])
                    i += 1
            if first + len(new_keys) < stop or stop >= len(hint_keys):  # diverged, or used up
                seq.hint = None
        if first + len(new_keys) < stop:
            j = first + len(new_keys)
            parent = new_keys[-1] if new_keys else (seq.keys[j - 1] if j else seq.root)
            assert parent is not None
            if stop - j == 1:  # a decode step filled one block
                new_keys.append(self._block_key(parent, tokens[j * bs : stop * bs]))
            else:
                new_keys += chain_keys(parent, tokens[j * bs : stop * bs], bs)
        num_new = len(new_keys)
        seq.keys[first : first + num_new] = new_keys
        if self.hold_publish:
            self._held.append(HeldBlocks(seq, first, tuple(seq.table[first : first + num_new])))
            return
        self.register(seq, first, new_keys)

    def publish_one(self, seq: Sequence, i: int) -> None:
        """publish(seq, i, i + 1) for a decode step that filled block i."""
        if seq.hint is not None:
            self.publish(seq, i, i + 1)
            return
        bs = self.block_size
        keys, tokens = seq.keys, seq.tokens
        parent = keys[i - 1] if i else seq.root
        assert parent is not None
        c_block_key = self._c_block_key
        if c_block_key is not None:
            key = keys[i] = c_block_key(parent, tokens, i * bs, bs)
        else:
            key = keys[i] = self._block_key(parent, tokens[i * bs : (i + 1) * bs])
        block = seq.table[i]
        if self.hold_publish:
            self._held.append(HeldBlocks(seq, i, (block,)))
            return
        if self.device.publish(block, key):  # register() for one block
            host = self.host
            hb = host.lookup(key) if host.num_blocks else None
            if hb is not None:  # the node held it on the host already; the device copy replaces it
                host.drop(hb)
            self.events.stored_one(key)  # new to the node, or back on its device

    def register(self, seq: Sequence, first: int, new_keys: list[bytes]) -> None:
        """Make blocks [first, first + len(new_keys)) of seq findable under their keys. A block
        that has a key, or a key another block holds, is left as it is (that block keeps serving
        hits); a key the host tier held moves to the device (STORED: back on the device)."""
        published = self.device.publish_many(seq.table[first : first + len(new_keys)], new_keys)
        host = self.host
        if not host.num_blocks:
            self.events.stored(published)
            return
        for key in published:
            hb = host.lookup(key)
            if hb is not None:  # the node held it on the host already; the device copy replaces it
                host.drop(hb)
        self.events.stored(published)  # new to the node, or back on its device

    def take_held(self) -> list[HeldBlocks]:
        """The blocks that became full while hold_publish was set, not yet findable."""
        held, self._held = self._held, []
        return held

    def publish_held(self, held: list[HeldBlocks], seqs: dict[str, Sequence]) -> None:
        """Make held blocks findable now (their K/V is complete). Entries whose sequence was
        freed, swapped, or no longer holds those blocks are skipped: their blocks went back
        unkeyed, never cached with partial contents."""
        for h in held:
            seq = h.seq
            a, blocks = h.first, h.blocks
            if (
                seqs.get(seq.seq_id) is not seq
                or seq.host_table is not None
                or tuple(seq.table[a : a + len(blocks)]) != blocks
            ):
                continue
            keys = seq.keys[a : a + len(blocks)]
            if None in keys:
                continue
            self.register(seq, a, keys)  # type: ignore[arg-type]

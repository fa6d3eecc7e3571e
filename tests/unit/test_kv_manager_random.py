"""Seeded random operation sequences against KVCacheManager, checked by a shadow model.

Every step runs one random operation (open + prefill, append, a decode batch,
fork, free, swap out/in, pin/unpin, a token budget, attention mass, and some
deliberately bad requests), then checks:

- `check_integrity()` (refcounts, free + cached + used = total, key maps);
- content: a RecordingMover keeps a fake per-slot "KV value" for every block of
  both tiers; the test writes each appended token's value into the slots the
  manager returned, as the engine does. Every sequence's blocks must then hold
  exactly its kept tokens' values (after copy-on-write, swap round trips,
  host-tier promotions, evictions and budget drops), and every keyed block must
  hold the values its key was computed from (no cache poisoning);
- events: the keys announced STORED minus REMOVED are exactly the keys the node
  holds (device or host tier), and those announced OFFLOADED since their last
  STORED exactly the keys on its host tier;
- a failed operation (any PagedKVError) changes nothing: stats, every
  sequence's table and tokens, the event queue, and no bytes were moved.

A slot's value models real KV: it depends on the whole token prefix and the
tenant salt (a chained hash), so a block holding another sequence's tokens, or
another tenant's, never reads back right by accident.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from pagedkv.cache_node.kv_manager import (
    DEVICE,
    HOST,
    OFFLOADED,
    REMOVED,
    STORED,
    Budget,
    KVCacheManager,
    Slots,
)
from pagedkv.protos.errors import PagedKVError
from pagedkv.protos.keys import chain_keys, root_key

BLOCK_SIZE = 4
VOCAB = 40
SALTS = [b"", b"tenant-b"]


def _kv(prev: int, token: int) -> int:
    """The fake K/V of a token: a function of the whole prefix (Python's int/tuple hash is unsalted)."""
    return hash((prev, token))


class RecordingMover:
    """A BlockMover that keeps what each block of each tier holds: a list of slot values."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.content: dict[str, dict[int, list]] = {DEVICE: {}, HOST: {}}
        self.num_calls = 0

    def block(self, tier: str, b: int) -> list:
        blk = self.content[tier].get(b)
        if blk is None:
            blk = self.content[tier][b] = [None] * self.bs
        return blk

    def copy_blocks(self, src_tier: str, src: list[int], dst_tier: str, dst: list[int]) -> None:
        assert len(src) == len(dst), (src, dst)
        assert len(set(dst)) == len(dst), f"copy to duplicate destinations {dst}"
        self.num_calls += 1
        data = [list(self.block(src_tier, s)) for s in src]  # read all, then write
        for d, values in zip(dst, data, strict=True):
            self.content[dst_tier][d] = values

    def write(self, blocks: list[int], offsets: list[int], values: list[int]) -> None:
        assert len(blocks) == len(offsets) == len(values)
        for b, o, v in zip(blocks, offsets, values, strict=True):
            assert 0 <= o < self.bs
            self.block(DEVICE, b)[o] = v


@dataclass
class Shadow:
    """What one sequence must hold, computed independently of the manager."""

    salt: bytes
    tokens: list[int]  # the logical stream (num_tokens)
    kv_last: int  # value of the last logical token (the chain's tail)
    kept: list[int] = field(default_factory=list)  # values of the kept tokens, table order
    scores: list[float] = field(default_factory=list)  # per kept block
    keys: list[bytes] = field(default_factory=list)  # keys of full blocks while the chain is intact
    chain_intact: bool = True
    budget: Budget | None = None
    swapped: bool = False

    def copy(self) -> Shadow:
        return Shadow(
            self.salt,
            list(self.tokens),
            self.kv_last,
            list(self.kept),
            list(self.scores),
            list(self.keys),
            self.chain_intact,
            self.budget,
            self.swapped,
        )


class Harness:
    def __init__(self, seed: int, policy: str, num_host_blocks: int, *, num_blocks: int = 28) -> None:
        self.rng = random.Random(seed)
        self.bs = BLOCK_SIZE
        self.mover = RecordingMover(BLOCK_SIZE)
        self.mgr = KVCacheManager(
            num_blocks,
            BLOCK_SIZE,
            num_host_blocks=num_host_blocks,
            policy=policy,
            mover=self.mover,
            record_events=True,
        )
        self.shadow: dict[str, Shadow] = {}
        self.key_content: dict[bytes, tuple] = {}  # key -> the slot values its block must hold
        self.node_keys: set[bytes] = set()  # from the event stream
        self.host_keys: set[bytes] = set()  # of those, the ones announced OFFLOADED (on the host tier)
        self.pins: list[tuple[list[int], bytes]] = []
        self.next_id = 0
        self.prefixes = [[self.rng.randrange(VOCAB) for _ in range(n)] for n in (6, 9, 13, 17)]
        self.counts: dict[str, int] = {}
        self.last_batch: list[str] = []  # the last decode batch, often repeated as an engine does

    # -- the shadow model ---------------------------------------------------------

    def _extend(self, sid: str, tokens: list[int]) -> list[int]:
        """Advance the shadow by `tokens` (all kept); returns their slot values."""
        sh, bs = self.shadow[sid], self.bs
        values = []
        for t in tokens:
            sh.kv_last = _kv(sh.kv_last, t)
            sh.tokens.append(t)
            if len(sh.kept) % bs == 0:
                sh.scores.append(0.0)
            sh.kept.append(sh.kv_last)
            values.append(sh.kv_last)
            if len(sh.kept) % bs == 0 and sh.chain_intact:
                self._register_key(sh)
        return values

    def _register_key(self, sh: Shadow) -> None:
        bs, i = self.bs, len(sh.keys)
        parent = sh.keys[-1] if sh.keys else root_key(sh.salt)
        (key,) = chain_keys(parent, sh.tokens[i * bs : (i + 1) * bs], bs)
        sh.keys.append(key)
        block = tuple(sh.kept[i * bs : (i + 1) * bs])
        assert self.key_content.setdefault(key, block) == block, "one key, two contents"

    def _enforce_budget(self, sh: Shadow, incoming: int = 0) -> None:
        """The documented rule: drop the lowest-score middle blocks (ties: lowest index),
        never the sink or recent window, until the kept tokens plus `incoming` fit."""
        b, bs = sh.budget, self.bs
        if b is None or len(sh.kept) + incoming <= b.max_tokens:
            return
        nblocks = len(sh.scores)
        excess = -(-(len(sh.kept) + incoming - b.max_tokens) // bs)
        middle = sorted(
            range(b.sink_blocks, max(nblocks - b.recent_blocks, b.sink_blocks)),
            key=lambda i: (sh.scores[i], i),
        )
        drop = set(middle[:excess])
        if not drop:
            return
        sh.kept = [v for i, v in enumerate(sh.kept) if i // bs not in drop]
        sh.scores = [s for i, s in enumerate(sh.scores) if i not in drop]
        sh.chain_intact = False

    # -- checks -------------------------------------------------------------------

    def snapshot(self) -> tuple:
        m = self.mgr
        seqs = {
            sid: (
                tuple(s.table),
                None if s.host_table is None else tuple(s.host_table),
                tuple(s.tokens),
                s.cache_len,
                tuple(s.keys),
                tuple(s.scores),
                s.budget,
                s.chain_intact,
            )
            for sid, s in m.seqs.items()
        }
        return (m.stats(), seqs, list(m.events), self.mover.num_calls, dict(m.device.pins))

    def check(self) -> None:
        m, bs = self.mgr, self.bs
        m.check_integrity()
        assert set(m.seqs) == set(self.shadow)
        for ev_kind, key in m.take_events():
            if ev_kind == STORED:  # new to the node, or back from its host tier
                assert key not in self.node_keys or key in self.host_keys, "STORED twice without REMOVED"
                self.node_keys.add(key)
                self.host_keys.discard(key)
            elif ev_kind == OFFLOADED:
                assert key in self.node_keys and key not in self.host_keys, (
                    "OFFLOADED a key not on the device"
                )
                self.host_keys.add(key)
            else:
                assert ev_kind == REMOVED and key in self.node_keys, "REMOVED a key never STORED"
                self.node_keys.remove(key)
                self.host_keys.discard(key)
        assert self.node_keys == m.device.block_of_key.keys() | m.host.block_of_key.keys()
        assert self.host_keys == m.host.block_of_key.keys() - m.device.block_of_key.keys()
        for sid, sh in self.shadow.items():
            seq = m.seqs[sid]
            assert seq.num_tokens == len(sh.tokens) and seq.tokens == sh.tokens, sid
            assert seq.cache_len == len(sh.kept), (sid, seq.cache_len, len(sh.kept))
            assert seq.is_swapped == sh.swapped, sid
            assert seq.scores == pytest.approx(sh.scores), sid
            tier, table = (HOST, seq.host_table) if sh.swapped else (DEVICE, seq.table)
            assert table is not None
            assert len(table) == -(-len(sh.kept) // bs), sid
            for i, v in enumerate(sh.kept):
                got = self.mover.block(tier, table[i // bs])[i % bs]
                assert got == v, f"{sid}: token {i} reads {got}, expected {v} ({tier} block {table[i // bs]})"
            for i, k in enumerate(seq.keys):
                if k is not None:
                    assert i < len(sh.keys) and k == sh.keys[i], f"{sid}: wrong key for block {i}"
        for tier, pool in ((DEVICE, m.device), (HOST, m.host)):
            for key, b in pool.block_of_key.items():
                want = self.key_content.get(key)
                assert want is not None, f"{tier} block {b} carries a key no sequence computed"
                assert tuple(self.mover.block(tier, b)) == want, (
                    f"{tier} block {b} does not hold its key's KV"
                )

    # -- operations ---------------------------------------------------------------

    def _pick(self, *, swapped: bool | None = None) -> str | None:
        ids = [s for s, sh in self.shadow.items() if swapped is None or sh.swapped == swapped]
        return self.rng.choice(ids) if ids else None

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def _tail_slots(self, sid: str, start: int, n: int) -> tuple[list[int], list[int]]:
        """Slots of table positions [start, start + n), computed here from the table."""
        table, bs = self.mgr.get(sid).table, self.bs
        return [table[p // bs] for p in range(start, start + n)], [p % bs for p in range(start, start + n)]

    def _append(self, sid: str, tokens: list[int]) -> None:
        if self.rng.random() < 0.5:
            slots = self.mgr.append(sid, tokens)  # raises before any shadow change
        else:  # reserve() returns the first new position; the slots follow from the table
            start = self.mgr.reserve(sid, tokens)
            slots = Slots(*self._tail_slots(sid, start, len(tokens)))
            assert start + len(tokens) == self.mgr.get(sid).cache_len
        if tokens:  # a budget makes room before the write, so new tokens are never dropped
            self._enforce_budget(self.shadow[sid], len(tokens))
        values = self._extend(sid, tokens)
        self.mover.write(slots.blocks, slots.offsets, values)

    def op_open(self) -> None:
        rng = self.rng
        sid = f"s{self.next_id}"
        self.next_id += 1
        salt = rng.choice(SALTS)
        prompt = rng.choice(self.prefixes)[: rng.randrange(3, 18)] + self._tokens(rng.randrange(0, 7))
        max_cached = rng.choice([None, None, None, 0, rng.randrange(0, len(prompt) + 3)])
        limit = len(prompt) - 1 if max_cached is None else min(max_cached, len(prompt))
        limit = max(limit, 0)
        dev, host = self.mgr.match(self.mgr.block_keys(prompt[: limit - limit % self.bs], salt))
        res = self.mgr.open(sid, prompt, salt, max_cached)
        n = res.num_cached_tokens
        assert n % self.bs == 0 and n <= limit
        assert n - res.num_host_hit_tokens == len(dev) * self.bs, "device hits must all be taken"
        assert res.num_host_hit_tokens <= len(host) * self.bs
        self.shadow[sid] = Shadow(salt, [], hash(("salt", salt)))
        self._extend(sid, prompt[:n])
        if rng.random() < 0.8:
            before = self.snapshot()
            try:
                self._append(sid, prompt[n:])
            except PagedKVError:
                assert self.snapshot() == before, "failed prefill append changed the manager"
                if rng.random() < 0.5:
                    self.mgr.free(sid)
                    del self.shadow[sid]

    def op_append(self) -> None:
        sid = self._pick(swapped=False)
        if sid is not None:
            self._append(sid, self._tokens(self.rng.choice([1, 1, 2, 3, 5, 9])))

    def op_decode(self) -> None:
        active = [s for s, sh in self.shadow.items() if not sh.swapped]
        if not active:
            return
        rng = self.rng
        if self.last_batch and set(self.last_batch) <= set(active) and rng.random() < 0.7:
            batch = list(self.last_batch)  # the same batch again (the manager's decode group)
        else:
            batch = rng.sample(active, rng.randrange(1, len(active) + 1))
        tokens = self._tokens(len(batch))
        if rng.random() < 0.5:
            slots = self.mgr.append_tokens(batch if rng.random() < 0.5 else tuple(batch), tokens)
            assert len(slots.blocks) == len(slots.offsets) == len(batch)
        else:  # reserve_tokens() returns nothing: each new token is the last of its sequence
            self.mgr.reserve_tokens(batch, tokens)
            tails = [self._tail_slots(sid, self.mgr.get(sid).cache_len - 1, 1) for sid in batch]
            slots = Slots([b for (b,), _ in tails], [o for _, (o,) in tails])
        self.last_batch = batch
        group = self.mgr.decoder.group  # white-box: count the steps the cached decode group served
        if group is not None and group.ids == tuple(batch) and group.num_steps > 1:
            self.counts["decode:group"] = self.counts.get("decode:group", 0) + 1
        for i, (sid, t) in enumerate(zip(batch, tokens, strict=True)):
            self._enforce_budget(self.shadow[sid], 1)
            (value,) = self._extend(sid, [t])
            self.mover.write([slots.blocks[i]], [slots.offsets[i]], [value])

    def op_fork(self) -> None:
        parent = self._pick()
        if parent is None:
            return
        child = f"s{self.next_id}"
        self.next_id += 1
        self.mgr.fork(parent, child)
        self.shadow[child] = self.shadow[parent].copy()

    def op_free(self) -> None:
        sid = self._pick()
        if sid is not None:
            self.mgr.free(sid)
            del self.shadow[sid]

    def op_swap_out(self) -> None:
        sid = self._pick(swapped=False)
        if sid is not None:
            moved = self.mgr.swap_out(sid)
            assert moved == -(-len(self.shadow[sid].kept) // self.bs)
            self.shadow[sid].swapped = True

    def op_swap_in(self) -> None:
        sid = self._pick(swapped=True)
        if sid is not None:
            self.mgr.swap_in(sid)
            self.shadow[sid].swapped = False

    def op_pin(self) -> None:
        if len(self.pins) >= 2:
            return
        tokens, salt = self.rng.choice(self.prefixes), self.rng.choice(SALTS)
        if self.mgr.pin(tokens, salt):
            self.pins.append((tokens, salt))

    def op_unpin(self) -> None:
        if self.pins:
            tokens, salt = self.pins.pop(self.rng.randrange(len(self.pins)))
            assert self.mgr.unpin(tokens, salt) > 0

    def op_budget(self) -> None:
        sid = self._pick()
        if sid is None:
            return
        bs, rng = self.bs, self.rng
        if rng.random() < 0.3:
            budget = None
        else:
            sink, recent = rng.randrange(0, 2), rng.randrange(1, 3)
            budget = Budget(rng.randrange((sink + recent) * bs, (sink + recent + 3) * bs + 1), sink, recent)
        self.mgr.set_budget(sid, budget)
        sh = self.shadow[sid]
        sh.budget = budget
        if not sh.swapped:
            self._enforce_budget(sh)

    def op_mass(self) -> None:
        sid = self._pick()
        if sid is None:
            return
        sh = self.shadow[sid]
        mass = [round(self.rng.random(), 3) for _ in range(self.rng.randrange(0, len(sh.scores) + 2))]
        self.mgr.add_attention_mass(sid, mass)
        if not sh.swapped:
            for i, m in enumerate(mass[: len(sh.scores)]):
                sh.scores[i] += m

    def op_bad(self) -> None:
        """A request that must be refused (step() then checks that it changed nothing)."""
        rng, m = self.rng, self.mgr
        sid, swapped = self._pick(), self._pick(swapped=True)
        choice = rng.randrange(10)
        if choice == 0:
            m.append("no-such-seq", [1])
        elif sid is None:
            return
        elif choice == 1:
            m.open(sid, [1, 2, 3])  # exists already
        elif choice == 2:
            m.append_tokens([sid, sid], [1, 2])  # listed twice
        elif choice == 3:
            m.set_budget(sid, Budget(1, 1, 1))  # below (sink + recent) * block_size
        elif choice == 4:
            m.unpin(self._tokens(9), b"nobody")
        elif choice == 5:
            if swapped is None:
                return
            batch = [swapped] if sid == swapped else [sid, swapped]
            m.append_tokens(batch, self._tokens(len(batch)))  # a swapped sequence in the batch
        elif choice == 6:
            m.append_tokens([sid], [1, 2])  # more tokens than sequences
        else:  # the last decode batch (the manager's cached group) with one bad entry
            batch = [s for s in self.last_batch if s in self.shadow and not self.shadow[s].swapped]
            if not batch:
                return
            if choice == 7:
                batch.insert(rng.randrange(len(batch) + 1), "no-such-seq")
                m.reserve_tokens(batch, self._tokens(len(batch)))
            elif choice == 8:
                m.reserve_tokens(batch, self._tokens(len(batch) - 1))  # one token short
            else:
                m.append_tokens(batch + [batch[0]], self._tokens(len(batch) + 1))  # listed twice
        raise AssertionError(f"bad request {choice} was accepted")

    OPS = {
        "open": 14,
        "append": 10,
        "decode": 22,
        "fork": 5,
        "free": 10,
        "swap_out": 4,
        "swap_in": 5,
        "pin": 2,
        "unpin": 2,
        "budget": 3,
        "mass": 5,
        "bad": 3,
    }

    def step(self) -> None:
        weights = dict(self.OPS)
        if len(self.shadow) >= 7:  # keep the pool under pressure but not jammed
            weights["open"] = weights["fork"] = 0
        if self.mgr.device.num_available == 0:
            weights["free"] *= 3
        name = self.rng.choices(list(weights), weights=list(weights.values()))[0]
        before = self.snapshot()
        shadow_before = {sid: sh.copy() for sid, sh in self.shadow.items()}
        try:
            getattr(self, "op_" + name)()
            outcome = name
        except PagedKVError as e:
            outcome = f"{name}:{type(e).__name__}"
            # A refused request changes nothing (the shadow is only advanced after success).
            assert self.snapshot() == before, f"failed {name} changed the manager: {e}"
            assert {s: (sh.tokens, sh.kept) for s, sh in self.shadow.items()} == {
                s: (sh.tokens, sh.kept) for s, sh in shadow_before.items()
            }
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        self.check()


def _run(seed: int, policy: str, num_host_blocks: int, steps: int) -> Harness:
    h = Harness(seed, policy, num_host_blocks)
    for _ in range(steps):
        h.step()
    for sid in list(h.shadow):  # everything released: no block leaks
        h.mgr.free(sid)
        del h.shadow[sid]
        h.check()
    for tokens, salt in h.pins:
        h.mgr.unpin(tokens, salt)
    h.check()
    s = h.mgr.stats()
    assert s["used_blocks"] == 0 and s["host_used_blocks"] == 0
    return h


@pytest.mark.parametrize("num_host_blocks", [0, 12])
@pytest.mark.parametrize("policy", ["lru", "lfu", "score", "slru"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_operations_keep_every_invariant(seed: int, policy: str, num_host_blocks: int) -> None:
    h = _run(seed, policy, num_host_blocks, steps=1500)
    c, s = h.counts, h.mgr.stats()
    # The run really exercised the hard paths, not just the happy ones.
    assert c.get("append:CapacityExceeded", 0) + c.get("decode:CapacityExceeded", 0) > 0
    assert s["device_evictions"] > 0 and s["cow_copies"] > 0 and s["prefix_hit_tokens"] > 0
    assert s["budget_dropped_blocks"] > 0
    assert sum(v for k, v in c.items() if k.startswith("bad:")) > 0
    assert c.get("decode:group", 0) > 20 and c.get("bad:SequenceNotFound", 0) > 0
    if num_host_blocks:
        assert s["swap_out_blocks"] > 0 and s["swap_in_blocks"] > 0
        assert s["evicted_to_host"] > 0 and s["prefix_host_hit_tokens"] > 0


def test_host_tier_promotion_round_trip() -> None:
    """A prefix evicted to the host tier comes back byte-exact on the next hit."""
    mover = RecordingMover(BLOCK_SIZE)
    m = KVCacheManager(4, BLOCK_SIZE, num_host_blocks=4, mover=mover)
    prompt = list(range(9))
    m.open("a", prompt)
    slots = m.append("a", prompt)
    mover.write(slots.blocks, slots.offsets, [100 + t for t in prompt])
    m.free("a")
    m.open("b", [50 + t for t in range(16)])  # evicts a's blocks to the host
    m.append("b", [50 + t for t in range(16)])
    m.free("b")
    res = m.open("c", prompt)
    assert res.num_cached_tokens == 8 and res.num_host_hit_tokens == 8
    table = m.get("c").table
    assert [mover.block(DEVICE, b)[o] for b in table for o in range(BLOCK_SIZE)] == [
        100 + t for t in range(8)
    ]
    m.check_integrity()


def test_prompt_list_changed_by_the_caller_after_open_does_not_poison_keys() -> None:
    """open() may remember the prompt's keys for the prefill that follows; it must
    not keep the caller's list, which the caller may reuse."""
    m = KVCacheManager(8, BLOCK_SIZE)
    prompt = list(range(10))
    m.open("a", prompt)
    prompt[:] = [7] * 10  # the caller recycles its buffer
    m.append("a", prompt)
    assert m.get("a").keys[:2] == m.block_keys([7] * 8)
    m.free("a")
    assert m.open("b", list(range(10))).num_cached_tokens == 0
    m.check_integrity()


def test_exact_block_ids_free_stack_and_lru_order() -> None:
    """The ids the engine and the narrated tests rely on: block 0 first, the free
    list is a stack, a sequence is released tail first, LRU evicts oldest first."""
    m = KVCacheManager(6, BLOCK_SIZE, record_events=True)
    m.open("a", list(range(9)))
    assert m.append("a", list(range(9))).blocks == [0] * 4 + [1] * 4 + [2]
    m.free("a")  # 2 (partial, no key) -> free stack; 1 then 0 (keyed) -> LRU
    assert m.device.policy.victims_in_order() == [1, 0]
    m.open("b", [100 + t for t in range(17)])
    m.append("b", [100 + t for t in range(17)])
    assert m.get("b").table == [2, 3, 4, 5, 1]  # the stack first, then the oldest cached block
    removed = [e.key for e in m.take_events() if e.kind == REMOVED]
    assert removed == m.block_keys(list(range(8)))[1:2]  # block 1 held the second key of "a"
    m.check_integrity()

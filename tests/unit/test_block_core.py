"""The compiled block core (cache_node/csrc/) against the Python reference it replaces,
side by side on the same operations.

Two KVCacheManagers, one with native=True (the compiled Pool driving a compiled eviction
order) and one with native=False (block_pool._PythonCore and eviction.py's reference
orders), run the seeded random operation mix of test_kv_manager_random (opens with shared
prefixes, prefills, decode groups, forks, frees, swaps, pins, budgets, attention mass, bad
requests) in lockstep for every shipped policy, and after every step must agree on
everything: every block id in every table, the refcounts, the keys, the free stack and
the eviction order, pins, counters, the event queue, the outcome (or the error) of the
operation, and both pass check_integrity(). The compiled orders are also checked alone
against their references, operation by operation, errors included.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from test_kv_manager_random import BLOCK_SIZE, Harness

from pagedkv.cache_node.block_core import get_core
from pagedkv.cache_node.block_pool import BlockPool
from pagedkv.cache_node.eviction import (
    LRUPolicy,
    PythonLRU,
    PythonSLRU,
    PythonWeighted,
    make_policy,
)
from pagedkv.cache_node.kv_manager import KVCacheManager
from pagedkv.protos.errors import CapacityExceeded, IntegrityError, InvalidArgument, SequenceNotFound
from pagedkv.protos.keys import chain_keys, root_key

core, info = get_core()
needs_core = pytest.mark.skipif(core is None, reason=f"compiled block core unavailable: {info.detail}")
SHIPPED = ["lru", "lfu", "slru", "score"]


class Side(Harness):
    def __init__(self, seed: int, policy: str, num_host_blocks: int, native: bool) -> None:
        super().__init__(seed, policy, num_host_blocks)
        self.mgr = KVCacheManager(
            28,
            BLOCK_SIZE,
            num_host_blocks=num_host_blocks,
            policy=policy,
            mover=self.mover,
            record_events=True,
            native=native,
        )
        compiled = native and core is not None
        for pool in (self.mgr.device, self.mgr.host):
            assert pool.is_native == compiled
            assert (pool.policy.native_order() is not None) == compiled


def state(m: KVCacheManager) -> tuple:
    """Everything either core could change, in order where order matters."""
    pools = tuple(
        (
            p.refcount,
            p.key_of,
            list(p.block_of_key.items()),
            p.free_blocks,
            p.policy.victims_in_order(),
            p.pins,
            p.num_evictions,
        )
        for p in (m.device, m.host)
    )
    group = m.decoder.group
    seqs = [
        (
            sid,
            s.table,
            s.host_table,
            s.tokens,
            s.keys,
            s.scores,
            s.num_dropped_tokens,
            s.num_elided_tokens,
            s.cache_len,
            s.decode_group is group,
            s.simple,
            s.chain_intact,
            s.root,
            s.hint,
            s.budget,
        )
        for sid, s in m.seqs.items()
    ]
    g = None if group is None else (group.ids, group.num_steps, group.by_fill)
    return pools, seqs, g, m.events, vars(m.counters), m.stats()


@needs_core
@pytest.mark.parametrize("policy", SHIPPED)
# One random stream per host-tier size (not every seed with every size): each case already
# covers take, evict, release, revive and the decode group over 1,500 steps.
@pytest.mark.parametrize("seed, num_host_blocks", [(11, 0), (12, 12)])
def test_compiled_and_python_cores_agree_step_by_step(seed: int, policy: str, num_host_blocks: int) -> None:
    c_side = Side(seed, policy, num_host_blocks, True)
    py_side = Side(seed, policy, num_host_blocks, False)
    for step in range(1500):
        for side in (c_side, py_side):
            side.step()  # one random operation, its own checks (integrity, content, events), drains events
        assert c_side.counts == py_side.counts, f"step {step}: the outcomes differ"
        assert state(c_side.mgr) == state(py_side.mgr), f"step {step}: they disagree"
    # The compiled pool took, evicted, released and revived, through the compiled order.
    stats = c_side.mgr.stats()
    assert stats["device_evictions"] > 20 and stats["prefix_hit_tokens"] > 0, stats
    assert c_side.counts.get("decode:group", 0) > 50
    if num_host_blocks:
        assert stats["evicted_to_host"] > 0 and stats["swap_in_blocks"] > 0, stats


@needs_core
@pytest.mark.parametrize("policy", SHIPPED)
def test_large_pool_decode_groups_agree(policy: str) -> None:
    """A W1-like schedule (many sequences, batches repeated for many steps, prefix caching
    on and off, a pool small enough to evict): the same block ids and events every step,
    whether the step comes as reserve_tokens(ids, tokens) or reserve_token_pairs(pairs)."""
    rng = random.Random(SHIPPED.index(policy))
    for caching in (False, True):
        sides = [
            KVCacheManager(
                96, 4, policy=policy, enable_prefix_caching=caching, record_events=True, native=native
            )
            for native in (True, False, True, False)
        ]
        running: list[str] = []
        next_id = 0
        for step in range(800):
            if len(running) < 6 or rng.random() < 0.05:
                sid = f"r{next_id}"
                next_id += 1
                prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
                outcomes = []
                for m in sides:
                    cached = m.open(sid, prompt).num_cached_tokens
                    try:
                        outcomes.append(m.reserve(sid, prompt[cached:]))
                    except CapacityExceeded as exc:
                        outcomes.append(str(exc))
                        m.free(sid)
                assert outcomes[0] == outcomes[1] == outcomes[2] == outcomes[3]
                if isinstance(outcomes[0], int):
                    running.append(sid)
            if running and rng.random() < 0.08:
                gone = running.pop(rng.randrange(len(running)))
                for m in sides:
                    m.free(gone)
            if running:
                tokens = [rng.randrange(50) for _ in running]
                errors = []
                for j, m in enumerate(sides):
                    try:
                        if j < 2:
                            m.reserve_tokens(running, tokens)
                        else:
                            m.reserve_token_pairs(list(zip(running, tokens, strict=True)))
                        errors.append(None)
                    except CapacityExceeded as exc:
                        errors.append(str(exc))
                assert errors[0] == errors[1] == errors[2] == errors[3]
                if errors[0] is not None:
                    for m in sides:
                        m.free(running[0])
                    running.pop(0)
            assert state(sides[0]) == state(sides[1]) == state(sides[2]) == state(sides[3]), f"step {step}"
            if sides[0].decoder.group is not None:  # the compiled group against the reference
                assert isinstance(sides[0].decoder.group, core.DecodeGroup)
                assert not isinstance(sides[1].decoder.group, core.DecodeGroup)
            assert sides[0].take_event_batch() == sides[1].take_event_batch() == sides[2].take_event_batch()
            sides[3].take_event_batch()
            if step % 10 == 0:
                for m in sides:
                    m.check_integrity()
        assert sides[0].stats()["device_evictions"] > 0 or not caching
        # Without prefix caching the ids are only counted (and both cores count alike: state()).
        elided = sum(s.num_elided_tokens for s in sides[2].seqs.values())
        assert (elided > 0) != caching, elided


@needs_core
def test_double_free_raises_the_same_error_after_the_same_changes() -> None:
    pools = [BlockPool(6, LRUPolicy(native), native=native) for native in (True, False)]
    for p in pools:
        a = p.take(3, [])
        p.free([a[0]])
        with pytest.raises(IntegrityError, match=f"device block {a[0]} freed more often than referenced"):
            p.free_tail_first([a[0], a[1], a[2]])  # a[2] and a[1] are released, then a[0] raises
    assert pools[0].refcount == pools[1].refcount == [0] * 6
    assert pools[0].free_blocks == pools[1].free_blocks
    with pytest.raises(CapacityExceeded):
        pools[0].take(7, [])
    assert pools[0].free_blocks == pools[1].free_blocks  # the refused take changed nothing


@needs_core
def test_release_keeps_the_free_stack_whole_on_an_over_release() -> None:
    """An over-released block leaves the blocks before it released, the free stack exactly
    those, in order, on both cores."""
    for native in (True, False):
        m = KVCacheManager(
            8, 4, enable_prefix_caching=False, native=native
        )  # no keys: released blocks go free
        m.open("a", list(range(9)))
        m.reserve("a", list(range(9)))
        table = list(m.seqs["a"].table)  # three blocks
        d = m.device
        before = d.free_blocks
        with pytest.raises(IntegrityError, match=f"block {table[1]} freed more often"):
            d.free([table[2], table[1], table[1], table[0]])
        assert d.free_blocks == before + [table[2], table[1]] and d.refcount_of(table[0]) == 1


def test_core_builds_where_a_compiler_exists() -> None:
    """With a C compiler and Python's headers here, the pool must not silently fall back."""
    import os
    import sysconfig

    has_headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    if not (shutil.which("cc") or shutil.which("gcc")) or not has_headers:
        pytest.skip("no C compiler or no Python headers here")
    if os.environ.get("PAGEDKV_PURE_POOL", "") not in ("", "0"):
        pytest.skip("PAGEDKV_PURE_POOL is set")
    assert core is not None, info.detail
    assert info.is_available and info.detail.endswith((".so", ")"))
    for policy in SHIPPED:  # every shipped policy gets the compiled order
        m = KVCacheManager(4, 4, policy=policy)
        assert m.device.is_native and isinstance(m.device.policy.native_order(), core.Order)
    assert not KVCacheManager(4, 4, native=False).device.is_native


@pytest.mark.parametrize("native", [True, False])
def test_bad_token_pairs_are_refused_and_change_nothing(native: bool) -> None:
    m = KVCacheManager(16, 4, record_events=True, native=native)
    for sid in ("a", "b"):
        m.open(sid, [1, 2, 3])
        m.reserve(sid, [1, 2, 3])
    m.reserve_token_pairs([("a", 4), ("b", 5)])
    m.reserve_token_pairs([("a", 6), ("b", 7)])  # the decode group's step
    before = state(m)
    with pytest.raises(SequenceNotFound):
        m.reserve_token_pairs([("a", 1), ("zz", 2)])
    with pytest.raises(InvalidArgument, match="more than once"):
        m.reserve_token_pairs([("a", 1), ("a", 2)])
    with pytest.raises(InvalidArgument, match=r"\(seq_id, token\)"):
        m.reserve_token_pairs([("a", 1), ("b", 2, 3)])  # type: ignore[list-item]
    assert state(m) == before
    m.reserve_token_pairs([])  # an empty step is a no-op, as reserve_tokens([], [])
    assert state(m)[:2] == before[:2]
    assert [m.get(s).tokens for s in ("a", "b")] == [[1, 2, 3, 4, 6], [1, 2, 3, 5, 7]]
    m.reserve_token_pairs([("a", 8), ["b", 9]])  # type: ignore[list-item]  # a list pair: zip takes it
    assert [m.get(s).tokens[-1] for s in ("a", "b")] == [8, 9]
    m.check_integrity()


@needs_core
def test_one_block_key_matches_the_chain() -> None:
    """The decode path's one-block key (compiled, read from the token list) is chain_keys' key."""
    assert core is not None
    if not core.has_chain:
        pytest.skip("no compiled key chain here")
    rng = random.Random(5)
    parent = root_key(b"tenant")
    for bs in (1, 4, 16, 33):
        tokens = [rng.randrange(-(2**63), 2**63) for _ in range(5 * bs)] + [0, -1, 2**63 - 1]
        for first in (0, bs, 3 * bs + 1):
            want = chain_keys(parent, tokens[first : first + bs], bs)[0]
            assert core.block_key(parent, tokens, first, bs) == want
    with pytest.raises(ValueError):
        core.block_key(parent, [1, 2, 3], 2, 2)  # the block runs past the list
    with pytest.raises(ValueError):
        core.block_key(b"short", [1, 2], 0, 2)
    with pytest.raises(OverflowError):
        core.block_key(parent, [2**63, 1], 0, 2)  # not an int64, as chain_keys refuses it


def _orders(name: str, n: int) -> tuple[Any, Any]:
    """A compiled order and its Python reference."""
    assert core is not None
    if name == "lru":
        return core.LRUOrder(), PythonLRU()
    if name == "slru":
        return core.SLRUOrder(n, 0.4), PythonSLRU(n, 0.4)
    if name == "lfu":
        return core.HeapOrder(n, 1.0, 1.0), PythonWeighted(1, 1)
    compiled = core.HeapOrder(n, 0.0, 0.0)
    return compiled, PythonWeighted(0, 0, np.frombuffer(compiled, dtype=np.float64)[:n].copy())


def _same(fn: Callable[[Any], Any], orders: tuple[Any, Any]) -> Any:
    results = []
    for order in orders:
        try:
            results.append(("ok", fn(order)))
        except (KeyError, IndexError) as exc:
            results.append((type(exc).__name__, None))
    assert results[0] == results[1]
    return results[0]


@needs_core
@pytest.mark.parametrize("name", SHIPPED)
def test_each_compiled_order_behaves_as_its_reference(name: str) -> None:
    """Every operation a policy offers, on a random mix including the failing ones (remove of
    an absent block, pop of an empty order), with keys bound for SLRU's ghost list."""
    n = 300
    orders = _orders(name, n)
    key_of: list[bytes | None] = [b"k%d" % (b % 97) if b % 5 else None for b in range(n)]
    for order in orders:
        order.bind_keys(key_of)
    rng = random.Random(SHIPPED.index(name))
    for step in range(20000):
        b = rng.randrange(n)
        op = rng.randrange(8)
        if op <= 1:
            if b not in orders[1]:  # the contract: add() only absent blocks
                _same(lambda o, b=b: o.add(b), orders)
        elif op == 2:
            _same(lambda o, b=b: o.remove(b), orders)
        elif op == 3:
            _same(lambda o: o.pop_victim(), orders)
        elif op == 4:
            _same(lambda o, b=b: o.touch(b), orders)
        elif op == 5:
            _same(lambda o, b=b: o.forget(b), orders)
        elif op == 6 and name == "score":
            mass = rng.random()
            orders[0].add_mass(b, mass)
            orders[1].weights[b] += mass
        else:
            assert (b in orders[0]) == (b in orders[1]) and ("x" in orders[0]) is False
        assert len(orders[0]) == len(orders[1]), step
        if step % 50 == 0:
            assert orders[0].victims_in_order() == orders[1].victims_in_order(), step
    with pytest.raises(TypeError):
        orders[0].add("block")
    with pytest.raises(ValueError):
        orders[0].add(-1)


@needs_core
def test_score_mass_is_the_compiled_weights() -> None:
    """The score policy's numpy mass is a view of the compiled order's weights: a batch credited
    by np.add.at ranks the blocks the pool evicts."""
    policy = make_policy("score", 4)
    pool = BlockPool(4, policy)
    blocks = pool.take(4, [])
    for b in blocks:
        pool.publish(b, bytes([b]) * 16)
    policy.add_mass_many(np.array([0, 0, 2, 3]), np.array([0.5, 0.25, 3.0, 0.1]))  # type: ignore[attr-defined]
    pool.free(blocks)
    assert policy.victims_in_order() == [1, 3, 0, 2]
    assert policy.native_order().weight_of(0) == 0.75  # type: ignore[union-attr]
    evicted: list[bytes] = []
    assert pool.take(2, evicted) == [1, 3] and evicted == [bytes([1]) * 16, bytes([3]) * 16]
    pool.check_integrity({1: 1, 3: 1})


@needs_core
def test_a_python_policy_runs_under_the_compiled_pool() -> None:
    """A policy written in Python (no native_order) is driven through its methods by the
    compiled pool, with the reference core's results."""

    class FifoPolicy(LRUPolicy):
        name = "fifo"

        def __init__(self) -> None:
            super().__init__(native=False)
            self.calls = 0

        def add(self, block: int) -> None:
            self.calls += 1
            super().add(block)

    sides = [KVCacheManager(12, 4, policy=FifoPolicy(), native=native) for native in (True, False)]
    assert sides[0].device.is_native and sides[0].device.policy.native_order() is None
    for m in sides:
        for i in range(6):
            m.open(f"s{i}", [i] * 9)
            m.reserve(f"s{i}", [i] * 9)
            m.free(f"s{i}")
    assert state(sides[0]) == state(sides[1])
    assert sides[0].device.policy.calls > 0 and sides[0].stats()["device_evictions"] > 0  # type: ignore[attr-defined]

"""The compiled pool loops (cache_node/csrc/block_core.c) against the Python loops
they replace, side by side on the same operations.

Two KVCacheManagers, one with native=True (the C take/release/decode step) and one
with native=False (the Python code, the reference), run the seeded random operation
mix of test_kv_manager_random (opens with shared prefixes, prefills, decode groups,
forks, frees, swaps, pins, budgets, bad requests) in lockstep, and after every step
must agree on everything: every block id in every table, the refcounts, the keys,
the free list and LRU order, pins, counters, the event queue, the outcome (or the
error) of the operation, and both pass check_integrity(). A counting wrapper around
the C module proves its paths really ran.
"""

from __future__ import annotations

import random
import shutil
from collections import Counter, OrderedDict
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from test_kv_manager_random import BLOCK_SIZE, Harness

from pagedkv.cache_node.block_core import get_core
from pagedkv.cache_node.block_pool import BlockPool
from pagedkv.cache_node.eviction import LRUPolicy
from pagedkv.cache_node.kv_manager import _EMPTY_SEQUENCE, KVCacheManager, Sequence, _empty_sequence
from pagedkv.protos.errors import CapacityExceeded, IntegrityError, InvalidArgument, SequenceNotFound
from pagedkv.protos.keys import chain_keys, root_key

core, info = get_core()
needs_core = pytest.mark.skipif(core is None, reason=f"compiled pool loops unavailable: {info.detail}")


class CountingCore:
    """Forwards to the C module and counts the calls (and which take() calls evicted)."""

    def __init__(self, module: ModuleType, counts: Counter[str]) -> None:
        self._m, self.counts = module, counts

    def take(self, free: list[int], refcount: list[int], n: int, *rest: Any) -> list[int]:
        self.counts["take:evict" if n > len(free) else "take"] += 1
        return self._m.take(free, refcount, n, *rest)  # type: ignore[no-any-return]

    def release(self, *args: Any) -> int | None:
        self.counts["release"] += 1
        return self._m.release(*args)  # type: ignore[no-any-return]

    def prefill(self, *args: Any) -> int | None:
        start = self._m.prefill(*args)
        self.counts["prefill" if start is not None else "prefill:declined"] += 1
        return start  # type: ignore[no-any-return]

    def step_pairs(self, *args: Any) -> list[int] | None:
        left = self._m.step_pairs(*args)
        self.counts["step_pairs" if left is not None else "step_pairs:declined"] += 1
        return left  # type: ignore[no-any-return]

    def open_block(self, *args: Any) -> bytes | None:
        lost = self._m.open_block(*args)
        self.counts["open_block" if lost is None else "open_block:evict"] += 1
        return lost  # type: ignore[no-any-return]

    def finish_step(self, *args: Any) -> int | None:
        evicted = self._m.finish_step(*args)
        self.counts["finish_step" if evicted is not None else "finish_step:declined"] += 1
        return evicted  # type: ignore[no-any-return]

    def split_pairs(self, pairs: Any) -> tuple[tuple, tuple] | None:
        columns = self._m.split_pairs(pairs)
        self.counts["split_pairs" if columns is not None else "split_pairs:declined"] += 1
        return columns  # type: ignore[no-any-return]

    def group_fills(self, *args: Any) -> list[list[int]]:
        self.counts["group_fills"] += 1
        return self._m.group_fills(*args)  # type: ignore[no-any-return]

    def step(self, *args: Any) -> bool:
        done = self._m.step(*args)
        self.counts["step" if done else "step:declined"] += 1
        if not args[4]:  # an empty free list: any open this step evicts, in Python
            self.counts["step:free-empty"] += 1
        return done  # type: ignore[no-any-return]


ENTRY_POINTS = ("open", "reserve", "reserve_token_pairs", "take_event_batch", "free")


def has_entries(m: KVCacheManager) -> bool:
    """Whether the manager's public entry points are block_core's compiled Entries."""
    return all(type(getattr(m, name).__self__).__name__ == "Entries" for name in ENTRY_POINTS)


def without_entries(m: KVCacheManager) -> KVCacheManager:
    """The manager driven through its Python methods (its compiled entry points removed), so
    that a CountingCore swapped in afterwards sees every call of the compiled loops."""
    for name in ENTRY_POINTS:
        vars(m).pop(name, None)
    assert not any(name in vars(m) for name in ENTRY_POINTS)
    return m


class Side(Harness):
    def __init__(
        self, seed: int, num_host_blocks: int, native: bool, counts: Counter[str], entries: bool = False
    ) -> None:
        super().__init__(seed, "lru", num_host_blocks)
        self.mgr = KVCacheManager(
            28,
            BLOCK_SIZE,
            num_host_blocks=num_host_blocks,
            mover=self.mover,
            record_events=True,
            native=native,
        )
        if native and entries:  # the compiled entry points, over the compiled loops (not counted)
            assert core is not None and has_entries(self.mgr)
        elif native:
            assert core is not None and self.mgr._core is core and self.mgr.device._c is core
            without_entries(self.mgr)
            wrapped = CountingCore(core, counts)
            self.mgr._core = self.mgr.device._c = self.mgr.host._c = wrapped  # type: ignore[assignment]
        else:
            assert self.mgr._core is None and self.mgr.device._c is None and self.mgr.host._c is None


def state(m: KVCacheManager) -> tuple:
    """Everything either core could change, in order where order matters."""
    pools = tuple(
        (
            list(p.refcount),
            list(p.key_of),
            list(p.block_of_key.items()),
            list(p._free),
            p.policy.victims_in_order(),
            dict(p.pins),
            p.num_evictions,
        )
        for p in (m.device, m.host)
    )
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
            s.decode_group is m._group,
            s.simple,
            s.chain_intact,
            s.root,
            s.hint,
            s.budget,
        )
        for sid, s in m.seqs.items()
    ]
    group = m._group
    g = None if group is None else (group.ids, group.num_steps, group.by_fill)
    return pools, seqs, g, list(m._event_kinds), list(m._event_keys), vars(m.counters), m.stats()


@needs_core
@pytest.mark.parametrize("num_host_blocks", [0, 12])
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_c_and_python_cores_agree_step_by_step(seed: int, num_host_blocks: int) -> None:
    counts: Counter[str] = Counter()
    c_side = Side(seed, num_host_blocks, True, counts)
    py_side = Side(seed, num_host_blocks, False, counts)
    entry_side = Side(seed, num_host_blocks, True, counts, entries=True)
    for step in range(2000):
        for side in (c_side, py_side, entry_side):
            side.step()  # one random operation, its own checks (integrity, content, events), drains events
        assert c_side.counts == py_side.counts == entry_side.counts, f"step {step}: the outcomes differ"
        assert state(c_side.mgr) == state(py_side.mgr) == state(entry_side.mgr), f"step {step}: they disagree"
        c_side.mgr.check_integrity()
        py_side.mgr.check_integrity()
        entry_side.mgr.check_integrity()
    # The C paths really ran, including eviction and a short free list on a decode step.
    assert counts["take"] > 20 and counts["take:evict"] > 20, counts
    assert counts["release"] > 100 and counts["step"] > 100, counts
    assert counts["step:free-empty"] > 0, counts
    if not num_host_blocks:
        assert counts["finish_step"] > 50 and counts["finish_step:declined"] > 0, counts
    assert counts["prefill"] > 100 and counts["prefill:declined"] > 10, counts
    assert c_side.counts.get("decode:group", 0) > 50


@needs_core
@pytest.mark.parametrize("seed", [1, 2])
def test_large_pool_decode_groups_agree(seed: int) -> None:
    """A W1-like schedule (many sequences, batches repeated for many steps, prefix caching
    on and off, a pool small enough to evict): the same block ids and events every step,
    whether the step comes as reserve_tokens(ids, tokens) or reserve_token_pairs(pairs)."""
    rng = random.Random(seed)
    for caching in (False, True):
        sides = [
            KVCacheManager(96, 4, enable_prefix_caching=caching, record_events=True, native=native)
            for native in (True, False, True, False)
        ]
        counts: Counter[str] = Counter()
        assert core is not None
        assert has_entries(sides[0])  # the compiled entry points against the Python ones
        without_entries(sides[2])._core = sides[2].device._c = CountingCore(core, counts)  # type: ignore[assignment]
        running: list[str] = []
        next_id = 0
        for step in range(1500):
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
            assert sides[0].take_event_batch() == sides[1].take_event_batch() == sides[2].take_event_batch()
            sides[3].take_event_batch()
            for m in sides:
                m.check_integrity()
        assert sides[0].stats()["device_evictions"] > 0 or not caching
        # The compiled pairs step really ran, and declined (changing nothing) when the batch changed.
        assert counts["step_pairs"] > 500 and counts["step_pairs:declined"] > 20, counts
        assert counts["group_fills"] > 20 and counts["split_pairs"] > 20, counts
        # Without prefix caching the ids are only counted (and the pure path counts alike: state()).
        elided = sum(s.num_elided_tokens for s in sides[2].seqs.values())
        assert (elided > 0) != caching, elided


@needs_core
def test_double_free_raises_the_same_error_after_the_same_changes() -> None:
    pools = [BlockPool(6, LRUPolicy(), native=native) for native in (True, False)]
    for p in pools:
        a = p.take(3, [])
        p.free([a[0]])
        with pytest.raises(IntegrityError, match=f"device block {a[0]} freed more often than referenced"):
            p.free_tail_first([a[0], a[1], a[2]])  # a[2] and a[1] are released, then a[0] raises
    assert pools[0].refcount == pools[1].refcount == [0] * 6
    assert pools[0]._free == pools[1]._free
    with pytest.raises(CapacityExceeded):
        pools[0].take(7, [])
    assert pools[0]._free == pools[1]._free  # the refused take changed nothing


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
    assert KVCacheManager(4, 4).device._c is core
    assert KVCacheManager(4, 4, policy="lfu").device._c is None  # heap policies keep the Python loops


@needs_core
def test_new_sequence_is_the_init_made_one() -> None:
    """open()'s compiled empty sequence equals _empty_sequence's field by field, with fresh
    lists (not the template's, not shared), and a template it cannot copy is refused."""
    assert core is not None
    fields = Sequence.__dataclass_fields__
    for seq_id, root in (("a", b"r"), ("", b""), ("x" * 100, root_key(b"salt"))):
        made, want = core.new_sequence(_EMPTY_SEQUENCE, seq_id, root), _empty_sequence(seq_id, root)
        assert type(made) is Sequence
        assert [getattr(made, f) for f in fields] == [getattr(want, f) for f in fields]
        lists = [made.tokens, made.table, made.keys, made.scores]
        assert len({id(x) for x in lists}) == 4
        assert not {id(x) for x in lists} & {id(getattr(_EMPTY_SEQUENCE, f)) for f in fields}
        made.table.append(3)
        assert _EMPTY_SEQUENCE.table == [] and _empty_sequence("b", b"").table == []
    assert [getattr(_EMPTY_SEQUENCE, f) for f in fields] == [
        getattr(_empty_sequence("", b""), f) for f in fields
    ]
    with pytest.raises(TypeError, match="template's slot tokens must be an object or an empty list"):
        core.new_sequence(Sequence("a", b"", [1], [], [], []), "b", b"")
    with pytest.raises(TypeError, match="__slots__ only"):
        core.new_sequence(InvalidArgument("x"), "b", b"")
    with pytest.raises(TypeError, match="takes 3 arguments"):
        core.new_sequence(_EMPTY_SEQUENCE, "b")
    assert KVCacheManager(4, 4, policy="lfu")._new_sequence.func is core.new_sequence  # type: ignore[attr-defined]
    assert KVCacheManager(4, 4, native=False)._new_sequence is _empty_sequence


@needs_core
def test_split_pairs_is_zip_for_two_tuples_only() -> None:
    assert core is not None
    pairs = [("a", 1), ("b", 2), ("c", 3)]
    assert core.split_pairs(pairs) == tuple(zip(*pairs, strict=True)) == core.split_pairs(tuple(pairs))
    assert core.split_pairs([]) == ((), ())
    for declined in ([("a", 1), ["b", 2]], [("a", 1), ("b", 2, 3)], [("a",)], iter(pairs), "ab", 7):
        assert core.split_pairs(declined) is None
    m = KVCacheManager(16, 4, record_events=True)
    for sid in ("a", "b"):
        m.open(sid, [1, 2, 3])
    m.reserve_token_pairs([("a", 4), ["b", 5]])  # type: ignore[list-item]  # a list pair: Python's zip
    assert m.get("a").num_tokens == m.get("b").num_tokens == 1


@needs_core
def test_slot_access_matches_getattr() -> None:
    """The compiled loops read and write sequences' and groups' slots in place: an object of
    another class (the generic path) gets getattr's error, an unset slot too, changing nothing;
    a plain object with the same attributes is stepped as the group is."""
    assert core is not None
    m = KVCacheManager(16, 4, enable_prefix_caching=False)
    m.open("a", [1, 2, 3])
    m.reserve_token_pairs([("a", 4)])
    group, d = m._group, m.device
    assert group is not None
    before = state(m)
    with pytest.raises(AttributeError, match="no attribute 'ids'"):
        core.step_pairs(InvalidArgument("x"), [("a", 5)], d._free, d.refcount, d._lru, False)
    with pytest.raises(AttributeError, match="no attribute 'ids'"):
        core.step_pairs(object.__new__(type(group)), [("a", 5)], d._free, d.refcount, d._lru, False)
    assert state(m) == before
    assert core.step_pairs(group, [("a", 5)], d._free, d.refcount, d._lru, False) == ()
    assert group.num_steps == m.get("a").num_tokens == 2  # open() reserved nothing: two steps
    plain = SimpleNamespace(**{name: getattr(group, name) for name in type(group).__slots__})
    assert core.step_pairs(plain, [("a", 6)], d._free, d.refcount, d._lru, False) == ()
    assert plain.num_steps == 3 and group.num_steps == 2
    with pytest.raises(AttributeError, match="no attribute 'table'"):
        core.prefill(SimpleNamespace(tokens=[], num_dropped_tokens=0), [1], 4, d._free, d.refcount, False)
    seq = _empty_sequence("b", b"")
    assert core.prefill(seq, [1, 2, 3, 4, 5], 4, d._free, d.refcount, False) == 0
    assert seq.num_elided_tokens == 5 and len(seq.table) == 2 and seq.simple

    class Watched:
        """Slots of its own and a __setattr__ that sees the writes: the slot path must not bypass it."""

        __slots__ = type(group).__slots__

        def __setattr__(self, name: str, value: Any) -> None:
            seen.append(name)
            object.__setattr__(self, name, value)

    seen: list[str] = []
    watched = Watched()
    for name in type(group).__slots__:
        object.__setattr__(watched, name, getattr(group, name))
    assert core.step_pairs(watched, [("a", 7)], d._free, d.refcount, d._lru, False) == ()
    assert seen == ["num_steps"] and watched.num_steps == 3


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
    m = KVCacheManager(8, 4)
    assert m._c_block_key is not None and KVCacheManager(8, 4, native=False)._c_block_key is None


@needs_core
def test_lru_behaves_as_the_ordered_dict_it_replaces() -> None:
    """block_core.LRU against OrderedDict[int, None] on a random mix of every operation the
    pool and the policy use, including the failing ones."""
    assert core is not None
    lru, ref = core.LRU(), OrderedDict[int, None]()
    rng = random.Random(3)
    for step in range(20000):
        b = rng.randrange(300)
        op = rng.randrange(6)
        if op == 0:
            lru[b] = None  # an existing block keeps its place, as in an OrderedDict
            ref[b] = None
        elif op == 1:
            raised = [False, False]
            for j, d in enumerate((lru, ref)):
                try:
                    del d[b]
                except KeyError:
                    raised[j] = True
            assert raised[0] == raised[1]
        elif op == 2:
            if ref:
                last = rng.random() < 0.3
                assert lru.popitem(last=last) == ref.popitem(last=last)
            else:
                with pytest.raises(KeyError):
                    lru.popitem(last=False)
        elif op == 3:
            assert lru.pop(b, "none") == ref.pop(b, "none")
        elif op == 4:
            assert (b in lru) == (b in ref) and ("x" in lru) is False and (-1 in lru) is False
        else:
            assert list(lru) == list(ref)
        assert len(lru) == len(ref), step
    with pytest.raises(TypeError):
        lru[3] = "value"  # blocks map to None only
    with pytest.raises(TypeError):
        lru[-1] = None
    with pytest.raises(KeyError):
        lru.pop(100_000)
    lru[7] = None
    with pytest.raises(RuntimeError, match="mutated during iteration"):
        for b in lru:
            del lru[b]
    assert type(KVCacheManager(4, 4).device.policy._order) is core.LRU  # type: ignore[attr-defined]
    assert type(KVCacheManager(4, 4, native=False).device.policy._order) is OrderedDict  # type: ignore[attr-defined]

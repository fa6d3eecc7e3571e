"""KVCacheManager's compiled entry points (block_core.c's Entries): open, reserve,
reserve_token_pairs, take_event_batch and free of a native LRU manager run their common
case in C and hand every other case to the Python method. Each case here runs on a
manager with the entries and on a native=False one (the reference): the same result or
the same error, the same state afterwards (test_block_core.state), and an error changes
nothing. The random operation mixes of test_block_core and test_block_core_ops run the
entries in lockstep too.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
from test_block_core import ENTRY_POINTS, core, has_entries, needs_core, state

from pagedkv.cache_node.kv_manager import _EMPTY_SEQUENCE, _NO_EVENTS, _NO_HIT, Budget, KVCacheManager
from pagedkv.protos.errors import PagedKVError

pytestmark = needs_core


def pair(num_blocks: int = 12, **kw: Any) -> list[KVCacheManager]:
    """A manager with the compiled entries and the Python reference, alike otherwise."""
    sides = [
        KVCacheManager(num_blocks, 4, record_events=True, native=native, **kw) for native in (True, False)
    ]
    assert has_entries(sides[0]) and not any(name in vars(sides[1]) for name in ENTRY_POINTS)
    return sides


def same(sides: list[KVCacheManager], fn: Callable[[KVCacheManager], Any]) -> Any:
    """fn on both sides: the same result or error, the same state; an error changes nothing."""
    before = [state(m) for m in sides]
    outcomes = []
    for m in sides:
        try:
            outcomes.append(("ok", fn(m)))
        except (PagedKVError, TypeError) as exc:
            outcomes.append((type(exc).__name__, str(exc)))
    assert outcomes[0] == outcomes[1], outcomes
    assert state(sides[0]) == state(sides[1])
    if outcomes[0][0] != "ok" and "freed more often" not in outcomes[0][1]:
        assert [state(m) for m in sides] == before, "an error changed the state"
    for m in sides:
        m.check_integrity()
    return outcomes[0]


def test_only_native_lru_managers_get_entries() -> None:
    assert has_entries(KVCacheManager(8, 4))
    assert has_entries(KVCacheManager(8, 4, enable_prefix_caching=False, num_host_blocks=4))
    for m in (KVCacheManager(8, 4, native=False), KVCacheManager(8, 4, policy="lfu")):
        assert not any(name in vars(m) for name in ENTRY_POINTS)


def test_entries_refuse_a_bad_construction() -> None:
    assert core is not None
    m = KVCacheManager(8, 4)
    fallbacks = (m.open, m.reserve, m.reserve_token_pairs, m.take_event_batch, m.free)
    with pytest.raises(TypeError, match="five fallbacks"):
        core.Entries(m, fallbacks[:4], _EMPTY_SEQUENCE, _NO_HIT, _NO_EVENTS)
    with pytest.raises(TypeError, match="device pool has lists, dicts and the LRU"):
        core.Entries(KVCacheManager(8, 4, policy="lfu"), fallbacks, _EMPTY_SEQUENCE, _NO_HIT, _NO_EVENTS)
    with pytest.raises(AttributeError):
        core.Entries(object(), fallbacks, _EMPTY_SEQUENCE, _NO_HIT, _NO_EVENTS)


@pytest.mark.parametrize("caching", [False, True])
def test_open_and_reserve_alike_with_their_errors(caching: bool) -> None:
    sides = pair(enable_prefix_caching=caching)
    prompt = list(range(10))
    assert same(sides, lambda m: m.open("a", prompt)) == ("ok", _NO_HIT)
    assert same(sides, lambda m: m.reserve("a", prompt)) == ("ok", 0)
    assert same(sides, lambda m: m.open("a", prompt))[0] == "InvalidArgument"  # a duplicate id
    assert same(sides, lambda m: m.reserve("nope", [1]))[0] == "SequenceNotFound"
    assert same(sides, lambda m: m.reserve("a", [])) == ("ok", 10)  # nothing to add: the length
    assert same(sides, lambda m: m.reserve("a", (11, 12))) == ("ok", 10)  # a tuple: the Python path
    assert same(sides, lambda m: m.reserve("a", [1] * 100))[0] == "CapacityExceeded"
    assert same(sides, lambda m: m.open("b", prompt, b"salt")) == ("ok", _NO_HIT)  # a salt: Python
    assert same(sides, lambda m: m.open("c", prompt, max_cached_tokens=4))[0] == "ok"  # a keyword: Python
    assert same(sides, lambda m: m.open("d", iter(prompt)))[0] == "TypeError"  # no len()
    assert same(sides, lambda m: m.reserve("b", prompt, 3))[0] == "TypeError"  # too many arguments
    assert same(sides, lambda m: m.open(["unhashable"], prompt))[0] == "TypeError"
    assert sides[0].counters.prefix_query_tokens == sides[1].counters.prefix_query_tokens == 30
    if caching:  # a prefix hit (the Python open) on the blocks "a" published
        assert same(sides, lambda m: m.open("e", prompt)) == ("ok", (8, 0))
    else:
        assert same(sides, lambda m: m.open("e", prompt)) == ("ok", _NO_HIT)


def test_reserve_hands_groups_budgets_swaps_and_copies_to_python() -> None:
    sides = pair(num_host_blocks=8)
    for sid in ("a", "b"):
        same(sides, lambda m, sid=sid: m.open(sid, [1, 2, 3]))
        same(sides, lambda m, sid=sid: m.reserve(sid, [1, 2, 3]))
    same(sides, lambda m: m.reserve_token_pairs([("a", 4), ("b", 4)]))
    assert sides[0]._group is not None
    assert same(sides, lambda m: m.reserve("a", [5])) == ("ok", 4)  # a group member: the group drops
    assert sides[0]._group is None and sides[1]._group is None
    same(sides, lambda m: m.fork("a", "a2"))  # a shared partial block: copy-on-write in Python
    assert same(sides, lambda m: m.reserve("a2", [6])) == ("ok", 5)
    same(sides, lambda m: m.set_budget("b", Budget(8, 1, 1)))
    assert same(sides, lambda m: m.reserve("b", [7] * 9)) == ("ok", 4)
    same(sides, lambda m: m.swap_out("a"))
    assert same(sides, lambda m: m.reserve("a", [8]))[0] == "FailedPrecondition"
    assert same(sides, lambda m: m.free("a")) == ("ok", None)  # a swapped sequence: its host blocks


def test_decode_steps_and_events_alike() -> None:
    sides = pair(14)
    for k, sid in enumerate(("a", "b", "c")):  # distinct prompts: every full block gets published
        prompt = [10 * k + i for i in range(7)]
        same(sides, lambda m, sid=sid, prompt=prompt: m.open(sid, prompt))
        same(sides, lambda m, sid=sid, prompt=prompt: m.reserve(sid, prompt))
    assert sides[0].take_event_batch() == sides[1].take_event_batch() and sides[0].num_pending_events == 0
    assert sides[0].take_event_batch() is _NO_EVENTS  # nothing recorded: the shared empty batch
    batch = [("a", 8), ("b", 8), ("c", 8)]
    for t in range(9):  # a new group, then its steps: opens and publishes
        same(sides, lambda m, t=t: m.reserve_token_pairs([(s, tok + t) for s, tok in batch]))
        events = [tuple(map(list, m.take_event_batch())) for m in sides]
        assert events[0] == events[1]
        if t == 0:
            assert events[0][0] == ["stored"] * 3  # each sequence's first block became full
    assert same(sides, lambda m: m.reserve_token_pairs([("a", 1), ("b", 1)])) == ("ok", None)  # a new group
    assert same(sides, lambda m: m.reserve_token_pairs([("a", 1), ["b", 1]])) == ("ok", None)  # a list pair
    for bad in ([("a", 1), ("a", 2)], [("a", 1), ("zz", 1)], [("a", 1, 2)], [("a",)], [["a", 1, 2]]):
        assert same(sides, lambda m, bad=bad: m.reserve_token_pairs(bad))[0] in (
            "InvalidArgument",
            "SequenceNotFound",
        )
    assert same(sides, lambda m: m.reserve_token_pairs(pairs=[("a", 1), ("b", 1)])) == ("ok", None)
    assert same(sides, lambda m: m.take_event_batch(True))[0] == "TypeError"
    assert same(sides, lambda m: m.reserve_token_pairs([("a", 1)] * 40))[0] == "InvalidArgument"
    for _ in range(3):  # the pool's last two blocks go to the group's opens, then it is full
        same(sides, lambda m: m.reserve_token_pairs([("a", 1), ("b", 1)]))
    assert same(sides, lambda m: m.reserve_token_pairs([("a", 1), ("b", 1)]))[0] == "CapacityExceeded"


def test_free_alike_with_its_errors() -> None:
    sides = pair()
    for sid in ("a", "b"):
        same(sides, lambda m, sid=sid: m.open(sid, list(range(9))))
        same(sides, lambda m, sid=sid: m.reserve(sid, list(range(9))))
    same(sides, lambda m: m.reserve_token_pairs([("a", 1), ("b", 1)]))
    assert same(sides, lambda m: m.free("a")) == ("ok", None)  # the group drops: Python
    assert same(sides, lambda m: m.free("b")) == ("ok", None)  # no group: compiled
    assert same(sides, lambda m: m.free("b"))[0] == "SequenceNotFound"
    assert same(sides, lambda m: m.free(["unhashable"]))[0] == "SequenceNotFound"  # dict.pop of an empty dict
    assert same(sides, lambda m: m.free())[0] == "TypeError"
    same(sides, lambda m: m.open("c", [1, 2, 3, 4, 5]))
    same(sides, lambda m: m.reserve("c", [1, 2, 3, 4, 5]))
    assert same(sides, lambda m: m.free(["unhashable"]))[0] == "TypeError"
    for m in sides:  # a block the table names twice: freed more often than referenced
        m.seqs["c"].table.append(m.seqs["c"].table[0])
    outcome = same(sides, lambda m: m.free("c"))
    assert outcome[0] == "IntegrityError" and "freed more often than referenced" in outcome[1]
    assert "c" not in sides[0].seqs and "c" not in sides[1].seqs


def test_a_manager_with_entries_is_collected() -> None:
    m = KVCacheManager(8, 4)
    assert has_entries(m)
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None


def test_prefill_declines_aliased_lists() -> None:
    """prefill grows the table, keys and scores in place: lists that alias one another go to the
    Python path (None, nothing changed)."""
    assert core is not None
    m = KVCacheManager(8, 4)
    m.open("a", [1, 2, 3])
    seq = m.seqs["a"]
    seq.keys = seq.table
    free, refcount = list(m.device._free), list(m.device.refcount)
    assert core.prefill(seq, [1, 2, 3], 4, m.device._free, m.device.refcount, False) is None
    assert m.device._free == free and m.device.refcount == refcount and seq.table == []


def test_release_keeps_the_free_list_whole_on_an_over_release() -> None:
    """release grows the free list once and trims it on every exit: an over-released block leaves
    the blocks before it released, the free list exactly those, in order."""
    assert core is not None
    m = KVCacheManager(8, 4, enable_prefix_caching=False)  # no keys: every released block is free
    m.open("a", list(range(9)))
    m.reserve("a", list(range(9)))
    table = list(m.seqs["a"].table)  # three blocks
    d = m.device
    before = list(d._free)
    bad = core.release(
        [table[2], table[1], table[1], table[0]], False, d.refcount, d.key_of, d.pins, d._free, d._lru
    )
    assert bad == table[1]
    assert d._free == before + [table[2], table[1]] and d.refcount[table[0]] == 1


def test_a_subclass_that_overrides_an_entry_point_keeps_python() -> None:
    freed: list[str] = []

    class Recording(KVCacheManager):
        def free(self, seq_id: str) -> None:
            freed.append(seq_id)
            super().free(seq_id)

    m = Recording(8, 4)
    assert not any(name in vars(m) for name in ENTRY_POINTS)
    m.open("a", [1, 2, 3])
    m.free("a")
    assert freed == ["a"] and not m.seqs
    assert has_entries(type("Plain", (KVCacheManager,), {})(8, 4))  # nothing overridden: compiled

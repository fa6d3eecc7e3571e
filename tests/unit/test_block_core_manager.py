"""The manager's public operations on the compiled core against the Python reference: each
case runs on a native manager and a native=False one: the same result or the same error, the
same state afterwards (test_block_core.state), and an error changes nothing. The random
operation mixes of test_block_core and test_block_core_ops run them in lockstep too.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
from test_block_core import core, needs_core, state

from pagedkv.cache_node.kv_manager import Budget, KVCacheManager, OpenResult
from pagedkv.protos.errors import PagedKVError

pytestmark = needs_core
NO_HIT = OpenResult(0, 0)


def pair(num_blocks: int = 12, **kw: Any) -> list[KVCacheManager]:
    """A manager on the compiled core and one on the Python reference, alike otherwise."""
    sides = [
        KVCacheManager(num_blocks, 4, record_events=True, native=native, **kw) for native in (True, False)
    ]
    assert sides[0].device.is_native and not sides[1].device.is_native
    return sides


def same(sides: list[KVCacheManager], fn: Callable[[KVCacheManager], Any], *, atomic: bool = True) -> Any:
    """fn on both sides: the same result or error, the same state; an error changes nothing
    (`atomic=False`: an error may change the state, alike on both sides)."""
    before = [state(m) for m in sides]
    outcomes = []
    for m in sides:
        try:
            outcomes.append(("ok", fn(m)))
        except (PagedKVError, TypeError) as exc:
            outcomes.append((type(exc).__name__, str(exc)))
    assert outcomes[0] == outcomes[1], outcomes
    assert state(sides[0]) == state(sides[1])
    if atomic and outcomes[0][0] != "ok" and "freed more often" not in outcomes[0][1]:
        assert [state(m) for m in sides] == before, "an error changed the state"
    for m in sides:
        m.check_integrity()
    return outcomes[0]


def test_the_compiled_types_refuse_a_bad_construction() -> None:
    assert core is not None
    with pytest.raises(ValueError, match="a pool holds"):
        core.Pool(-1, core.LRUOrder())
    with pytest.raises(ValueError, match="protected_share"):
        core.SLRUOrder(4, 1.5)
    with pytest.raises(ValueError):
        core.HeapOrder(-1)
    with pytest.raises(TypeError, match="abstract"):
        core.Order()
    with pytest.raises(TypeError, match="list of keys"):
        core.LRUOrder().bind_keys(("a", "b"))


@pytest.mark.parametrize("caching", [False, True])
def test_open_and_reserve_alike_with_their_errors(caching: bool) -> None:
    sides = pair(enable_prefix_caching=caching)
    prompt = list(range(10))
    assert same(sides, lambda m: m.open("a", prompt)) == ("ok", NO_HIT)
    assert same(sides, lambda m: m.reserve("a", prompt)) == ("ok", 0)
    assert same(sides, lambda m: m.open("a", prompt))[0] == "InvalidArgument"  # a duplicate id
    assert same(sides, lambda m: m.reserve("nope", [1]))[0] == "SequenceNotFound"
    assert same(sides, lambda m: m.reserve("a", [])) == ("ok", 10)  # nothing to add: the length
    assert same(sides, lambda m: m.reserve("a", (11, 12))) == ("ok", 10)  # a tuple of tokens
    assert same(sides, lambda m: m.reserve("a", [1] * 100))[0] == "CapacityExceeded"
    assert same(sides, lambda m: m.open("b", prompt, b"salt")) == ("ok", NO_HIT)
    assert same(sides, lambda m: m.open("c", prompt, max_cached_tokens=4))[0] == "ok"
    assert same(sides, lambda m: m.open("d", iter(prompt)))[0] == "TypeError"  # no len()
    assert same(sides, lambda m: m.reserve("b", prompt, 3))[0] == "TypeError"  # too many arguments
    assert same(sides, lambda m: m.open(["unhashable"], prompt))[0] == "TypeError"
    assert sides[0].counters.prefix_query_tokens == sides[1].counters.prefix_query_tokens == 30
    if caching:  # a prefix hit on the blocks "a" published
        assert same(sides, lambda m: m.open("e", prompt)) == ("ok", (8, 0))
    else:
        assert same(sides, lambda m: m.open("e", prompt)) == ("ok", NO_HIT)


def test_reserve_with_groups_budgets_swaps_and_copies_alike() -> None:
    sides = pair(num_host_blocks=8)
    for sid in ("a", "b"):
        same(sides, lambda m, sid=sid: m.open(sid, [1, 2, 3]))
        same(sides, lambda m, sid=sid: m.reserve(sid, [1, 2, 3]))
    same(sides, lambda m: m.reserve_token_pairs([("a", 4), ("b", 4)]))
    assert sides[0].decoder.group is not None
    assert same(sides, lambda m: m.reserve("a", [5])) == ("ok", 4)  # a group member: the group drops
    assert sides[0].decoder.group is None and sides[1].decoder.group is None
    same(sides, lambda m: m.fork("a", "a2"))  # a shared partial block: copy-on-write
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
    assert sides[0].take_event_batch() == ((), ())  # nothing recorded: an empty batch
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
    assert same(sides, lambda m: m.free("a")) == ("ok", None)  # the group drops
    assert same(sides, lambda m: m.free("b")) == ("ok", None)  # no group
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


@pytest.mark.parametrize("policy", ["lru", "lfu", "slru", "score"])
def test_a_native_manager_is_collected(policy: str) -> None:
    m = KVCacheManager(8, 4, policy=policy, num_host_blocks=4)
    m.open("a", list(range(9)))
    m.reserve_token_pairs([("a", 1)])
    assert m.device.is_native
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None


def test_a_subclass_that_overrides_an_operation_is_honoured() -> None:
    freed: list[str] = []

    class Recording(KVCacheManager):
        def free(self, seq_id: str) -> None:
            freed.append(seq_id)
            super().free(seq_id)

    m = Recording(8, 4)
    m.open("a", [1, 2, 3])
    m.free("a")
    assert freed == ["a"] and not m.seqs


def test_a_compiled_group_step_compares_ids_by_value() -> None:
    """The compiled step takes ids equal to the members' (not only the same objects), and a
    step whose pairs do not name the members in order goes through the checked path."""
    assert core is not None
    sides = pair(64)
    for sid in ("seq-a", "seq-b"):
        same(sides, lambda m, sid=sid: m.open(sid, list(range(5))))
        same(sides, lambda m, sid=sid: m.reserve(sid, list(range(5))))
    same(sides, lambda m: m.reserve_token_pairs([("seq-a", 1), ("seq-b", 2)]))
    group = sides[0].decoder.group
    assert isinstance(group, core.DecodeGroup)
    equal_a = "".join(["seq", "-a"])
    assert equal_a == "seq-a" and equal_a is not group.ids[0]
    same(sides, lambda m: m.reserve_token_pairs([(equal_a, 3), ("seq-b", 4)]))
    assert sides[0].decoder.group is group and group.num_steps == 2
    same(sides, lambda m: m.reserve_token_pairs([("seq-b", 5), ("seq-a", 6)]))  # reordered: a new group
    assert sides[0].decoder.group is not group
    assert [sides[0].get(s).tokens[-3:] for s in ("seq-a", "seq-b")] == [[1, 3, 6], [2, 4, 5]]


def test_drop_blocks_releases_leading_blocks_alike() -> None:
    """drop_blocks (what budgets use; a layer window would release its leading blocks the same
    way): the blocks leave the table, a shared one keeps its other owner, the key chain ends,
    cache_len shrinks, and bad indices are refused changing nothing."""
    sides = pair(16)
    prompt = list(range(18))  # four full blocks and a partial one
    same(sides, lambda m: m.open("a", prompt))
    same(sides, lambda m: m.reserve("a", prompt))
    same(sides, lambda m: m.fork("a", "b"))
    table = list(sides[0].get("a").table)
    for bad in ([], [1, 0], [0, 0], [-1], [4], [3, 4]):  # a partial block is never dropped
        assert same(sides, lambda m, bad=bad: m.drop_blocks("a", bad))[0] == "InvalidArgument"
    assert same(sides, lambda m: m.drop_blocks("nope", [0]))[0] == "SequenceNotFound"
    assert same(sides, lambda m: m.drop_blocks("a", [0, 1])) == ("ok", None)
    a, b = sides[0].get("a"), sides[0].get("b")
    assert a.table == table[2:] and b.table == table and a.cache_len == 10 and a.num_tokens == 18
    assert not a.chain_intact and a.keys[:2] == [None, None]
    assert sides[0].device.refcount_of(table[0]) == 1  # still b's
    assert same(sides, lambda m: m.reserve("a", [7] * 6)) == ("ok", 10)  # appends go on after the drop
    assert sides[0].get("a").keys[-1] is None  # no key once the chain is broken
    # a full last block goes too (a sealed extent's, for a budget across nodes), to an empty table
    same(sides, lambda m: m.open("c", list(range(100, 108))))
    same(sides, lambda m: m.reserve("c", list(range(100, 108))))
    assert same(sides, lambda m: m.drop_blocks("c", [1])) == ("ok", None)
    assert same(sides, lambda m: m.drop_blocks("c", [0])) == ("ok", None)
    c = sides[0].get("c")
    assert c.table == [] and c.cache_len == 0 and c.num_tokens == 8
    assert same(sides, lambda m: m.reserve("c", [5])) == ("ok", 0)
    for m in sides:
        m.check_integrity()

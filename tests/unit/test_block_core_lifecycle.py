"""The compiled open, reserve and free of a manager without prefix caching (csrc/lifecycle.c)
against KVCacheManager's Python methods: the same results, errors and state, step by step."""

from __future__ import annotations

import gc
import random
import weakref
from collections.abc import Callable
from typing import Any

import pytest
from test_block_core import needs_core
from test_block_core_manager import pair, same

from pagedkv.cache_node.kv_manager import Budget, KVCacheManager, OpenResult

pytestmark = needs_core


def test_a_native_manager_without_prefix_caching_is_the_compiled_class() -> None:
    compiled, reference = pair(enable_prefix_caching=False)
    assert type(compiled).__name__ == "CompiledKVCacheManager" and isinstance(compiled, KVCacheManager)
    assert type(reference) is KVCacheManager
    assert type(KVCacheManager(8, 4)) is KVCacheManager  # prefix caching: the Python methods
    assert type(KVCacheManager(8, 4, enable_prefix_caching=False, native=False)) is KVCacheManager


def test_the_usual_and_the_unusual_cases_alike() -> None:
    sides = pair(16, enable_prefix_caching=False, num_host_blocks=8)
    assert same(sides, lambda m: m.open("a", list(range(6)))) == ("ok", OpenResult(0, 0))
    assert same(sides, lambda m: m.open("a", [1]))[0] == "InvalidArgument"
    assert same(sides, lambda m: m.open("s", [1, 2], b"salt"))[0] == "ok"  # a salt: the reference
    assert same(sides, lambda m: m.open(7, [1]))[0] == "ok"  # not a str id: the reference
    assert same(sides, lambda m: m.open("x", iter([1])))[0] == "TypeError"
    assert same(sides, lambda m: m.reserve("a", list(range(6)))) == ("ok", 0)
    assert same(sides, lambda m: m.reserve("a", (1, 2, 3))) == ("ok", 6)
    assert same(sides, lambda m: m.reserve("a", [])) == ("ok", 9)
    assert same(sides, lambda m: m.reserve("a", iter([1])))[0] == "TypeError"
    assert same(sides, lambda m: m.reserve("a", [1] * 80))[0] == "CapacityExceeded"
    assert same(sides, lambda m: m.reserve("zz", [1]))[0] == "SequenceNotFound"
    assert same(sides, lambda m: m.reserve(token_ids=[1], seq_id="a")) == ("ok", 9)
    same(sides, lambda m: m.fork("a", "b"))  # a shared partial block: the reference copies it
    assert same(sides, lambda m: m.reserve("b", [1])) == ("ok", 10)
    same(sides, lambda m: m.set_budget("b", Budget(8, 1, 1)))
    assert same(sides, lambda m: m.reserve("b", [2] * 5))[0] == "ok"
    same(sides, lambda m: m.swap_out("b"))
    assert same(sides, lambda m: m.reserve("b", [1]))[0] == "FailedPrecondition"
    assert same(sides, lambda m: m.free("b")) == ("ok", None)  # swapped: its host blocks
    assert same(sides, lambda m: m.free("a", keep_prefix=0)) == ("ok", None)
    assert same(sides, lambda m: m.free("a"))[0] == "SequenceNotFound"
    assert same(sides, lambda m: m.reserve(["unhashable"], [1]))[0] == "TypeError"
    assert same(sides, lambda m: m.free(["unhashable"]))[0] == "TypeError"
    assert same(pair(enable_prefix_caching=False), lambda m: m.free(["x"]))[0] == "SequenceNotFound"  # no ids
    same(sides, lambda m: m.reserve(7, [1, 2, 3]))
    for m in sides:  # a block the table names twice: freed more often than referenced
        m.seqs[7].table.append(m.seqs[7].table[0])
    outcome = same(sides, lambda m: m.free(7))
    assert outcome[0] == "IntegrityError" and "freed more often than referenced" in outcome[1]


def alike(sides: list[KVCacheManager], fn: Callable[[KVCacheManager], Any]) -> None:
    """same() where an error may change the state: a reserve that drops the decode group and
    then finds no room changes the group, alike on both sides."""
    same(sides, fn, atomic=False)


@pytest.mark.parametrize("seed", [3, 4])
def test_random_lifecycles_alike(seed: int) -> None:
    rng = random.Random(seed)
    sides = pair(40, enable_prefix_caching=False, num_host_blocks=10)
    live: list[str] = []
    for step in range(600):
        op = rng.random()
        if op < 0.25 or not live:
            sid = f"s{rng.randrange(30)}"
            n = rng.randrange(0, 12)
            alike(sides, lambda m, sid=sid, n=n: m.open(sid, list(range(n))))
            if sid not in live:
                live.append(sid)
        elif op < 0.5:
            sid, n = rng.choice(live), rng.randrange(0, 20)
            alike(sides, lambda m, sid=sid, n=n, t=step: m.reserve(sid, [t] * n))
        elif op < 0.7:
            batch = rng.sample(live, min(len(live), rng.randrange(1, 4)))
            alike(sides, lambda m, batch=batch, t=step: m.reserve_token_pairs([(s, t) for s in batch]))
        elif op < 0.75:
            sid, out = rng.choice(live), rng.random() < 0.5
            alike(sides, lambda m, sid=sid, out=out: m.swap_out(sid) if out else m.swap_in(sid))
        elif op < 0.8:
            sid, child = rng.choice(live), f"s{rng.randrange(30)}"
            alike(sides, lambda m, sid=sid, child=child: m.fork(sid, child))
        else:
            sid = rng.choice(live)
            alike(sides, lambda m, sid=sid: m.free(sid))
            live.remove(sid)
        live = [s for s in live if s in sides[1].seqs] + [s for s in sides[1].seqs if s not in live]


def test_a_compiled_manager_is_collected() -> None:
    m = KVCacheManager(8, 4, enable_prefix_caching=False, num_host_blocks=4)
    m.open("a", list(range(9)))
    m.reserve("a", list(range(9)))
    m.reserve_token_pairs([("a", 1)])
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None

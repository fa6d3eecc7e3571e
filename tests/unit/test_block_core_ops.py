"""Every public KVCacheManager operation, compiled core against the Python reference, in lockstep.

A seeded random mix of opens + prefills, extra prefills, decode steps (as
reserve_token_pairs, reserve_tokens and append_tokens; the same batch repeated as
an engine does, then a changed one), forks, frees, swaps, budgets and bad
requests (unknown, duplicate or malformed ids, steps too big for the pool) runs on
a native=True manager and a native=False one, with prefix caching on and off, every
shipped policy, with and without a host tier. After every operation both must report the
same outcome (the result, or the same error) and the same state (state() of
test_block_core: tables, refcounts, keys, free stack, eviction order, token counts,
the decode group, events, counters), and both pass check_integrity().
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from test_block_core import SHIPPED, core, state

from pagedkv.cache_node.kv_manager import Budget, KVCacheManager
from pagedkv.protos.errors import PagedKVError

BS = 4


def outcome(fn: Callable[[], Any]) -> Any:
    """The result of fn(), or the error it raised (its type and message)."""
    try:
        return fn()
    except PagedKVError as exc:
        return (type(exc).__name__, str(exc))


class Lockstep:
    """Runs each operation on every manager and checks that they agree."""

    def __init__(self, seed: int, caching: bool, policy: str, num_host_blocks: int) -> None:
        self.rng = random.Random(seed)
        self.sides = [
            KVCacheManager(
                40,
                BS,
                num_host_blocks=num_host_blocks,
                policy=policy,
                enable_prefix_caching=caching,
                record_events=True,
                native=native,
            )
            for native in (True, False)
        ]
        assert self.sides[0].device.is_native == (core is not None) and not self.sides[1].device.is_native
        self.running: list[str] = []
        self.batch: list[str] = []  # the last decode batch, repeated as an engine does
        self.next_id = 0
        self.prefixes = [[self.rng.randrange(50) for _ in range(n)] for n in (5, 9, 14)]

    def apply(self, name: str, fn: Callable[[KVCacheManager], Any]) -> Any:
        results = [outcome(lambda m=m: fn(m)) for m in self.sides]
        assert results[0] == results[1], f"{name}: {results}"
        assert state(self.sides[0]) == state(self.sides[1]), name
        for m in self.sides:
            m.check_integrity()
        kinds, keys = zip(*(tuple(map(list, m.take_event_batch())) for m in self.sides), strict=True)
        assert kinds[0] == kinds[1] and keys[0] == keys[1], name
        return results[0]

    def new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def step(self) -> None:
        rng, running = self.rng, self.running
        r = rng.random()
        if r < 0.12 or not running:
            sid = self.new_id()
            prompt = rng.choice(self.prefixes)[: rng.randrange(1, 15)] + [rng.randrange(50) for _ in range(3)]
            salt = rng.choice([b"", b"", b"t1"])
            cached = self.apply("open", lambda m: m.open(sid, prompt, salt).num_cached_tokens)
            got = self.apply("reserve", lambda m: m.reserve(sid, prompt[cached:]))
            if isinstance(got, int):
                running.append(sid)
            else:
                self.apply("free", lambda m: m.free(sid))
        elif r < 0.16:
            sid = rng.choice(running)
            tokens = [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
            self.apply("reserve more", lambda m: m.reserve(sid, tokens))
        elif r < 0.70:
            if not self.batch or rng.random() < 0.1 or not set(self.batch) <= set(running):
                self.batch = rng.sample(running, rng.randrange(1, len(running) + 1))
            ids = list(self.batch)
            if rng.random() < 0.04:  # a bad step: unknown id, a duplicate, or a malformed pair
                ids[rng.randrange(len(ids))] = rng.choice(["nope", ids[0]])
            tokens = [rng.randrange(50) for _ in ids]
            pairs: list[Any] = list(zip(ids, tokens, strict=True))
            if rng.random() < 0.02:
                pairs[-1] = (ids[-1], 1, 2)
            how = rng.random()
            if how < 0.7:
                got = self.apply("pairs", lambda m: m.reserve_token_pairs(list(pairs)))
            elif how < 0.85:
                got = self.apply("tokens", lambda m: m.reserve_tokens(tuple(ids), tokens))
            else:
                got = self.apply("append_tokens", lambda m: m.append_tokens(ids, tokens))
            if isinstance(got, tuple) and got and got[0] == "CapacityExceeded":
                gone = running.pop(0)  # the engine frees something and retries
                self.apply("free", lambda m: m.free(gone))
        elif r < 0.76:
            parent, child = rng.choice(running), self.new_id()
            if self.apply("fork", lambda m: m.fork(parent, child)) is None:
                running.append(child)
        elif r < 0.86:
            sid = running.pop(rng.randrange(len(running)))
            self.apply("free", lambda m: m.free(sid))
            self.apply("free again", lambda m: m.free(sid))  # SequenceNotFound, nothing changes
        elif r < 0.92:
            sid = rng.choice(running)
            if rng.random() < 0.5:
                self.apply("swap out", lambda m: m.swap_out(sid))
            else:
                self.apply("swap in", lambda m: m.swap_in(sid))
        elif r < 0.96:
            sid = rng.choice(running)
            budget = rng.choice([None, Budget(6 * BS, 1, 2), Budget(2 * BS, 1, 2)])  # the last is refused
            self.apply("budget", lambda m: m.set_budget(sid, budget))
        else:
            sid = rng.choice(running)
            self.apply("open twice", lambda m: m.open(sid, [1, 2, 3]))  # InvalidArgument
            self.apply("lengths", lambda m: (m.get(sid).num_tokens, m.get(sid).cache_len))


@pytest.mark.parametrize("num_host_blocks", [0, 8])
@pytest.mark.parametrize("policy", SHIPPED)
@pytest.mark.parametrize("caching", [False, True])
def test_random_operations_agree_step_by_step(caching: bool, policy: str, num_host_blocks: int) -> None:
    seed = (
        100
        + 10 * caching
        + 3 * (policy == "lfu")
        + 4 * (policy == "slru")
        + 7 * (policy == "score")
        + num_host_blocks
    )
    run = Lockstep(seed, caching, policy, num_host_blocks)
    for _ in range(1500):
        run.step()
    stats = run.sides[0].stats()
    assert stats["device_evictions"] > 0 or not caching, stats
    if num_host_blocks:
        assert stats["swap_out_blocks"] > 0 and stats["swap_in_blocks"] > 0, stats

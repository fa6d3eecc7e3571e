"""The policies bench.hitrate measures beside LRU and SLRU (bench/eviction_candidates.py) keep the
pool's invariants through a real replay (KVCacheManager, integrity after every request), and the
oracles bound them: Belady is never beaten, and knowing which keys are dead never loses to LRU."""

from __future__ import annotations

import pytest

from bench.eviction_candidates import CANDIDATES, DeadFirstPolicy
from bench.hitrate import Workload, replay
from bench.workloads import ChatShape, chat_requests
from pagedkv.cache_node.kv_manager import KVCacheManager

WORKLOAD = Workload(
    "chat", chat_requests(ChatShape(num_conversations=12, active=6, document_every=3)), 16, 4, [600]
)


@pytest.mark.parametrize("name", sorted(CANDIDATES))
def test_a_candidate_keeps_every_invariant_through_a_chat_replay(name: str) -> None:
    mgr = KVCacheManager(600, 16, policy=CANDIDATES[name]())
    running: list[str] = []
    hits = 0
    for i, r in enumerate(WORKLOAD.requests):
        while running and (len(running) >= 4 or mgr.device.num_available < -(-len(r.tokens) // 16)):
            mgr.free(running.pop(0))
        cached = mgr.open(str(i), r.tokens).num_cached_tokens
        mgr.reserve(str(i), r.tokens[cached:])
        running.append(str(i))
        hits += cached
        mgr.check_integrity()
    assert hits > 0 and mgr.device.num_evictions > 0  # it evicted, and kept something worth hitting


def test_the_oracles_bound_the_online_policies() -> None:
    rates = {p: replay(WORKLOAD, 600, p) for p in ("lru", "slru", *CANDIDATES, "deadfirst", "belady")}
    assert rates["belady"] == max(rates.values())
    assert rates["deadfirst"] >= rates["lru"]
    assert DeadFirstPolicy([]).name == "deadfirst"


def test_the_end_of_conversation_hint_lifts_lru_toward_the_dead_block_bound() -> None:
    # A pool small enough that LRU loses turns it will see again; the hint frees the blocks of
    # ended conversations (and one-shot documents) first, as deadfirst's perfect knowledge would.
    hinted = Workload(WORKLOAD.name, WORKLOAD.requests, 16, 4, [], keep=512)
    rates = {p: replay(hinted, 900, p) for p in ("lru", "lru+end", "deadfirst", "belady")}
    assert rates["lru"] < rates["lru+end"] <= rates["belady"]
    assert rates["lru+end"] >= rates["deadfirst"] - 0.02
    assert hinted.end_hints().count(None) < len(hinted.requests)  # some requests end a conversation

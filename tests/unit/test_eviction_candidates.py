"""The policies bench.hitrate measures beside LRU and SLRU (bench/eviction_candidates.py) keep the
pool's invariants through a real replay (KVCacheManager, integrity after every request), and the
oracles bound them: Belady is never beaten, and knowing which keys are dead never loses to LRU."""

from __future__ import annotations

import pytest

from bench.eviction_candidates import CANDIDATES, DeadFirstPolicy, DeadPredPolicy
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


def _teach(policy: DeadPredPolicy) -> list[list[bytes]]:
    """Ten three-turn conversations (each turn extends the last) and ten one-shot prompts, opened
    in order: turn 2 is always extended, turn 3 never. Returns the opens' keys."""
    opens = []
    for c in range(10):
        history: list[bytes] = []
        for turn in range(3):
            history = history + [f"c{c}t{turn}b{j}".encode() for j in range(2)]
            opens.append(history)
        opens.append([f"one{c}b{j}".encode() for j in range(4)])
    for keys in opens:
        policy.observe_open(keys)
    return opens


def test_deadpred_learns_from_the_opens_which_releases_are_wanted_again() -> None:
    policy = DeadPredPolicy()
    _teach(policy)
    # depth 1: ten first turns (extended) and ten one-shots (never); depth 2 always; depth 3 never
    assert policy.p(1) == pytest.approx(11 / 22)
    assert policy.p(2) == pytest.approx(11 / 12)
    assert policy.p(3) == pytest.approx(1 / 12)


def test_deadpred_evicts_a_release_predicted_dead_before_an_older_one_predicted_alive() -> None:
    policy = DeadPredPolicy()
    opens = _teach(policy)
    key_of: list[bytes | None] = [None] * 4
    policy.bind_keys(key_of)
    policy.observe_open([b"new0", b"new1"])  # a fresh conversation's first turn: depth 1
    policy.observe_open([b"new0", b"new1", b"new2"])  # its second: depth 2 (alive 11 / 12)
    policy.observe_open(opens[-2] + [b"late3"])  # a fourth turn: depth 4, never seen (1 / 2)
    policy.observe_open(opens[2] + [b"end"])  # depth 4 as well
    key_of[0], key_of[1], key_of[2] = b"new2", b"late3", b"c0t1b0"
    for block in (0, 1, 2):  # LRU would evict 0 first
        policy.add(block)
    # block 2 is last held by the depth-4 open above; block 0 by the depth-2 one
    order = [policy.pop_victim() for _ in range(3)]
    assert order.index(0) == 2  # the depth-2 release, predicted alive, goes last
    assert len(policy) == 0


def test_deadpred_beats_lru_where_conversations_end_and_stays_under_the_optimum() -> None:
    shape = ChatShape(
        num_conversations=60, active=10, turns=(2, 8), document_every=4, document_tokens=(512, 2048)
    )
    work = Workload("chat", chat_requests(shape), 16, 4, [])
    rates = {p: replay(work, 1200, p) for p in ("lru", "deadpred", "belady")}
    assert rates["lru"] < rates["deadpred"] <= rates["belady"]

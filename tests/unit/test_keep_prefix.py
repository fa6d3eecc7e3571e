"""KVCacheManager.free(keep_prefix=k): the worker's end-of-conversation hint. The blocks past
the first k tokens leave the cache at once (REMOVED events), unless another sequence holds them
or a pin keeps them; the kept prefix stays cached. Both cores (compiled and reference)."""

from __future__ import annotations

import pytest

from pagedkv.cache_node.kv.sequence import REMOVED
from pagedkv.cache_node.kv_manager import KVCacheManager
from pagedkv.protos.errors import InvalidArgument

BS = 4
SYSTEM = list(range(100, 108))  # 2 blocks
TURN = SYSTEM + list(range(200, 209))  # 4 full blocks + 1 partial


@pytest.fixture(params=[True, False], ids=["compiled", "reference"])
def mgr(request: pytest.FixtureRequest) -> KVCacheManager:
    return KVCacheManager(32, BS, record_events=True, native=request.param)


def run(mgr: KVCacheManager, seq_id: str, tokens: list[int]) -> int:
    cached = mgr.open(seq_id, tokens).num_cached_tokens
    mgr.reserve(seq_id, tokens[cached:])
    return cached


def removed(mgr: KVCacheManager) -> set[bytes]:
    return {e.key for e in mgr.take_events() if e.kind == REMOVED}


def test_blocks_past_the_kept_prefix_leave_the_cache_and_the_prefix_stays(mgr):
    run(mgr, "a", TURN)
    keys = mgr.block_keys(TURN)
    mgr.take_events()
    mgr.free("a", keep_prefix=len(SYSTEM))
    assert removed(mgr) == set(keys[2:])
    assert mgr.num_cached_tokens(TURN) == len(SYSTEM)  # the system prompt still hits
    assert mgr.stats()["dropped_on_close"] == 2
    assert mgr.device.num_free == 32 - 2  # everything else is free, not merely evictable
    mgr.check_integrity()


def test_keep_prefix_inside_a_block_keeps_only_the_full_blocks_before_it(mgr):
    # 9 tokens: a prompt that shares only those hits blocks 0-1; block 2 (tokens 8-11) would
    # hit only for a prompt sharing all of 0-11, which the hint says will not come.
    run(mgr, "a", TURN)
    mgr.free("a", keep_prefix=len(SYSTEM) + 1)
    assert mgr.num_cached_tokens(TURN) == 2 * BS
    mgr.check_integrity()


def test_blocks_another_sequence_holds_stay_cached_after_it_closes(mgr):
    run(mgr, "a", TURN)
    mgr.fork("a", "b")
    mgr.free("a", keep_prefix=0)
    assert mgr.stats()["dropped_on_close"] == 0  # b holds every block
    mgr.free("b")
    assert mgr.num_cached_tokens(TURN) == 4 * BS
    mgr.check_integrity()


def test_pinned_blocks_stay(mgr):
    run(mgr, "a", TURN)
    mgr.pin(TURN[: 3 * BS])
    mgr.free("a", keep_prefix=0)
    assert mgr.num_cached_tokens(TURN) == 3 * BS  # the pinned three; the fourth went
    mgr.unpin(TURN[: 3 * BS])
    mgr.check_integrity()


def test_a_swapped_sequence_drops_the_device_copies_of_its_blocks(mgr):
    m = KVCacheManager(32, BS, num_host_blocks=16, record_events=True, native=mgr.device.is_native)
    run(m, "a", TURN)
    m.swap_out("a")  # its device blocks stay cached under their keys
    assert m.num_cached_tokens(TURN) == 4 * BS
    m.take_events()
    m.free("a", keep_prefix=len(SYSTEM))
    assert m.num_cached_tokens(TURN) == len(SYSTEM)
    assert removed(m) == set(m.block_keys(TURN)[2:])
    assert m.host.num_free == 16
    m.check_integrity()


def test_a_negative_keep_prefix_is_refused_and_changes_nothing(mgr):
    run(mgr, "a", TURN)
    with pytest.raises(InvalidArgument, match="keep_prefix must be >= 0 tokens, got -1"):
        mgr.free("a", keep_prefix=-1)
    assert "a" in mgr.seqs and mgr.stats()["num_sequences"] == 1
    mgr.free("a")
    mgr.check_integrity()


def test_without_the_hint_everything_stays_cached(mgr):
    run(mgr, "a", TURN)
    mgr.free("a")
    assert mgr.num_cached_tokens(TURN) == 4 * BS and mgr.stats()["dropped_on_close"] == 0

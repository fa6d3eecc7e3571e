"""pagedkv's adapter for the shared peer benchmark (../shared/peers/kvbench).

Drives the cache node's full bookkeeping -- KVCacheManager with its device and
host BlockPools, chained SHA-256-128 block keys, the eviction policy, integrity-
relevant refcounts and the stored/removed event queue a node streams to the
coordinator -- exactly as the node server calls it, minus the tensor copies
(a NullMover), which is what the peers' block managers measure too.

    python -m kvbench.bench --adapters vllm-blockpool,bench.kvbench_adapter:PagedKVAdapter
"""

from __future__ import annotations

from kvbench.adapter import Adapter  # type: ignore[import-not-found]

from pagedkv.cache_node.kv_manager import KVCacheManager
from pagedkv.protos.errors import CapacityExceeded


class PagedKVAdapter(Adapter):
    name = "pagedkv"
    policy = "lru"

    def versions(self) -> dict:
        import pagedkv

        return {"pagedkv": pagedkv.__version__, "policy": self.policy, "prefix_hash": "sha256-128"}

    def setup(self, *, num_blocks, block_size, prefix_caching, max_running, max_model_len):
        self.mgr = KVCacheManager(
            num_blocks,
            block_size,
            policy=self.policy,
            enable_prefix_caching=prefix_caching,
            record_events=True,
        )
        self.num_events = 0
        # The manager's entry points, looked up once: the calls below are the node's calls.
        mgr = self.mgr
        self._open, self._reserve, self._free = mgr.open, mgr.reserve, mgr.free
        self._step, self._take_events = mgr.reserve_token_pairs, mgr.take_event_batch

    # Each entry point is read into a local first: an attribute read, where self._open(...) is a
    # method lookup that finds nothing on the class before it reads the instance.
    def start(self, rid, prompt):
        open_, reserve = self._open, self._reserve
        cached = open_(rid, prompt).num_cached_tokens
        try:
            reserve(rid, prompt[cached:] if cached else prompt)
        except CapacityExceeded:
            self.mgr.free(rid)
            return None
        return cached

    def decode(self, batch):
        # reserve_tokens(rids, tokens), taking the runner's (rid, token) pairs as they come
        step, take_events = self._step, self._take_events
        step(batch)
        kinds, keys = take_events()  # the node drains these every step
        if keys:
            self.num_events += len(keys)

    def finish(self, rid):
        free = self._free
        free(rid)

    def stats(self):
        s = self.mgr.stats()
        return {
            "free_blocks": s["free_blocks"],
            "cached_blocks": s["cached_blocks"],
            "events": self.num_events,
        }


class PagedKVLFUAdapter(PagedKVAdapter):
    name = "pagedkv-lfu"
    policy = "lfu"


class HarnessFloorAdapter(Adapter):
    """Does nothing: what the runner's own loop costs. Its ops/s is the ceiling any
    adapter can reach in this harness, so it bounds the ratios worth asking for."""

    name = "harness-floor"

    def setup(self, *, num_blocks, block_size, prefix_caching, max_running, max_model_len):
        pass

    def start(self, rid, prompt):
        return 0

    def decode(self, batch):
        pass

    def finish(self, rid):
        pass


class PagedKVSLRUAdapter(PagedKVAdapter):
    name = "pagedkv-slru"
    policy = "slru"


class PagedKVScoreAdapter(PagedKVAdapter):
    """The attention-score policy. The harness attends nothing, so every block scores 0 and
    the order is the release order: this prices the policy's bookkeeping, not its choices."""

    name = "pagedkv-score"
    policy = "score"

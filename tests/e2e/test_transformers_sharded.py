"""transformers generation over sequences sharded across three nodes (issue 20): every row's
KV spread over extents on three node servers (a coordinator on a real Redis, real gRPC),
generate() token-identical to DynamicCache with logits within the usual tolerance, greedy
and beam search (beams are forks of sharded sequences)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hf_helpers import LOGIT_TOL, assert_same_generation, left_pad, prompt_ids
from transformers import DynamicCache

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.server import create_server as create_node_server
from pagedkv.client.transformers import GrpcBackend, PagedKVCache, node_spec
from pagedkv.coordinator.auth import Tenants
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.redis_store import RedisStore
from pagedkv.coordinator.service import create_server as create_coordinator_server

NEW_TOKENS = 30
BLOCK_SIZE = 4
EXTENT_TOKENS = 20  # rows of 13 + 30 and 21 + 30 tokens: three extents each


def three_nodes(spec, redis_url: str) -> Iterator[tuple[str, dict[str, CacheEngine], Coordinator]]:
    """Three node servers of `spec` (512 blocks each) and a coordinator on `redis_url`, over gRPC."""
    store = RedisStore(redis_url)
    coordinator = Coordinator(store, CoordinatorConfig(lease_ttl_s=30))
    engines, servers = {}, []
    for name in ("n1", "n2", "n3"):
        engine = CacheEngine(EngineConfig(spec, 512, 0, device="cpu", unknown_seq_grace_s=5.0))
        server, port = create_node_server(engine, "127.0.0.1:0")
        servers.append(server.start())
        coordinator.register(name, f"127.0.0.1:{port}", spec.to_dict(), 512)
        coordinator.heartbeat(name, {"free_blocks": 512, "used_blocks": 0})
        engines[name] = engine
    coord_server, coord_port = create_coordinator_server(coordinator, "127.0.0.1:0", tenants=Tenants())
    coord_server.start()
    try:
        yield f"127.0.0.1:{coord_port}", engines, coordinator
    finally:
        coord_server.stop(0)
        coordinator.stop()
        for server in servers:
            server.stop(0)
        store.close()


@pytest.fixture
def cluster(model, redis_url) -> Iterator[tuple[str, dict[str, CacheEngine], Coordinator]]:
    yield from three_nodes(node_spec(model.config, BLOCK_SIZE), redis_url)


def run(model, ids, mask, cache, **kw):
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            cache=cache,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )


@pytest.mark.parametrize("beams", [1, 3], ids=["greedy", "beams"])
def test_generation_over_three_nodes_matches_dynamic_cache(model, ref_model, cluster, beams):
    address, engines, coordinator = cluster
    ids, mask = left_pad([prompt_ids(1, 13), prompt_ids(2, 21)])
    kw = {"num_beams": beams, "do_sample": False}
    if beams > 1:
        kw |= {"early_stopping": False, "output_scores": True}
    ref = run(ref_model, ids, mask, DynamicCache(config=ref_model.config), **kw)
    with GrpcBackend(coordinator=address, max_extent_tokens=EXTENT_TOKENS) as backend:
        with PagedKVCache(model, backend) as cache:
            out = run(model, ids, mask, cache, **kw)
            spans = [len(backend._seqs[s].extents) for s in cache.seq_ids]
            assert max(spans) == 3, spans
            assert all(e.stats()["num_sequences"] > 0 for e in engines.values())
            backend.check_integrity()
        coordinator.wait_idle()
        assert sum(e.stats()["num_sequences"] for e in engines.values()) == 0
        assert backend.client.counters["sharded_attends"] > 0
    for engine in engines.values():
        engine.check_integrity()
    assert_same_generation(out, ref)
    if beams > 1:
        assert torch.allclose(out.sequences_scores, ref.sequences_scores, atol=LOGIT_TOL)

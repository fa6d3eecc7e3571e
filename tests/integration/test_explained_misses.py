"""Host-tier hits and explained misses over the wire (issue 19). Real parts: a node engine
served over gRPC with its CoordinatorLink (it registers with its policy and reports STORED,
OFFLOADED and REMOVED events as a node process does), a coordinator on a real redis-server
served over gRPC, and the client library asking `open(..., explain_miss=True)`.

- a prompt whose blocks the node moved to its host tier is reported as host hits at open
  (predicted from the index, before the node opened it), the node copies them back, and the
  reason names the host tier;
- a prompt the node evicted for good names the node and its eviction policy;
- a prompt never seen is not_cached; one served whole from the device is none.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.client import CacheClient, MissExplanation
from pagedkv.protos.spec import ModelSpec

SPEC = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
A = list(range(40))  # 10 blocks; 9 cacheable (the last token is always computed)
B = list(range(1000, 1064))  # 16 blocks: the whole device, so A's cached blocks must leave it


def wait_for(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture
def stack(link_node, request):  # type: ignore[no-untyped-def]
    """One node (16 device blocks, `host_blocks` on its host tier), linked to a coordinator on
    Redis; both served over gRPC; a client of the coordinator."""
    host_blocks, policy = request.param
    engine = CacheEngine(EngineConfig(SPEC, 16, num_host_blocks=host_blocks, policy=policy, device="cpu"))
    linked = link_node(engine)
    client = CacheClient(coordinator=linked.address, spec=SPEC)
    yield engine, linked.coordinator, client
    client.close()


def run(client: CacheClient, engine: CacheEngine, seq_id: str, prompt: list[int]) -> MissExplanation:
    """Open with an explanation, append what was not cached, close; wait until the node's
    events reached the index (the coordinator's view is then the node's)."""
    seq = client.open(seq_id, prompt, explain_miss=True)
    rest = prompt[seq.num_cached_tokens :]
    kv = torch.randn(SPEC.num_layers, len(rest), SPEC.num_kv_heads, SPEC.head_dim)
    seq.append(rest, kv, kv)
    seq.close()
    wait_for(lambda: engine.num_pending_events() == 0 and engine.stats()["used_blocks"] == 0)
    time.sleep(0.05)  # the link's report in flight
    assert seq.miss is not None
    return seq.miss


@pytest.mark.parametrize("stack", [(12, "lru")], indirect=True)
def test_a_host_tier_hit_is_reported_at_open_and_explained(stack) -> None:  # type: ignore[no-untyped-def]
    engine, coordinator, client = stack
    assert run(client, engine, "a1", A) == MissExplanation("not_cached", 0)
    assert run(client, engine, "a2", A) == MissExplanation("none", 9)
    run(client, engine, "b1", B)  # B takes the whole device: A's 10 cached blocks go to the host tier
    assert engine.stats()["host_cached_blocks"] == 10
    seq = client.open("a3", A, explain_miss=True)
    assert (seq.num_cached_tokens, seq.num_host_hit_tokens) == (
        36,
        36,
    )  # predicted, before the node opened it
    assert seq.miss == MissExplanation("host_tier", 0, "n1")
    seq.append(A[36:], torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8))  # the node opened it: copied back
    assert engine.stats()["prefix_host_hit_tokens"] == 36
    seq.close()
    assert coordinator.counters["misses_host_tier"] == 1 and coordinator.counters["host_hit_tokens"] == 36


@pytest.mark.parametrize("stack", [(0, "slru")], indirect=True)
def test_an_evicted_prompt_names_the_node_and_its_policy(stack) -> None:  # type: ignore[no-untyped-def]
    engine, coordinator, client = stack
    run(client, engine, "a1", A)
    run(client, engine, "b1", B)  # no host tier: A's blocks are evicted for good (REMOVED)
    miss = run(client, engine, "a2", A)
    assert (miss.reason, miss.node_id, miss.policy) == ("evicted", "n1", "slru")
    assert miss.first_block < 9
    assert coordinator.counters["misses_evicted"] == 1
    plain = client.open("a3", A)  # not asked: no explanation in the reply
    assert plain.miss is None
    plain.close()

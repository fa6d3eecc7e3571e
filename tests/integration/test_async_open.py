"""The asynchronous open (issue 4): the coordinator answers before the node opened
the sequence. Real parts: node and coordinator gRPC servers on port 0, the
coordinator's domain object on a real Redis (redis_server fixture), the client
library over the wire.

- the node takes exactly the promised cached tokens, or fails with PrefixEvicted
  and leaves nothing behind;
- a failed node open is never lost: the first data call gets that error (a
  tombstone on the node), the coordinator drops the page table and the quota;
- a data call that overtakes the node Open waits for it (grace) instead of NOT_FOUND;
- close frees on the node asynchronously, after the open, and a reopen of the same
  id waits for that Free.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.server import create_server as create_node_server
from pagedkv.client import CacheClient, ClientConfig, OpenFailed, PrefixEvicted, Sequence
from pagedkv.client.types import Route
from pagedkv.coordinator.auth import Tenants
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.redis_store import RedisStore
from pagedkv.coordinator.service import create_server as create_coordinator_server
from pagedkv.protos.errors import InvalidArgument, SequenceNotFound
from pagedkv.protos.spec import ModelSpec

SPEC = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
TENANT = "default"  # no bearer token: the local cluster's tenant
PROMPT = list(range(40))  # 10 blocks


def kv(n: int) -> torch.Tensor:
    return torch.randn(SPEC.num_layers, n, SPEC.num_kv_heads, SPEC.head_dim)


@pytest.fixture
def stack(redis_url):
    """One node (engine in process, served over gRPC), a coordinator on Redis with a
    quota for the default tenant, served over gRPC, and a client of it."""
    engine = CacheEngine(EngineConfig(SPEC, 32, device="cpu", unknown_seq_grace_s=2.0))
    node_server, node_port = create_node_server(engine, "127.0.0.1:0")
    node_server.start()
    store = RedisStore(redis_url)
    coordinator = Coordinator(store, CoordinatorConfig(lease_ttl_s=30, quotas={TENANT: 1000}))
    coordinator.register("n1", f"127.0.0.1:{node_port}", SPEC.to_dict(), 32)
    coordinator.heartbeat("n1", {"free_blocks": 32, "used_blocks": 0})
    coord_server, coord_port = create_coordinator_server(coordinator, "127.0.0.1:0", tenants=Tenants())
    coord_server.start()
    # the coordinator's Open without waiting (the asynchronous open these tests are about)
    client = CacheClient(
        coordinator=f"127.0.0.1:{coord_port}", spec=SPEC, config=ClientConfig(worker_opens=False)
    )
    client.coordinator_address = f"127.0.0.1:{coord_port}"  # type: ignore[attr-defined]
    yield engine, coordinator, client
    client.close()
    coord_server.stop(0)
    coordinator.stop()
    node_server.stop(0)
    store.close()


def publish(coordinator: Coordinator, engine: CacheEngine) -> None:
    """What the node's CoordinatorLink does within ~10 ms of new events."""
    events = engine.take_events()
    coordinator.report_events("n1", [(1 if e.kind == "stored" else 2, e.key) for e in events])


def cache_prompt(engine: CacheEngine, coordinator: Coordinator, client: CacheClient) -> None:
    with client.open("warm", PROMPT) as seq:
        assert seq.num_cached_tokens == 0
        seq.append(PROMPT, kv(40), kv(40))  # the first data call also waits for the node open
    coordinator.wait_idle()
    publish(coordinator, engine)
    assert client.lookup(PROMPT + [1]) == 40


def evict_behind_the_index(engine: CacheEngine) -> None:
    """Fill the whole pool (32 blocks) with another sequence: the cached prompt is
    evicted, and its REMOVED events wait in the node (not reported yet)."""
    filler = list(range(1000, 1128))
    engine.open("filler", filler[:1])
    engine.append("filler", filler, kv(128), kv(128))
    engine.free("filler")
    assert engine.lookup(PROMPT) == 0


def test_open_answers_the_exact_hit_and_the_node_takes_exactly_that(stack):
    engine, coordinator, client = stack
    cache_prompt(engine, coordinator, client)
    seq = client.open("s", PROMPT + [7, 8, 9])
    assert seq.num_cached_tokens == 40
    assert seq.append([7, 8, 9], kv(3), kv(3)) == 43  # the node holds 40 + 3: it took exactly 40
    seq.close()
    coordinator.wait_idle()
    engine.check_integrity()
    assert engine.stats()["num_sequences"] == 0
    assert coordinator.store.tenant_usage(TENANT) == 0


def test_an_evicted_prefix_fails_the_first_data_call_and_drops_the_page_table(stack):
    engine, coordinator, client = stack
    cache_prompt(engine, coordinator, client)
    evict_behind_the_index(engine)  # the index does not know yet
    with engine._lock:  # hold the node Open back: the coordinator answers without it
        seq = client.open("s", PROMPT + [7])
    assert seq.num_cached_tokens == 40  # what the (stale) index promised
    with pytest.raises(PrefixEvicted, match="node holds 0 of 40 promised tokens; open it again") as info:
        seq.append([7], kv(1), kv(1))
    assert isinstance(info.value, OpenFailed) and info.value.grpc_status == "FAILED_PRECONDITION"
    coordinator.wait_idle()
    with pytest.raises(SequenceNotFound):
        coordinator.store.get_sequence("s")
    assert coordinator.store.tenant_usage(TENANT) == 0  # the quota came back
    assert coordinator.counters["open_failures"] == 1
    engine.check_integrity()
    assert engine.stats()["num_sequences"] == 0 and engine.stats()["used_blocks"] == 0
    # every data call says the same until the id is opened again
    with pytest.raises(PrefixEvicted):
        seq.read_kv()
    with contextlib.suppress(OpenFailed):  # no page table: close succeeds (idempotent) or repeats why
        seq.close()
    # reopening works once the index caught up (here: the node's events are reported)
    publish(coordinator, engine)
    with client.open("s", PROMPT + [7]) as again:
        assert again.num_cached_tokens == 0
        assert again.append(PROMPT + [7], kv(41), kv(41)) == 41
    coordinator.wait_idle()
    engine.check_integrity()
    assert engine.stats()["num_sequences"] == 0


def test_a_with_block_reports_the_open_failure_not_the_close(stack):
    engine, coordinator, client = stack
    cache_prompt(engine, coordinator, client)
    evict_behind_the_index(engine)
    with engine._lock:
        seq = client.open("w", PROMPT + [7])
    with pytest.raises(PrefixEvicted), seq:
        seq.append([7], kv(1), kv(1))
    assert seq.is_closed


def test_a_node_refusal_seen_before_the_answer_fails_the_open_itself(stack):
    engine, coordinator, client = stack
    cache_prompt(engine, coordinator, client)
    evict_behind_the_index(engine)
    try:  # the node is usually faster than the page-table write: then open() raises
        seq = client.open("f", PROMPT + [7])
    except PrefixEvicted:
        pass
    else:  # else the first data call does
        with pytest.raises(PrefixEvicted):
            seq.append([7], kv(1), kv(1))
    coordinator.wait_idle()
    with pytest.raises(SequenceNotFound):
        coordinator.store.get_sequence("f")
    assert coordinator.store.tenant_usage(TENANT) == 0
    engine.check_integrity()


def test_a_data_call_that_overtakes_the_node_open_waits_for_it(stack):
    engine, _, _ = stack
    k = kv(5)
    # the Append reaches the node first; the Open comes 0.3 s later (another connection)
    opener = threading.Timer(0.3, lambda: engine.open("late", [1, 2, 3, 4, 5], expect_cached_tokens=0))
    opener.start()
    t0 = time.monotonic()
    assert engine.await_sequence("late") is True
    assert time.monotonic() - t0 >= 0.2
    opener.join()
    engine.append("late", [1, 2, 3, 4, 5], k, k)
    assert engine.sequence_length("late") == 5
    assert engine.await_sequence("never", timeout_s=0.05) is False
    engine.free("late")
    engine.check_integrity()


def test_data_calls_over_the_wire_wait_for_a_late_open(stack):
    engine, coordinator, client = stack
    address = next(iter(coordinator._nodes_for(None).values())).address
    handle = Sequence(client, "early", Route("n1", address))
    opener = threading.Timer(0.3, lambda: engine.open("early", [1, 2, 3], expect_cached_tokens=0))
    opener.start()
    assert handle.append([1, 2, 3], kv(3), kv(3)) == 3  # waited on the node, no NOT_FOUND
    opener.join()
    engine.free("early")
    engine.check_integrity()


def test_expect_cached_tokens_refuses_bad_values_and_changes_nothing(stack):
    engine, _, _ = stack
    before = engine.stats()
    with pytest.raises(Exception, match="expect_cached_tokens must be an int in"):
        engine.open("x", [1, 2, 3], expect_cached_tokens=4)
    assert engine.stats() == before
    engine.check_integrity()


def test_close_frees_after_the_open_and_a_reopen_of_the_id_waits_for_the_free(stack):
    engine, coordinator, client = stack
    for i in range(20):  # close and reopen at once, over and over: never "already exists"
        seq = client.open("same", [i, 1, 2, 3, 4])
        seq.close()
        coordinator.heartbeat("n1", {"free_blocks": 32, "used_blocks": 0})  # as the node's link would
    with client.open("same", [9, 9, 9]) as seq:
        assert seq.append([9, 9, 9], kv(3), kv(3)) == 3
    coordinator.wait_idle()
    engine.check_integrity()
    assert engine.stats()["num_sequences"] == 0
    assert coordinator.store.tenant_usage(TENANT) == 0
    assert coordinator.counters["open_failures"] == 0


def test_fork_and_swaps_right_after_an_open_wait_for_its_node_open(stack):
    engine, coordinator, client = stack
    for i in range(5):
        seq = client.open(f"p{i}", [i, 1, 2, 3, 4, 5])
        child = seq.fork(f"c{i}")  # the coordinator waits for the parent's node Open first
        assert child.append([6], kv(1), kv(1)) == 1
        assert seq.swap_out() == 0  # an empty sequence: nothing to move, but it exists
        assert seq.swap_in() == 0
        child.close()
        seq.close()
    coordinator.wait_idle()
    engine.check_integrity()
    assert engine.stats()["num_sequences"] == 0
    assert coordinator.store.tenant_usage(TENANT) == 0  # a fork reserves its blocks, its close releases them


@pytest.mark.parametrize("big_ids", [False, True])
def test_a_carried_open_goes_packed_once_the_coordinator_reads_it_and_hits_the_same(stack, big_ids):
    """The worker carries the node Open (the default): the first open sends varints, and
    once a reply says the coordinator reads packed prompts the next ones go packed, the
    order naming the prompt and the worker carrying its cached prefix. Ids past 32 bits go
    as varints throughout. Either way the hit is exact and the node holds the prefix."""
    engine, coordinator, client = stack
    prompt = [2**40 + t for t in PROMPT] if big_ids else PROMPT
    with client.open("warm", prompt) as seq:
        seq.append(prompt, kv(40), kv(40))
    coordinator.wait_idle()
    publish(coordinator, engine)
    carrier = CacheClient(coordinator=client.coordinator_address, spec=SPEC)
    try:
        assert carrier.routing.packs_prompts is False  # nothing heard yet: varints
        for i, tokens in enumerate((prompt + [7], torch.tensor(prompt + [8]), prompt + [9])):
            with carrier.open(f"carried-{i}", tokens) as seq:
                assert seq.num_cached_tokens == 40, i
                seq.append([1], kv(1), kv(1))  # waits for the node Open the worker carried
                assert engine.sequence_length(f"carried-{i}") == 41, i
            assert carrier.routing.packs_prompts is True
            coordinator.wait_idle()
        with pytest.raises(InvalidArgument, match="int64"):
            carrier.open("bools", [1, True, 2])  # refused as the varint field refuses it
    finally:
        carrier.close()
    assert engine.manager.check_integrity() is None

"""Two workers opening prompts that start alike, at once (issue 19's in-flight dedup): the
second open is placed on the node the first is computing the shared start on and told so
(num_pending_tokens); the client waits for those blocks and opens again instead of computing
them twice, within ClientConfig.await_in_flight_s. Real parts: a node engine served over gRPC
with its CoordinatorLink, a coordinator on a real redis-server over gRPC, two clients."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.client import CacheClient, ClientConfig
from pagedkv.protos.spec import ModelSpec

SPEC = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
SYSTEM = list(range(100, 132))  # 8 blocks both prompts share
FIRST, SECOND = SYSTEM + list(range(500, 512)), SYSTEM + list(range(700, 712))


@pytest.fixture
def cluster(link_node):  # type: ignore[no-untyped-def]
    linked = link_node(CacheEngine(EngineConfig(SPEC, 64, device="cpu")))
    clients: list[CacheClient] = []

    def client(await_s: float = 2.0) -> CacheClient:
        c = CacheClient(coordinator=linked.address, spec=SPEC, config=ClientConfig(await_in_flight_s=await_s))
        clients.append(c)
        return c

    yield client, linked.coordinator
    for c in clients:
        c.close()


def append_all(seq, prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    rest = prompt[seq.num_cached_tokens :]
    kv = torch.randn(SPEC.num_layers, len(rest), SPEC.num_kv_heads, SPEC.head_dim)
    seq.append(rest, kv, kv)


def open_in_thread(client: CacheClient, seq_id: str, prompt: list[int]):  # type: ignore[no-untyped-def]
    out: dict = {}

    def go() -> None:
        start = time.monotonic()
        out["seq"] = client.open(seq_id, prompt)
        out["took_s"] = time.monotonic() - start

    thread = threading.Thread(target=go)
    thread.start()
    return thread, out


def test_the_second_open_waits_for_the_first_ones_blocks(cluster) -> None:  # type: ignore[no-untyped-def]
    client, coordinator = cluster
    first = client().open("first", FIRST)
    assert first.num_cached_tokens == 0
    thread, out = open_in_thread(client(), "second", SECOND)
    time.sleep(0.3)  # the second open is waiting: the first computes the shared start meanwhile
    assert thread.is_alive()
    append_all(first, FIRST)
    thread.join(10)
    second = out["seq"]
    assert second.num_cached_tokens == len(SYSTEM)  # the shared 8 blocks, computed once
    assert 0.3 <= out["took_s"] < 2.0
    append_all(second, SECOND)
    assert second.read_kv(0, 1)[0].shape[1] == 1  # a live sequence on the node
    first.close()
    second.close()
    assert coordinator.counters["misses_in_flight"] >= 1


def test_an_in_flight_open_that_never_computes_is_waited_for_at_most_the_bound(cluster) -> None:  # type: ignore[no-untyped-def]
    client, _ = cluster
    first = client().open("first", FIRST)  # never appends
    start = time.monotonic()
    second = client(await_s=0.5).open("second", SECOND)
    took = time.monotonic() - start
    assert second.num_cached_tokens == 0 and 0.3 <= took < 1.5
    append_all(second, SECOND)  # it computes the prompt itself: a working sequence
    second.close()
    first.close()


def test_without_waiting_the_second_open_answers_at_once(cluster) -> None:  # type: ignore[no-untyped-def]
    client, _ = cluster
    first = client().open("first", FIRST)
    start = time.monotonic()
    second = client(await_s=0.0).open("second", SECOND)
    assert second.num_cached_tokens == 0 and time.monotonic() - start < 0.3
    second.close()
    first.close()

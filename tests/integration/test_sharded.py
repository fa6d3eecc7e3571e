"""Sequences sharded across nodes (issue 20), against a float64 dense reference.

Real parts: three node engines each served over gRPC on port 0, a coordinator on a real
Redis served over gRPC, the client library over the wire. A sequence spills to a new
extent on another node when its tail reaches `max_extent_tokens` (how these tests force
uneven extents on small pools) or when its node refuses the next block; decode and prefill
then attend on every node holding an extent, merged by LSE. Every node's integrity is
checked after every step.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.server import create_server as create_node_server
from pagedkv.client import AsyncCacheClient, CacheClient, Sequence
from pagedkv.coordinator.auth import Tenants
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.quota import reserve
from pagedkv.coordinator.redis_store import RedisStore
from pagedkv.coordinator.service import create_server as create_coordinator_server
from pagedkv.protos.errors import CapacityExceeded, InvalidArgument, SequenceLost, SequenceNotFound
from pagedkv.protos.spec import ModelSpec

Q_HEADS = 4  # over 2 KV heads: GQA groups of 2


def spec_of(block_size: int) -> ModelSpec:
    return ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=block_size)


@dataclass
class Cluster:
    spec: ModelSpec
    engines: dict[str, CacheEngine]
    coordinator: Coordinator
    client: CacheClient

    def check(self) -> None:
        for engine in self.engines.values():
            engine.check_integrity()

    def held(self) -> dict[str, int]:
        """Sequences open on each node."""
        return {n: e.stats()["num_sequences"] for n, e in self.engines.items()}


def start_cluster(
    redis_url: str, spec: ModelSpec, pools: dict[str, int], quotas: dict[str, int] | None = None
) -> Iterator[Cluster]:
    store = RedisStore(redis_url)
    coordinator = Coordinator(store, CoordinatorConfig(lease_ttl_s=30, quotas=quotas or {}))
    engines, servers = {}, []
    for node_id, blocks in pools.items():
        engine = CacheEngine(EngineConfig(spec, blocks, 16, device="cpu", unknown_seq_grace_s=5.0))
        server, port = create_node_server(engine, "127.0.0.1:0")
        # what the node's CoordinatorLink does: ask the coordinator for more of the quota
        server.gate.reserve = functools.partial(reserve, coordinator, node_id)
        servers.append(server.start())
        coordinator.register(node_id, f"127.0.0.1:{port}", spec.to_dict(), blocks)
        coordinator.heartbeat(node_id, {"free_blocks": blocks, "used_blocks": 0})
        engines[node_id] = engine
    coord_server, coord_port = create_coordinator_server(coordinator, "127.0.0.1:0", tenants=Tenants())
    coord_server.start()
    client = CacheClient(coordinator=f"127.0.0.1:{coord_port}", spec=spec)
    try:
        yield Cluster(spec, engines, coordinator, client)
    finally:
        client.close()
        coord_server.stop(0)
        coordinator.stop()
        for server in servers:
            server.stop(0)
        store.close()


@pytest.fixture(params=[1, 16], ids=["bs1", "bs16"])
def cluster(request, redis_url) -> Iterator[Cluster]:
    yield from start_cluster(redis_url, spec_of(request.param), {"n1": 256, "n2": 256, "n3": 256})


class Reference:
    """The K/V a sequence was given, and float64 dense attention over it."""

    def __init__(self, spec: ModelSpec, seed: int) -> None:
        self.spec = spec
        self.gen = torch.Generator().manual_seed(seed)
        self.k = torch.zeros(spec.num_layers, 0, spec.num_kv_heads, spec.head_dim)
        self.v = torch.zeros_like(self.k)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen)

    def kv(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        k, v = (
            self.rand(s.num_layers, n, s.num_kv_heads, s.head_dim),
            self.rand(s.num_layers, n, s.num_kv_heads, s.head_dim),
        )
        self.k, self.v = torch.cat([self.k, k], 1), torch.cat([self.v, v], 1)
        return k, v

    @property
    def num_tokens(self) -> int:
        return self.k.shape[1]

    def attention(self, layer: int, q: torch.Tensor, first_query: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, Hq, D], the queries at positions first_query.. (causal), in float64."""
        k, v = self.k[layer].double(), self.v[layer].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("nhd,lhd->nhl", q.double(), k) / math.sqrt(q.shape[-1])
        pos = torch.arange(k.shape[0])
        mask = pos[None, :] > (first_query + torch.arange(q.shape[0]))[:, None]
        scores = scores.masked_fill(mask[:, None, :], float("-inf"))
        return torch.einsum("nhl,lhd->nhd", torch.softmax(scores, -1), v), torch.logsumexp(scores, -1)


def assert_close(res, ref: tuple[torch.Tensor, torch.Tensor]) -> None:
    torch.testing.assert_close(res.out.double(), ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(res.lse.double(), ref[1], atol=1e-4, rtol=1e-4)


def decode(c: Cluster, seq: Sequence, ref: Reference, token: int) -> None:
    """One decode step over every layer, checked against the reference."""
    k, v = ref.kv(1)
    for layer in range(c.spec.num_layers):
        q = ref.rand(Q_HEADS, c.spec.head_dim)
        res = seq.attend(layer, q, k[layer, 0], v[layer, 0], token if layer == 0 else None)
        assert_close(res, tuple(t[0] for t in ref.attention(layer, q[None], ref.num_tokens - 1)))
    c.check()


def prefill(c: Cluster, seq: Sequence, ref: Reference, n: int) -> None:
    """n new tokens through attend_prefill at every layer, checked against the reference."""
    start = ref.num_tokens
    k, v = ref.kv(n)
    tokens = list(range(start, start + n))
    for layer in range(c.spec.num_layers):
        q = ref.rand(n, Q_HEADS, c.spec.head_dim)
        res = seq.attend_prefill(layer, q, k[layer], v[layer], tokens if layer == 0 else None)
        assert_close(res, ref.attention(layer, q, start))
    c.check()


def extent_sizes(seq: Sequence) -> list[int]:
    firsts = [e.first_token for e in seq.extents]
    assert seq.num_tokens is not None
    return [b - a for a, b in zip(firsts, [*firsts[1:], seq.num_tokens], strict=True)]


def test_decode_and_prefill_over_three_uneven_extents(cluster: Cluster):
    c = cluster
    bs = c.spec.block_size
    ref = Reference(c.spec, seed=1)
    seq = c.client.open("long", list(range(5 * bs + 1)), max_extent_tokens=3 * bs)
    k, v = ref.kv(5 * bs + 1)
    assert seq.append(list(range(5 * bs + 1)), k, v) == 5 * bs + 1  # crosses the first seal
    c.check()
    assert [e.first_token for e in seq.extents] == [0, 3 * bs]
    seq.max_extent_tokens = 5 * bs  # the next extents are larger: uneven sizes
    for step in range(2 * bs):
        decode(c, seq, ref, 1000 + step)
    prefill(c, seq, ref, bs + 3)  # crosses the second seal mid-prefill (bs 16; at it with bs 1)
    seq.max_extent_tokens = None
    for step in range(3):
        decode(c, seq, ref, 2000 + step)
    assert len(seq.extents) == 3 and len({e.route.node_id for e in seq.extents}) == 3
    assert extent_sizes(seq) == [3 * bs, 5 * bs, ref.num_tokens - 8 * bs]
    # the node of each extent holds exactly its tokens, byte-exact
    k_all, v_all = seq.read_kv()
    torch.testing.assert_close(k_all, ref.k, rtol=0, atol=0)
    torch.testing.assert_close(v_all, ref.v, rtol=0, atol=0)
    assert c.coordinator.counters["spills"] == 2
    # a handle found by id sees every extent
    other = c.client.sequence("long")
    assert [e.route.node_id for e in other.extents] == [e.route.node_id for e in seq.extents]
    q = ref.rand(Q_HEADS, c.spec.head_dim)
    assert_close(other.attend(1, q), tuple(t[0] for t in ref.attention(1, q[None], ref.num_tokens - 1)))
    seq.close()
    c.coordinator.wait_idle()
    assert c.held() == {"n1": 0, "n2": 0, "n3": 0}  # close freed every extent
    c.check()
    with pytest.raises(SequenceNotFound):
        c.coordinator.store.get_sequence("long")


def test_read_kv_ranges_across_extent_boundaries(cluster: Cluster):
    c = cluster
    bs = c.spec.block_size
    ref = Reference(c.spec, seed=2)
    seq = c.client.open("r", [1], max_extent_tokens=2 * bs)
    n = 5 * bs + 1
    k, v = ref.kv(n)
    seq.append(list(range(n)), k, v)
    assert [e.first_token for e in seq.extents] == [0, 2 * bs, 4 * bs]
    for start, end in [(0, n), (2 * bs - 1, 2 * bs + 1), (bs, 5 * bs), (4 * bs, n), (3, 4), (2 * bs, 4 * bs)]:
        got_k, got_v = seq.read_kv(start, end)
        torch.testing.assert_close(got_k, ref.k[:, start:end], rtol=0, atol=0)
        torch.testing.assert_close(got_v, ref.v[:, start:end], rtol=0, atol=0)
    out = (torch.empty_like(ref.k[:, 1 : n - 1]), torch.empty_like(ref.v[:, 1 : n - 1]))
    assert seq.read_kv(1, n - 1, out=out) is out
    torch.testing.assert_close(out[0], ref.k[:, 1 : n - 1], rtol=0, atol=0)
    with pytest.raises(InvalidArgument, match="read_kv"):
        seq.read_kv(3, 2)
    seq.close()
    c.coordinator.wait_idle()
    assert c.held() == {"n1": 0, "n2": 0, "n3": 0}


def test_batch_mixing_sharded_and_unsharded_sequences(cluster: Cluster):
    """One decode step for a batch whose rows span one, two and three nodes: one call per node."""
    c = cluster
    bs = c.spec.block_size
    refs = [Reference(c.spec, seed=10 + i) for i in range(3)]
    caps = [None, 2 * bs, bs]
    seqs = []
    for i, (ref, cap) in enumerate(zip(refs, caps, strict=True)):
        seq = c.client.open(f"b{i}", [i], max_extent_tokens=cap)
        n = [3 * bs - 1, 3 * bs, 2 * bs + 1][i]
        k, v = ref.kv(n)
        seq.append(list(range(n)), k, v)
        seq.max_extent_tokens = None  # the tails grow from here
        seqs.append(seq)
    assert [len(s.extents) for s in seqs] == [1, 2, 3]
    for step in range(bs + 2):
        kvs = [ref.kv(1) for ref in refs]
        for layer in range(c.spec.num_layers):
            q = torch.randn(3, Q_HEADS, c.spec.head_dim)
            k = torch.stack([kv[0][layer, 0] for kv in kvs])
            v = torch.stack([kv[1][layer, 0] for kv in kvs])
            tokens = [step, step, step] if layer == 0 else None
            calls = c.client.counters["sharded_attends"]
            res = c.client.attend_batch(seqs, layer, q, k, v, tokens)
            # one call per node, though a node holds tails (append) and earlier extents (not)
            nodes = {e.route.address for s in seqs for e in s.extents}
            assert c.client.counters["sharded_attends"] - calls == len(nodes) == 3
            for row, ref in enumerate(refs):
                want = ref.attention(layer, q[row : row + 1], ref.num_tokens - 1)
                torch.testing.assert_close(res.out[row].double(), want[0][0], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(res.lse[row].double(), want[1][0], atol=1e-4, rtol=1e-4)
        c.check()
    # a prefill batch over the same mix
    counts = [2, 3, 1]
    starts = [ref.num_tokens for ref in refs]
    kvs = [ref.kv(n) for ref, n in zip(refs, counts, strict=True)]
    for layer in range(c.spec.num_layers):
        q = torch.randn(sum(counts), Q_HEADS, c.spec.head_dim)
        k = torch.cat([kv[0][layer] for kv in kvs])
        v = torch.cat([kv[1][layer] for kv in kvs])
        tokens = list(range(sum(counts))) if layer == 0 else None
        res = c.client.attend_prefill_batch(seqs, layer, counts, q, k, v, tokens)
        row = 0
        for ref, n, start in zip(refs, counts, starts, strict=True):
            want = ref.attention(layer, q[row : row + n], start)
            torch.testing.assert_close(res.out[row : row + n].double(), want[0], atol=1e-4, rtol=1e-4)
            row += n
    c.check()
    for seq in seqs:
        seq.close()
    c.coordinator.wait_idle()
    assert c.held() == {"n1": 0, "n2": 0, "n3": 0}


def test_fork_shares_every_extent_and_copies_the_tail_on_write(cluster: Cluster):
    c = cluster
    bs = c.spec.block_size
    ref = Reference(c.spec, seed=3)
    parent = c.client.open("p", [1], max_extent_tokens=2 * bs)
    n = 3 * bs + 1  # the tail's last block is partial: a write copies it
    k, v = ref.kv(n)
    parent.append(list(range(n)), k, v)
    parent.max_extent_tokens = None
    used = {name: e.stats()["used_blocks"] for name, e in c.engines.items()}
    child = parent.fork("child")
    assert [e.route.node_id for e in child.extents] == [e.route.node_id for e in parent.extents]
    assert {name: e.stats()["used_blocks"] for name, e in c.engines.items()} == used  # shared, no copy
    child_ref = Reference(c.spec, seed=4)
    child_ref.k, child_ref.v = ref.k.clone(), ref.v.clone()
    decode(c, child, child_ref, 7)  # copy-on-write in the tail
    decode(c, parent, ref, 8)
    torch.testing.assert_close(child.read_kv()[0], child_ref.k, rtol=0, atol=0)
    torch.testing.assert_close(parent.read_kv()[0], ref.k, rtol=0, atol=0)
    child.close()
    parent.close()
    c.coordinator.wait_idle()
    assert c.held() == {"n1": 0, "n2": 0, "n3": 0}
    c.check()


def test_a_sequence_grows_past_its_node_pool_and_keeps_decoding(redis_url):
    """No policy: the node refuses the next block (RESOURCE_EXHAUSTED) and the client spills."""
    spec = spec_of(4)
    for c in start_cluster(redis_url, spec, {"small": 3, "n2": 4, "n3": 64}):
        # the other nodes look full while it opens: the sequence starts on the small one
        for name in ("n2", "n3"):
            c.coordinator.heartbeat(
                name, {"free_blocks": 0, "used_blocks": c.engines[name].config.num_blocks}
            )
        ref = Reference(spec, seed=5)
        seq = c.client.open("grow", [1])
        first = seq.route.node_id
        assert first == "small"
        for name in ("n2", "n3"):
            c.coordinator.heartbeat(
                name, {"free_blocks": c.engines[name].config.num_blocks, "used_blocks": 0}
            )
        n = 6  # one and a half blocks
        k, v = ref.kv(n)
        seq.append(list(range(n)), k, v)
        pool = c.engines[first].config.num_blocks
        for step in range(pool * 4 + 9):  # past the first node's pool, and further
            decode(c, seq, ref, step)
        assert seq.extents[0].route.node_id == first and len(seq.extents) >= 2
        assert seq.extents[1].first_token == pool * 4  # sealed exactly when the pool was full
        prefill(c, seq, ref, 5)
        k_all, _ = seq.read_kv()
        torch.testing.assert_close(k_all, ref.k, rtol=0, atol=0)
        seq.close()
        c.coordinator.wait_idle()
        assert sum(c.held().values()) == 0
        c.check()


def test_a_client_of_one_node_and_an_attention_spec_never_spill(redis_url):
    spec = spec_of(4)
    engine = CacheEngine(EngineConfig(spec, 2, 0, device="cpu"))
    server, port = create_node_server(engine, "127.0.0.1:0")
    server.start()
    try:
        with CacheClient(f"127.0.0.1:{port}") as client, client.open("x", [1]) as seq:
            k = torch.randn(spec.num_layers, 12, spec.num_kv_heads, spec.head_dim)
            with pytest.raises(CapacityExceeded):
                seq.append(list(range(12)), k, k)
            with pytest.raises(InvalidArgument, match="cannot spill"):
                seq.extend()
            engine.check_integrity()
    finally:
        server.stop(0)


def test_losing_one_extents_node_loses_the_sequence_and_frees_the_others(redis_url):
    spec = spec_of(4)
    for c in start_cluster(redis_url, spec, {"n1": 64, "n2": 64, "n3": 64}):
        ref = Reference(spec, seed=6)
        seq = c.client.open("victim", [1], max_extent_tokens=8)
        k, v = ref.kv(20)
        seq.append(list(range(20)), k, v)
        assert len(seq.extents) == 3
        lost = seq.extents[1].route.node_id
        engine = c.engines[lost]
        # the node restarts empty: its registration comes back under a new epoch
        engine.reset()
        c.coordinator.register(lost, seq.extents[1].route.address, spec.to_dict(), 64)
        with pytest.raises(SequenceLost, match=f"node {lost}") as info:
            seq.close()
        assert info.value.node_id == lost
        c.coordinator.wait_idle()
        assert c.held() == {"n1": 0, "n2": 0, "n3": 0}  # nothing left on the other two
        c.check()


def test_spills_are_counted_and_exported(redis_url):
    from prometheus_client import CollectorRegistry, generate_latest

    from pagedkv.client.metrics import ClientCollector
    from pagedkv.coordinator.metrics import CoordinatorCollector

    spec = spec_of(4)
    for c in start_cluster(redis_url, spec, {"n1": 64, "n2": 64, "n3": 64}):
        with c.client.open("m", [1], max_extent_tokens=4) as seq:
            k = torch.randn(spec.num_layers, 6, spec.num_kv_heads, spec.head_dim)
            seq.append(list(range(6)), k, k)
            assert len(seq.extents) == 2
            seq.attend(0, torch.randn(Q_HEADS, spec.head_dim))
            seq.append(list(range(6)), k, k)  # a third extent (12 tokens: 4 + 4 + 4)
            assert len(seq.extents) == 3
            seq.attend_prefill(1, torch.randn(2, Q_HEADS, spec.head_dim))
        with c.client.open("one", [1]) as seq:  # one extent: neither spills nor sharded steps
            seq.append(list(range(6)), k, k)
            seq.attend(0, torch.randn(Q_HEADS, spec.head_dim))
        assert c.client.cluster_stats().counters["spills"] == 2
        assert c.client.counters == {
            "spills": 2,
            "sharded_steps": 2,
            "sharded_attends": 5,
            "window_skipped_attends": 0,  # no window: every extent attended
            "budget_dropped_blocks": 0,  # no budget
        }
        registry = CollectorRegistry()
        registry.register(CoordinatorCollector(c.coordinator))
        registry.register(ClientCollector(c.client))
        text = generate_latest(registry).decode()
        assert "pagedkv_coordinator_spills_total 2.0" in text
        # extents per sequence: "m" reached 2, then 3; "one" never extended
        assert 'pagedkv_coordinator_extends_total{extents="2"} 1.0' in text
        assert 'pagedkv_coordinator_extends_total{extents="3"} 1.0' in text
        assert "pagedkv_client_spills_total 2.0" in text
        assert "pagedkv_client_sharded_steps_total 2.0" in text
        assert "pagedkv_client_sharded_attends_total 5.0" in text
        assert "pagedkv_client_budget_dropped_blocks_total 0.0" in text


def test_a_quota_charges_every_extent_and_close_gives_it_back(redis_url):
    spec = spec_of(4)
    for c in start_cluster(redis_url, spec, {"n1": 64, "n2": 64, "n3": 64}, quotas={"default": 80}):
        ref = Reference(spec, seed=7)
        seq = c.client.open("q", [1], max_extent_tokens=16)
        k, v = ref.kv(30)
        seq.append(list(range(30)), k, v)
        for step in range(12):
            decode(c, seq, ref, step)
        assert [e.first_token for e in seq.extents] == [0, 16, 32]
        used = c.coordinator.store.tenant_usage("default")
        assert 11 <= used <= 40  # at least the 11 blocks held; reserved ahead in steps
        assert c.coordinator.store.get_sequence("q").num_blocks == used
        child = seq.fork("q-child")  # reserves the parent's blocks again, extent by extent
        assert c.coordinator.store.tenant_usage("default") == 2 * used
        child_ref = Reference(spec, seed=70)
        child_ref.k, child_ref.v = ref.k.clone(), ref.v.clone()
        for step in range(6):
            decode(c, child, child_ref, step)
        child.close()
        seq.close()
        c.coordinator.wait_idle()
        assert c.coordinator.store.tenant_usage("default") == 0
        assert c.held() == {"n1": 0, "n2": 0, "n3": 0}


def test_swap_out_and_in_moves_every_extent(redis_url):
    spec = spec_of(4)
    for c in start_cluster(redis_url, spec, {"n1": 64, "n2": 64}):
        ref = Reference(spec, seed=8)
        seq = c.client.open("sw", [1], max_extent_tokens=8)
        k, v = ref.kv(14)
        seq.append(list(range(14)), k, v)
        assert len(seq.extents) == 2
        assert seq.swap_out() == 4  # 2 + 2 blocks, both nodes
        assert all(e.stats()["used_blocks"] == 0 for e in c.engines.values())
        assert (
            seq.swap_in() == 1
        )  # full blocks stayed cached on the devices: the tail's partial one is copied
        c.check()
        decode(c, seq, ref, 99)
        torch.testing.assert_close(seq.read_kv()[0], ref.k, rtol=0, atol=0)
        seq.close()
        c.coordinator.wait_idle()
        assert c.held() == {"n1": 0, "n2": 0}


def test_a_swap_refused_by_one_node_leaves_every_extent_in_place(redis_url):
    spec = spec_of(4)
    for c in start_cluster(redis_url, spec, {"n1": 64, "n2": 64}):
        ref = Reference(spec, seed=9)
        seq = c.client.open("big", [1], max_extent_tokens=8)
        k, v = ref.kv(12)
        seq.append(list(range(12)), k, v)
        seq.max_extent_tokens = None
        k, v = ref.kv(4 * 20)  # the tail holds 21 blocks: more than its node's host tier (16)
        seq.append(list(range(4 * 20)), k, v)
        with pytest.raises(CapacityExceeded, match="swap out"):
            seq.swap_out()
        c.check()
        decode(c, seq, ref, 5)  # both extents still on their devices
        seq.close()


def test_the_asyncio_client_spills_and_merges_alike(redis_url):
    spec = spec_of(4)
    for c in start_cluster(redis_url, spec, {"n1": 64, "n2": 64}):
        asyncio.run(spill_async(c, Reference(spec, seed=11)))
        c.coordinator.wait_idle()
        assert c.held() == {"n1": 0, "n2": 0}


async def spill_async(c: Cluster, ref: Reference) -> None:
    k, v = ref.kv(10)
    client = AsyncCacheClient(coordinator=c.client.address, spec=c.spec)
    async with client, client.open("a", [1], max_extent_tokens=8) as seq:
        assert await seq.append(list(range(10)), k, v) == 10
        assert [e.first_token for e in seq.extents] == [0, 8]
        q = ref.rand(Q_HEADS, c.spec.head_dim)
        res = await seq.attend(1, q)
        assert_close(res, tuple(t[0] for t in ref.attention(1, q[None], 9)))


def test_an_append_the_node_cannot_take_fills_its_last_block_then_spills(redis_url):
    spec = spec_of(4)
    for c in start_cluster(redis_url, spec, {"small": 3, "big": 64}):
        c.coordinator.heartbeat("big", {"free_blocks": 0, "used_blocks": 64})  # the open goes to small
        ref = Reference(spec, seed=12)
        seq = c.client.open("fill", [1])
        assert seq.route.node_id == "small"
        c.coordinator.heartbeat("big", {"free_blocks": 64, "used_blocks": 0})
        k, v = ref.kv(6)
        seq.append(list(range(6)), k, v)
        k, v = ref.kv(10)  # 16 tokens: 4 blocks, one more than small's pool
        assert seq.append(list(range(10)), k, v) == 16
        # the partial block was filled (6 -> 8) and the rest went to a new extent at the boundary
        assert [(e.route.node_id, e.first_token) for e in seq.extents] == [("small", 0), ("big", 8)]
        c.check()
        torch.testing.assert_close(seq.read_kv()[0], ref.k, rtol=0, atol=0)
        decode(c, seq, ref, 3)
        seq.close()


def test_concurrent_extends_of_one_sequence_make_one_extent(redis_url):
    spec = spec_of(4)
    for c in start_cluster(redis_url, spec, {"n1": 64, "n2": 64, "n3": 64}):
        seq = c.client.open("twice", [1])
        k = torch.randn(spec.num_layers, 8, spec.num_kv_heads, spec.head_dim)
        seq.append(list(range(8)), k, k)
        with ThreadPoolExecutor(4) as pool:
            calls = [pool.submit(c.coordinator.extend, "default", "twice", 8) for _ in range(4)]
            records = [f.result() for f in calls]
        assert len({r.extents for r in records}) == 1 and len(records[0].extents) == 2
        assert sum(c.held().values()) == 2  # one new extent on one node, not one per call
        with pytest.raises(InvalidArgument, match="multiple of block_size 4"):
            c.coordinator.extend("default", "twice", 10)
        with pytest.raises(InvalidArgument, match="past the tail's first token"):
            c.coordinator.extend("default", "twice", 4)
        seq.close()
        c.coordinator.wait_idle()
        assert sum(c.held().values()) == 0


def test_block_mass_over_extents_covers_every_block_and_sums_to_the_heads(redis_url):
    spec = spec_of(4)
    for c in start_cluster(redis_url, spec, {"n1": 64, "n2": 64}):
        seq = c.client.open("mass", [1], max_extent_tokens=8)
        k = torch.randn(spec.num_layers, 14, spec.num_kv_heads, spec.head_dim)
        seq.append(list(range(14)), k, k)
        assert len(seq.extents) == 2
        q = torch.randn(Q_HEADS, spec.head_dim)
        res = seq.attend(0, q, return_block_mass=True)
        assert res.block_mass is not None and res.block_mass.shape == (4,)  # 2 + 2 blocks, in order
        # exact: each node's blocks under the merged softmax (BlockMass), as dense float64 says
        keys = k[0].double().repeat_interleave(Q_HEADS // spec.num_kv_heads, 1)  # [14, Hq, D]
        probs = torch.softmax(torch.einsum("hd,thd->ht", q.double(), keys) / spec.head_dim**0.5, -1)
        want = torch.nn.functional.pad(probs.sum(0), (0, 2)).view(4, 4).sum(-1)
        torch.testing.assert_close(res.block_mass.double(), want, atol=1e-5, rtol=1e-5)
        with c.client.open("solo", [1]) as solo:  # in a batch beside a one-node sequence: the same
            solo.append(list(range(3)), k[:, :3], k[:, :3])
            batch = c.client.attend_batch([seq, solo], 0, torch.stack([q, q]), return_block_mass=True)
            assert batch.block_mass is not None and batch.block_mass.shape == (2, 4)
            torch.testing.assert_close(batch.block_mass[0].double(), want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(batch.block_mass[1, 1:].sum(), torch.tensor(0.0))  # one block there
        seq.close()


def test_a_first_append_larger_than_its_node_spills(redis_url):
    """An empty sequence's first append longer than its node's whole pool: the node refuses
    it (RESOURCE_EXHAUSTED, from the header: nothing is read), the client appends what the
    refusal says fits, and the rest spills as it would after any full tail."""
    spec = spec_of(4)
    for c in start_cluster(redis_url, spec, {"n1": 4, "n2": 4, "n3": 4}):
        with c.client.open("big", []) as seq:
            k = torch.randn(spec.num_layers, 40, spec.num_kv_heads, spec.head_dim)
            assert seq.append(list(range(40)), k, -k) == 40
            assert [e.first_token for e in seq.extents] == [0, 16, 32]
            got_k, got_v = seq.read_kv()
            assert torch.equal(got_k, k) and torch.equal(got_v, -k)
            c.check()
        c.coordinator.wait_idle()
        assert sum(c.held().values()) == 0

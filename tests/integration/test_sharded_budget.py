"""A token budget over a sequence sharded across nodes (issue 20) keeps the blocks one node
would keep.

The same workload (a prompt, a budget, decode steps and prefills with random q/K/V) runs
twice: on one node with a pool big enough for everything (the node keeps the budget:
the ground truth), and on a cluster of three small nodes where the sequence spills twice
and the client keeps the budget (client/budget.py). Every step's attention output and LSE,
and the K/V read back at the end, must agree: a different kept block would change them.
Real parts: node engines served over gRPC, a coordinator on a real Redis, the client over
the wire; every node's integrity checked as it goes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest
import torch
from test_sharded import Q_HEADS, spec_of, start_cluster

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.server import create_server as create_node_server
from pagedkv.client import CacheClient, Sequence
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import pagedkv_pb2_grpc as pb_grpc
from pagedkv.protos import tensors
from pagedkv.protos.attention import LayerAttention
from pagedkv.protos.errors import InvalidArgument
from pagedkv.protos.spec import ModelSpec

PROMPT = 22


def one_node(spec: ModelSpec, blocks: int = 512) -> Iterator[tuple[CacheClient, CacheEngine]]:
    engine = CacheEngine(EngineConfig(spec, blocks, 16, device="cpu"))
    server, port = create_node_server(engine, "127.0.0.1:0")
    server.start()
    client = CacheClient(f"127.0.0.1:{port}", spec=spec)
    try:
        yield client, engine
    finally:
        client.close()
        server.stop(0)


class Workload:
    """Random q/K/V, the same for both runs (one generator per run, one seed)."""

    def __init__(self, spec: ModelSpec, seed: int) -> None:
        self.spec, self.gen = spec, torch.Generator().manual_seed(seed)

    def kv(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        shape = (s.num_layers, n, s.num_kv_heads, s.head_dim)
        return torch.randn(shape, generator=self.gen), torch.randn(shape, generator=self.gen)

    def q(self, n: int) -> torch.Tensor:
        return torch.randn((n, Q_HEADS, self.spec.head_dim), generator=self.gen) * 2.0


def run(
    seq: Sequence, spec: ModelSpec, budget: tuple[int, int, int], steps: int, check: Callable[[], None]
) -> list[torch.Tensor]:
    """The prompt, the budget, `steps` decode steps with a 3-token prefill every 10th, then
    the budget cut to 2/3 (dropping at once, wherever the least attended blocks are) and 10
    steps more: every output and LSE, in order."""
    w = Workload(spec, seed=7)
    k, v = w.kv(PROMPT)
    seq.append(list(range(PROMPT)), k, v)
    seq.set_budget(*budget)
    got = []
    for step in range(steps + 10):
        if step == steps:
            seq.set_budget(budget[0] * 2 // 3, *budget[1:])
        if step % 10 == 9:
            k, v = w.kv(3)
            for layer in range(spec.num_layers):
                ids = list(range(3)) if layer == 0 else None
                res = seq.attend_prefill(layer, w.q(3), k[layer], v[layer], ids)
                got += [res.out, res.lse]
        else:
            k, v = w.kv(1)
            for layer in range(spec.num_layers):
                res = seq.attend(layer, w.q(1)[0], k[layer, 0], v[layer, 0], step if layer == 0 else None)
                got += [res.out, res.lse]
        check()
    return got


@pytest.mark.parametrize("bs", [1, 4])
def test_a_budget_over_three_nodes_keeps_what_one_node_keeps(redis_url, bs):
    spec = spec_of(bs)
    budget = (56, 1, 2)  # 56 tokens: passed on the third node, then drops on every node
    steps = 40  # 70 tokens in all: each node full at 24, so the third holds the last 22
    for client, engine in one_node(spec):
        with client.open("one", []) as seq:
            want = run(seq, spec, budget, steps, engine.check_integrity)
            want_k, want_v = seq.read_kv()
            assert engine.stats()["budget_dropped_blocks"] > 0
            assert want_k.shape[1] <= budget[0]
    for c in start_cluster(redis_url, spec, {n: 24 // bs for n in ("n1", "n2", "n3")}):
        with c.client.open("spread", []) as seq:
            got = run(seq, spec, budget, steps, c.check)
            assert len(seq.extents) == 3
            assert seq.budget is not None
            assert seq.budget.dropped[0] + seq.budget.dropped[1] > 0  # sealed extents lost blocks too
            assert c.client.counters["budget_dropped_blocks"] * bs == sum(seq.budget.dropped)
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"output {i}: {m}")
            k, v = seq.read_kv()
            torch.testing.assert_close(k, want_k)
            torch.testing.assert_close(v, want_v)
            # a range across the seals, in held positions as one node counts them
            held0 = seq._held_tokens(0)
            assert held0 is not None and held0 > 0
            lo, hi = max(held0 - 3, 0), held0 + 5
            part_k, _ = seq.read_kv(lo, hi)
            torch.testing.assert_close(part_k, want_k[:, lo:hi])
        c.coordinator.wait_idle()
        assert sum(c.held().values()) == 0


def test_a_fork_keeps_its_own_budget_and_lifting_it_keeps_every_block(redis_url):
    spec = spec_of(4)
    for c in start_cluster(redis_url, spec, {n: 6 for n in ("n1", "n2", "n3")}):
        seq = c.client.open("parent", [])
        run(seq, spec, (56, 1, 2), 40, c.check)
        assert len(seq.extents) == 3 and seq.budget is not None
        child = seq.fork("child")
        assert child.budget is not None and child.budget is not seq.budget
        w = Workload(spec, seed=3)
        for _ in range(6):  # past its budget: the child drops, the parent does not
            k, v = w.kv(1)
            for layer in range(spec.num_layers):
                child.attend(layer, w.q(1)[0], k[layer, 0], v[layer, 0], 1 if layer == 0 else None)
        assert child.read_kv()[0].shape[1] <= 37  # the cut budget, copied
        assert sum(child.budget.dropped) > sum(seq.budget.dropped)
        c.check()
        child.close()
        seq.set_budget(None)
        held = seq.read_kv()[0].shape[1]
        k, v = w.kv(6)
        seq.append(list(range(6)), k, v)
        assert held + 6 > 37 and seq.read_kv()[0].shape[1] == held + 6  # nothing dropped any more
        seq.close()
        c.check()
        c.coordinator.wait_idle()
        assert sum(c.held().values()) == 0


def test_a_windowed_sequence_over_nodes_refuses_a_budget(redis_url):
    spec = spec_of(4)
    window = [LayerAttention(window=8)] * spec.num_layers
    for c in start_cluster(redis_url, spec, {"n1": 4, "n2": 64}):
        with c.client.open("w", [], attention=window, max_extent_tokens=8) as seq:
            k, v = Workload(spec, 1).kv(12)
            seq.append(list(range(12)), k, v)
            assert len(seq.extents) == 2
            with pytest.raises(InvalidArgument, match="sliding window or chunked attention"):
                seq.set_budget(32)
            assert seq.budget is None
            c.check()


def test_budget_calls_refuse_bad_input_and_change_nothing(redis_url):
    """A client (buggy or hostile) sending BlockMass / DropBlocks itself: each bad request
    is refused naming what was wrong; the sequence and the pool are as they were."""
    spec = spec_of(4)
    for client, engine in one_node(spec, blocks=32):
        with client.open("s", []) as seq:
            k, v = Workload(spec, 2).kv(14)
            seq.append(list(range(14)), k, v)
            stub = pb_grpc.CacheNodeStub(grpc.insecure_channel(client.routing.route.address))
            q2 = tensors.encode(torch.randn(2, Q_HEADS, spec.head_dim))

            def mass(layer: int = 0, lse: list[float] | None = None, visible: tuple = (14, 14), q2=q2):
                part = pb.MassQueries(
                    layer=layer, q=q2, lse=[0.0] * 8 if lse is None else lse, visible=visible
                )
                return pb.BlockMassRequest(seq_id="s", queries=[part])

            bad = {
                "lse count": mass(lse=[0.0] * 3),
                "nan lse": mass(lse=[float("nan")] * 8),
                "layer": mass(layer=7),
                "no q": pb.BlockMassRequest(seq_id="s", queries=[pb.MassQueries(layer=0, lse=[0.0] * 8)]),
                "visible count": mass(visible=(14,)),
                "visible past the end": mass(visible=(14, 15)),
                "visible zero": mass(visible=(0, 3)),
                "partial block": pb.DropBlocksRequest(seq_id="s", indices=[3]),
                "descending": pb.DropBlocksRequest(seq_id="s", indices=[1, 0]),
                "negative": pb.DropBlocksRequest(seq_id="s", indices=[-1]),
                "empty": pb.DropBlocksRequest(seq_id="s", indices=[]),
            }
            before = (engine.block_table("s"), engine.stats())
            for what, req in bad.items():
                rpc = stub.BlockMass if isinstance(req, pb.BlockMassRequest) else stub.DropBlocks
                with pytest.raises(grpc.RpcError) as err:
                    rpc(req)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, err.value.details())
            with pytest.raises(grpc.RpcError) as err:
                stub.DropBlocks(pb.DropBlocksRequest(seq_id="nope", indices=[0]))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert (engine.block_table("s"), engine.stats()) == before
            engine.check_integrity()
            # the good ones: mass under the node's own LSE sums to the queries' heads
            qt = torch.randn(2, Q_HEADS, spec.head_dim)
            lse = seq.attend_prefill(0, qt).lse
            part = pb.MassQueries(
                layer=0, q=tensors.encode(qt), lse=lse.reshape(-1).tolist(), visible=[13, 14]
            )
            got = stub.BlockMass(pb.BlockMassRequest(seq_id="s", queries=[part, part])).mass
            assert len(got) == 4 and abs(sum(got) - 2 * 2 * Q_HEADS) < 1e-4  # two parts summed
            kept = stub.DropBlocks(pb.DropBlocksRequest(seq_id="s", indices=[0, 2])).num_cached_tokens
            assert kept == 6 and seq.read_kv()[0].shape[1] == 6
            engine.check_integrity()
        assert engine.stats()["used_blocks"] == 0

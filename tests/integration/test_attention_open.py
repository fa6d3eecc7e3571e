"""An attention spec travels with the open, once (OpenRequest.attention), to a real node server:
the node follows it on every attend over every transport (the same outputs as an in-process
engine given the same calls, itself checked against float64 in tests/unit/test_windows.py),
forks inherit it, windows release blocks as decoding moves on, and a spec the node cannot honour
is refused at open. The bulk channel's OPEN carries no spec: such an open takes the Open rpc."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_bulk_attend import Node

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.client import AsyncCacheClient, CacheClient, ClientConfig, LayerAttention
from pagedkv.protos.errors import InvalidArgument
from pagedkv.protos.spec import ModelSpec

SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
HQ = 4
WINDOWED = [LayerAttention(window=6), LayerAttention(window=5, softcap=4.0, scale=0.4)]
GRPC = ClientConfig(bulk_min_bytes=None)


@pytest.fixture
def node():
    n = Node(SPEC, num_blocks=64)
    yield n
    n.server.stop(0)
    n.engine.close()


def rpc_count(node: Node, method: str) -> float:
    get = node.metrics.registry.get_sample_value
    return get("pagedkv_rpc_latency_seconds_count", {"method": method}) or 0.0


@pytest.mark.parametrize("config", [ClientConfig(), GRPC], ids=["bulk", "grpc"])
def test_the_node_follows_the_spec_of_the_open_on_every_attend(node: Node, config: ClientConfig):
    twin = CacheEngine(EngineConfig(SPEC, 64, device="cpu"))
    g = torch.Generator().manual_seed(0)
    prompt = list(range(300, 309))
    with CacheClient(node.address, config) as client:
        before = rpc_count(node, "Open")
        seq = client.open("w", prompt, attention=WINDOWED)
        assert rpc_count(node, "Open") == before + 1  # the rpc, whatever the config
        twin.open("w", prompt, attention=WINDOWED)
        k = torch.randn(2, 9, 2, 8, generator=g)
        seq.append(prompt, k, k)
        twin.append("w", prompt, k, k)
        held = []
        for step in range(24):
            for layer in range(2):
                q, kn, vn = (torch.randn(1, h, 8, generator=g) for h in (HQ, 2, 2))
                tokens = [step] if layer == 0 else None
                got = client.attend_batch([seq], layer, q, kn, vn, tokens)
                want = twin.attend_decode(["w"], layer, q, kn, vn, tokens)
                assert torch.allclose(got.out, want.out, atol=1e-6)
                assert torch.allclose(got.lse, want.lse, atol=1e-6)
            held.append(len(node.engine.block_table("w")))
        assert max(held[8:]) <= 3 and node.engine.sequence_length("w") == 33
        released = node.engine.stats()["window_released_blocks"]
        assert released == (33 - node.engine.cache_length("w")) // 4 > 0
        assert node.metrics.registry.get_sample_value("pagedkv_window_released_blocks_total") == released
        assert len(node.engine.block_table("w")) == len(twin.block_table("w"))
        child = seq.fork("w-child")
        assert node.engine.specs.get("w-child") == node.engine.specs.get("w")
        child.close()
        seq.close()
    node.engine.check_integrity()
    assert node.engine.stats()["num_sequences"] == 0


@pytest.mark.parametrize("config", [ClientConfig(), GRPC], ids=["bulk", "grpc"])
def test_a_spec_that_does_not_fit_the_node_is_refused_at_open(node: Node, config: ClientConfig):
    with CacheClient(node.address, config) as client:
        with pytest.raises(InvalidArgument, match="attention lists 3 layers; the model has 2"):
            client.open("bad", [1, 2, 3], attention=[LayerAttention(window=4)] * 3)
        with pytest.raises(InvalidArgument, match="attention layer 0: a LayerAttention, got int"):
            client.open("bad", [1, 2, 3], attention=[4, 4])  # type: ignore[list-item]
    assert node.engine.stats()["num_sequences"] == 0
    node.engine.check_integrity()


def test_the_asyncio_client_sends_the_spec_too(node: Node):
    async def run() -> None:
        async with AsyncCacheClient(node.address) as client:
            seq = await client.open("a", [5, 6, 7], attention=WINDOWED)
            assert node.engine.specs.get("a") is not None
            await seq.close()

    asyncio.run(run())
    assert node.engine.stats()["num_sequences"] == 0

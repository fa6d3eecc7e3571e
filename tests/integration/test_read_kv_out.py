"""read_kv(out=(k, v)): the K/V of a range received into the caller's tensors, on a real
node server, over every path the client has: the ReadKV rpc (sync and asyncio), the bulk
channel's TCP socket, its same-host Unix socket and its shared-memory ring (READ_SHM).
Byte-exact, the caller's tensors returned (no allocation), slabs and blocks crossed; an
`out` that does not fit is refused naming what is wrong, with the node's state, the other
sequences and the next read (on the same client) untouched."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_bulk_attend import bitwise
from test_read_shm import BULK, Node, small_slots, spec_of
from test_read_shm import make as read_shm_make  # noqa: F401  (a fixture)
from test_shm import channel_of

from pagedkv.client import AsyncCacheClient, CacheClient, ClientConfig, InvalidArgument
from pagedkv.client import shm as client_shm

GRPC = ClientConfig(bulk_min_bytes=None)  # every read_kv over the ReadKV rpc, in small chunks
GRPC_SMALL_CHUNKS = ClientConfig(bulk_min_bytes=None, chunk_bytes=256)

# path -> (client config, same-host path allowed, READ_SHM allowed)
PATHS: dict[str, ClientConfig] = {
    "grpc": GRPC_SMALL_CHUNKS,
    "tcp": dataclasses.replace(BULK, transports=("tcp", "grpc")),
    "unix": dataclasses.replace(BULK, transports=("unix", "tcp", "grpc")),
    "shm": BULK,
}


@pytest.fixture
def make(read_shm_make: Callable[..., Node]) -> Callable[..., Node]:  # noqa: F811  (the fixture)
    """Nodes as test_read_shm makes them (stopped after the test)."""
    return read_shm_make


def client_on(node: Node, path: str) -> CacheClient:
    return CacheClient(node.address, PATHS[path])


def check_path_taken(client: CacheClient, path: str, num_reads: int) -> None:
    ch = client.data.bulk
    if path == "grpc":
        assert ch is None or ch.num_calls == 0
        return
    assert ch is not None
    assert ch.num_shm_reads == (num_reads if path == "shm" else 0)
    assert ch.num_local_transfers == (num_reads if path in ("unix", "shm") else 0)


def empty_like_range(spec: Any, n: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    shape = (spec.num_layers, n, spec.num_kv_heads, spec.head_dim)
    dtype = dtype or getattr(torch, spec.dtype)
    return torch.full(shape, 7.0, dtype=dtype), torch.full(shape, 7.0, dtype=dtype)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reads_land_in_the_callers_tensors(
    make: Callable[..., Node], path: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = make(spec_of(dtype))
    if path == "shm":
        small_slots(monkeypatch, node.spec, 3)  # many slabs through the ring
    k, v = node.fill("s", 39, seed=1)
    node.fill("other", 7, seed=2)
    state = node.state()
    with client_on(node, path) as client:
        seq = client.sequence("s")
        ranges = [(0, None), (3, 37), (38, 39), (0, 1), (5, 5)]
        for a, b in ranges:
            n = (39 if b is None else b) - a
            out = empty_like_range(node.spec, n)
            rk, rv = seq.read_kv(a, b, out=out)
            assert rk is out[0] and rv is out[1]  # received in place, nothing allocated
            assert bitwise(rk, k[:, a:b]) and bitwise(rv, v[:, a:b]), (a, b)
        stacked = torch.zeros(2, *k.shape, dtype=k.dtype)  # one buffer, k and v its halves
        rk, rv = seq.read_kv(out=(stacked[0], stacked[1]))
        assert bitwise(stacked[0], k) and bitwise(stacked[1], v)
        check_path_taken(client, path, len(ranges) + 1)
    assert node.state() == state


def bad_outs(spec: Any) -> dict[str, tuple[Any, str]]:
    """name -> (out, a fragment of the message) for a 10-token read."""
    k, v = empty_like_range(spec, 10)
    wide = torch.zeros(spec.num_layers, 10, spec.num_kv_heads, spec.head_dim * 2)
    flat = torch.zeros(k.numel() + 8)
    return {
        "too few tokens": (empty_like_range(spec, 9), "range read is"),
        "too many tokens": (empty_like_range(spec, 11), "range read is"),
        "another dtype": (empty_like_range(spec, 10, torch.float16), "range read is"),
        "not contiguous": ((wide[..., ::2], v), "contiguous"),
        "k and v different": ((k, empty_like_range(spec, 9)[1]), "one [num_layers"),
        "3-d": ((k[0], v[0]), "one [num_layers"),
        "one tensor": (k, "(k, v) pair"),
        "three tensors": ((k, v, k), "(k, v) pair"),
        "not tensors": ((k.numpy(), v.numpy()), "torch.Tensor"),
        "k is v": ((k, k), "overlap"),
        "k and v overlap": ((flat[: k.numel()].view(k.shape), flat[8:].view(k.shape)), "overlap"),
        "unsupported dtype": (
            (torch.zeros(k.shape, dtype=torch.complex64), torch.zeros(k.shape, dtype=torch.complex64)),
            "unsupported dtype",
        ),
    }


@pytest.mark.parametrize("path", list(PATHS))
def test_an_out_that_does_not_fit_is_refused_and_nothing_is_lost(
    make: Callable[..., Node], path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = make()
    if path == "shm":
        small_slots(monkeypatch, node.spec, 3)
    k, v = node.fill("s", 10, seed=3)
    ok, ov = node.fill("other", 6, seed=4)
    state = node.state()
    with client_on(node, path) as client:
        seq = client.sequence("s")
        for name, (out, fragment) in bad_outs(node.spec).items():
            before = [t.clone() for t in out if isinstance(t, torch.Tensor)] if isinstance(out, tuple) else []
            with pytest.raises(InvalidArgument, match=re.escape(fragment)):
                seq.read_kv(0, 10, out=out)
            if name in ("too few tokens", "too many tokens", "another dtype"):  # refused before a byte
                assert all(bitwise(t, b) for t, b in zip(out, before, strict=True)), name
            assert node.state() == state, name
            rk, rv = seq.read_kv()  # the client and the node still serve, the data intact
            assert bitwise(rk, k) and bitwise(rv, v), name
            rk, rv = client.sequence("other").read_kv()
            assert bitwise(rk, ok) and bitwise(rv, ov), name
    assert node.state() == state


@pytest.mark.skipif(not client_shm.is_supported(), reason="needs memfd and Unix sockets (Linux)")
def test_a_refused_out_on_the_same_host_leaves_the_connection_pool_usable(make: Callable[..., Node]) -> None:
    """A refusal after the reply started (the shape is known only then) closes that
    connection; the next read takes a fresh one and the region is mapped again."""
    node = make()
    k, v = node.fill("s", 10, seed=5)
    with client_on(node, "shm") as client:
        seq = client.sequence("s")
        seq.read_kv()
        with pytest.raises(InvalidArgument, match="range read is"):
            seq.read_kv(out=empty_like_range(node.spec, 4))  # end=None: the length comes with the reply
        for _ in range(3):
            rk, rv = seq.read_kv(out=empty_like_range(node.spec, 10))
            assert bitwise(rk, k) and bitwise(rv, v)
        assert channel_of(client).num_shm_reads == 4


@pytest.mark.parametrize("path", ["grpc", "bulk"])
def test_async_reads_land_in_the_callers_tensors(make: Callable[..., Node], path: str) -> None:
    node = make()
    k, v = node.fill("s", 21, seed=6)
    state = node.state()
    cfg = GRPC_SMALL_CHUNKS if path == "grpc" else BULK

    async def run() -> None:
        async with AsyncCacheClient(node.address, cfg) as client:
            seq = await client.sequence("s")
            out = empty_like_range(node.spec, 17)
            rk, rv = await seq.read_kv(2, 19, out=out)
            assert rk is out[0] and rv is out[1]
            assert bitwise(rk, k[:, 2:19]) and bitwise(rv, v[:, 2:19])
            with pytest.raises(InvalidArgument, match="range read is"):
                await seq.read_kv(2, 19, out=empty_like_range(node.spec, 16))
            with pytest.raises(InvalidArgument, match="contiguous"):
                await seq.read_kv(out=(out[0].transpose(1, 2), out[1]))
            rk, rv = await seq.read_kv()
            assert bitwise(rk, k) and bitwise(rv, v)
            ch = client.data.bulk
            assert (ch is not None and ch.num_calls + ch.num_local_transfers > 0) == (path == "bulk")

    asyncio.run(run())
    assert node.state() == state

"""CacheClient.connect() / AsyncCacheClient.connect(): every connection a node's first
data calls would open -- its gRPC channel, its bulk channel's TCP connection and, on the
node's host, the same-host connection with its shared region mapped -- opened ahead, on a
real node server. The first calls after it open nothing; a node without a bulk channel or
a gRPC-only client gets just the gRPC Ping; a node that is down raises Unavailable."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import test_bulk_attend
from test_bulk_attend import GRPC, Q_HEADS, Node, bitwise
from test_shm import channel_of, node_mappings

from pagedkv.client import AsyncCacheClient, CacheClient, ClientConfig, Unavailable
from pagedkv.client import shm as client_shm

pytestmark = pytest.mark.skipif(not client_shm.is_supported(), reason="needs memfd and Unix sockets (Linux)")

make, node = test_bulk_attend.make, test_bulk_attend.node  # the same node fixtures


def node_connections(node: Node) -> int:
    """Connections the node's bulk server holds open (TCP and Unix socket)."""
    assert node.server.bulk is not None
    return len(node.server.bulk._conns)


def test_connect_opens_every_path_before_the_first_call(node: Node) -> None:
    node.fill("s", 6, seed=1)
    q = node.rand(2, Q_HEADS, 8, seed=2)
    want = node.engine.attend_decode(["s"], 1, q[:1])
    state = node.state()
    mappings, conns = node_mappings(), node_connections(node)
    with CacheClient(node.address) as client:
        client.connect()
        ch = channel_of(client)
        assert node_connections(node) == conns + 2  # TCP (pinged) and the same-host socket
        assert node_mappings() == mappings + 2  # the region, mapped by the client and by the node
        assert ch.num_calls == 0 and ch.num_local_calls == 0  # a PING and a MAP are not calls
        got = client.data.attend(["s"], 1, q[:1])
        rk, rv = client.sequence("s").read_kv()
        assert bitwise(got.out, want.out) and bitwise(got.lse, want.lse)
        assert rk.shape[1] == 6 and rv.shape[1] == 6
        assert ch.num_local_calls == 1 and ch.num_shm_reads == 1  # both on what connect() opened
        assert node_connections(node) == conns + 2 and node_mappings() == mappings + 2
        client.connect()  # again: the pooled connections are reused, nothing more opened
        assert node_connections(node) == conns + 2 and node_mappings() == mappings + 2
    assert node.state() == state


def test_connect_over_tcp_only_opens_the_tcp_connection(node: Node) -> None:
    conns, mappings = node_connections(node), node_mappings()
    with CacheClient(node.address, ClientConfig(transports=("tcp", "grpc"))) as client:  # another host's
        ch = client.data.bulk_channel()
        assert ch is not None
        client.connect()
        assert node_connections(node) == conns + 1 and node_mappings() == mappings


def test_connect_without_a_bulk_channel_pings_grpc(make: Callable[..., Node]) -> None:
    no_bulk = make(bulk_port=None)
    no_bulk.fill("s", 4, seed=3)
    with CacheClient(no_bulk.address) as client:
        client.connect()
        assert client.data.bulk_channel() is None
        assert client.data.attend(["s"], 1, no_bulk.rand(1, Q_HEADS, 8, seed=4)).out.shape == (1, Q_HEADS, 8)
    with_bulk = make()
    conns = node_connections(with_bulk)
    with CacheClient(with_bulk.address, GRPC) as client:  # every call on gRPC by the client's choice
        client.connect()
        assert node_connections(with_bulk) == conns


def test_connect_to_a_node_that_is_down_raises_unavailable(make: Callable[..., Node]) -> None:
    node = make()
    address = node.address
    node.server.stop(0)
    with CacheClient(address) as client, pytest.raises(Unavailable, match=address.rsplit(":", 1)[1]):
        client.connect(timeout_s=2.0)


def test_async_connect_opens_every_path(node: Node) -> None:
    node.fill("s", 6, seed=5)
    q = node.rand(1, Q_HEADS, 8, seed=6)
    want = node.engine.attend_decode(["s"], 1, q)
    conns, mappings = node_connections(node), node_mappings()

    async def run() -> None:
        async with AsyncCacheClient(node.address) as client:
            await client.connect()
            assert node_connections(node) == conns + 2 and node_mappings() == mappings + 2
            got = await client.data.attend(["s"], 1, q)
            assert bitwise(got.out, want.out)
            assert channel_of(client).num_local_calls == 1
            assert node_connections(node) == conns + 2

    asyncio.run(run())
    node.state()

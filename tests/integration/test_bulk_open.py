"""Open over the bulk channel (docs/bulk-protocol.md, op OPEN): a client talking to one node
directly opens its sequences there instead of with the Open rpc, which stays the
fallback. Real node servers on port 0 with their bulk listener; every comparison runs
the same open through two clients: `bulk` (the default config: the channel) and `grpc`
(bulk_min_bytes=None: the rpc). Results must be equal, bad input must fail with the
same error class and message and change nothing, and the connection and the node must
stay usable. Every test runs over the same-host path and TCP, on a node whose engine
runs on its handler threads and on one whose engine has its own compute thread."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from test_bulk_attend import Node as AttendNode

from pagedkv.client import AsyncCacheClient, CacheClient, ClientConfig, shm
from pagedkv.client.transport.link import BulkLink
from pagedkv.client.types import OpenResult
from pagedkv.protos import wire
from pagedkv.protos.errors import InvalidArgument
from pagedkv.protos.spec import ModelSpec
from pagedkv.protos.wire import Frame

INVALID = wire.Status.INVALID_ARGUMENT

GRPC = ClientConfig(bulk_min_bytes=None)
SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
PROMPT = list(range(100, 113))  # 13 tokens: 3 whole blocks and one more token


class Node(AttendNode):
    """test_bulk_attend's node (its counters and state), with a cache of prompts."""

    def __init__(self, num_blocks: int, compute_thread: bool) -> None:
        super().__init__(SPEC, compute_thread=compute_thread, num_blocks=num_blocks)

    def cache(self, tokens: list[int], salt: bytes = b"", seq_id: str = "filler") -> None:
        """Leave the KV of `tokens` cached (a sequence filled, then freed)."""
        self.engine.open(seq_id, tokens, salt)
        kv = torch.randn(SPEC.num_layers, len(tokens), SPEC.num_kv_heads, SPEC.head_dim)
        self.engine.append(seq_id, tokens, kv, kv)
        self.engine.free(seq_id)

    def rpc_count(self, method: str) -> float:
        get = self.metrics.registry.get_sample_value
        return get("pagedkv_rpc_latency_seconds_count", {"method": method}) or 0.0

    def assert_nothing_leaked(self) -> None:
        self.engine.check_integrity()
        stats = self.engine.stats()
        assert stats["used_blocks"] == 0 and stats["num_sequences"] == 0, stats


@pytest.fixture(autouse=True, params=["shm", "tcp"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs over both paths of the channel: the same-host one (the Unix
    socket, where it can be used) and TCP (what a client on another host gets)."""
    if request.param == "tcp":
        monkeypatch.setattr(shm, "is_supported", lambda: False)
    return str(request.param)


@pytest.fixture(params=[False, True], ids=["handler-threads", "compute-thread"])
def make(request: pytest.FixtureRequest) -> Iterator[Callable[..., Node]]:
    nodes: list[Node] = []

    def make_node(num_blocks: int = 96) -> Node:
        nodes.append(Node(num_blocks, compute_thread=request.param))
        return nodes[-1]

    yield make_node
    for n in nodes:
        n.server.stop(0)
        n.engine.close()


@pytest.fixture
def node(make: Callable[..., Node]) -> Node:
    return make()


def channel_of(client: CacheClient) -> BulkLink:
    channel = client.data.bulk
    assert channel is not None
    return channel


def open_result(client: CacheClient, seq_id: str, tokens: list[int], **kw: Any) -> OpenResult:
    seq = client.open(seq_id, tokens, **kw)
    return OpenResult(seq.num_cached_tokens, seq.num_host_hit_tokens)


# -- results ----------------------------------------------------------------------------


def test_open_reuses_the_cached_prefix_like_the_rpc(node: Node, transport: str) -> None:
    node.cache(PROMPT[:12])
    with CacheClient(node.address) as via_bulk, CacheClient(node.address, GRPC) as via_grpc:
        requests = node.counters()[0]
        got = open_result(via_bulk, "b", PROMPT)
        assert node.counters()[0] == requests + 1  # over the channel
        assert node.rpc_count("Open") == 1  # recorded under the rpc's name
        want = open_result(via_grpc, "g", PROMPT)
        assert node.counters()[0] == requests + 1  # the rpc: the channel saw nothing
        assert node.rpc_count("Open") == 2
        assert got == want == OpenResult(12, 0)
        assert channel_of(via_bulk).num_local_transfers == 0  # an open is not a KV transfer
        assert via_grpc.data.bulk is None
        for seq_id in ("b", "g"):
            via_bulk.sequence(seq_id).close()
    node.assert_nothing_leaked()


def test_host_tier_hits_are_reported_like_the_rpc(make: Callable[..., Node]) -> None:
    """A prefix evicted to the host tier comes back on open: both paths report it."""
    results = []
    for config in (ClientConfig(), GRPC):
        node = make(num_blocks=8)
        node.cache(PROMPT[:12])
        node.cache(list(range(500, 532)), seq_id="evicts")  # 8 blocks: the prompt's 3 go to the host
        assert node.engine.stats()["host_cached_blocks"] == 3
        with CacheClient(node.address, config) as client:
            results.append(open_result(client, "s", PROMPT))
            client.sequence("s").close()
        node.assert_nothing_leaked()
    assert results[0] == results[1] == OpenResult(12, 12)


@pytest.mark.parametrize(("limit", "cached"), [(None, 12), (0, 0), (5, 4), (8, 8), (100, 12)])
def test_max_cached_tokens_is_honoured(node: Node, limit: int | None, cached: int) -> None:
    node.cache(PROMPT[:12])
    with CacheClient(node.address) as via_bulk, CacheClient(node.address, GRPC) as via_grpc:
        requests = node.counters()[0]
        got = open_result(via_bulk, "b", PROMPT, max_cached_tokens=limit)
        want = open_result(via_grpc, "g", PROMPT, max_cached_tokens=limit)
        assert got == want == OpenResult(cached, 0)
        assert node.counters()[0] == requests + 1
        for seq_id in ("b", "g"):
            via_bulk.sequence(seq_id).close()
    node.assert_nothing_leaked()


def test_tenant_salt_is_honoured(node: Node) -> None:
    node.cache(PROMPT[:12], salt=b"tenant-a")
    results: dict[str, list[OpenResult]] = {}
    for path, base in (("bulk", {}), ("grpc", {"bulk_min_bytes": None})):
        with (
            CacheClient(node.address, ClientConfig(tenant_salt=b"tenant-a", **base)) as same,
            CacheClient(node.address, ClientConfig(tenant_salt=b"tenant-b", **base)) as other,
            CacheClient(node.address, ClientConfig(**base)) as unsalted,
        ):
            results[path] = [
                open_result(same, f"{path}-a", PROMPT),
                open_result(other, f"{path}-b", PROMPT),
                open_result(unsalted, f"{path}-u", PROMPT),
            ]
            for seq_id in ("a", "b", "u"):
                same.sequence(f"{path}-{seq_id}").close()
    assert results["bulk"] == results["grpc"] == [OpenResult(12, 0), OpenResult(0, 0), OpenResult(0, 0)]
    assert node.counters()[:2] == (3, 0)
    node.assert_nothing_leaked()


# -- errors -----------------------------------------------------------------------------


def _error_of(fn: Callable[[], Any]) -> tuple[type, str]:
    with pytest.raises(Exception) as info:  # noqa: PT011 - compared with the rpc's exception
        fn()
    return type(info.value), str(info.value)


# name -> (open arguments, whether the node refuses it over the channel; the others are
# not expressible on the frame and take the rpc, reporting what they always did)
BAD_OPENS: dict[str, tuple[dict[str, Any], bool]] = {
    "existing id": ({"seq_id": "taken", "token_ids": PROMPT}, True),
    "negative token id": ({"seq_id": "x", "token_ids": [1, -1, 2]}, True),
    "token id over int64": ({"seq_id": "x", "token_ids": [1, 2**63]}, False),
    "bool token id": ({"seq_id": "x", "token_ids": [1, True]}, False),
    "float token id": ({"seq_id": "x", "token_ids": [1, 2.5]}, False),
    "empty sequence id": ({"seq_id": "", "token_ids": PROMPT}, True),
    "negative max_cached_tokens": ({"seq_id": "x", "token_ids": PROMPT, "max_cached_tokens": -1}, False),
}


def test_bad_opens_get_the_rpc_error_and_change_nothing(node: Node, transport: str) -> None:
    node.cache(PROMPT[:12])
    node.engine.open("taken", [7, 8, 9])
    with CacheClient(node.address) as via_bulk, CacheClient(node.address, GRPC) as via_grpc:
        for name, (args, is_refused_by_node) in BAD_OPENS.items():
            state = node.state()
            requests, errors, _ = node.counters()
            kw = {"max_cached_tokens": args.get("max_cached_tokens")}
            want = _error_of(lambda a=args, kw=kw: via_grpc.open(a["seq_id"], a["token_ids"], **kw))
            got = _error_of(lambda a=args, kw=kw: via_bulk.open(a["seq_id"], a["token_ids"], **kw))
            assert got == want, name
            assert issubclass(got[0], InvalidArgument), (name, got)
            assert node.state() == state, name  # lengths, blocks, integrity: unchanged
            assert node.counters()[:2] == (requests, errors + is_refused_by_node), name
            # the same pooled connection is still in sync: a good open answers right
            assert open_result(via_bulk, "ok", PROMPT) == OpenResult(12, 0), name
            via_bulk.sequence("ok").close()
        channel = channel_of(via_bulk)
        assert channel.capabilities(5.0).serves(wire.OP_OPEN)
        # one pooled connection did it all: the Unix socket on the same host (its TCP one asked HELLO)
        assert channel.num_idle("unix" if transport == "shm" else "tcp") == 1
        via_bulk.sequence("taken").close()
    assert node.counters()[2] == 0  # no connection was dropped
    node.assert_nothing_leaked()


def test_empty_prompt_opens_like_the_rpc(node: Node) -> None:
    with CacheClient(node.address) as via_bulk, CacheClient(node.address, GRPC) as via_grpc:
        assert open_result(via_bulk, "b", []) == open_result(via_grpc, "g", []) == OpenResult(0, 0)
        assert node.counters()[:2] == (1, 0)
        assert node.engine.sequence_length("b") == node.engine.sequence_length("g") == 0
        for seq_id in ("b", "g"):
            via_bulk.sequence(seq_id).close()
    node.assert_nothing_leaked()


# -- raw frames, smaller nodes --------------------------------------------------------------


def _raw(node: Node) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", node.bulk_port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _ping_ok(sock: socket.socket) -> bool:
    sock.sendall(Frame(wire.OP_PING, 77).pack())
    reply = wire.read_frame(sock)
    return reply is not None and reply.status == wire.STATUS_OK and reply.request_id == 77


def _open_frame(
    seq_id: str, tokens: list[int], salt: bytes = b"", *, payload_len: int | None = None
) -> bytes:
    """An OPEN request (docs/bulk-protocol.md); payload_len: declared instead of the true one."""
    ids = struct.pack(f"<{len(tokens)}q", *tokens)
    size = len(ids) + len(salt) if payload_len is None else payload_len
    return Frame(wire.OP_OPEN, 5, start=0, end=len(tokens), text=seq_id, payload_len=size).pack() + ids + salt


def test_raw_frames_malformed_and_oversized(node: Node) -> None:
    node.cache(PROMPT[:12])
    state = node.state()
    with _raw(node) as sock:
        # 4 ids announced, a payload of 3: refused after the payload was drained
        sock.sendall(_open_frame("raw", PROMPT[:4], payload_len=24)[:-8])
        reply = wire.read_frame(sock)
        assert reply is not None and reply.request_id == 5
        assert reply.status == INVALID and reply.extra == "InvalidArgument"
        assert reply.text == "bulk open: 24 payload bytes cannot hold 4 token ids (32 bytes)"
        assert _ping_ok(sock)  # still in sync
        # a well-formed open with a salt answers like the rpc's
        sock.sendall(_open_frame("raw", PROMPT, b"salt"))
        reply = wire.read_frame(sock)
        assert reply is not None and reply.status == wire.STATUS_OK and (reply.start, reply.end) == (0, 0)
        sock.sendall(_open_frame("raw2", PROMPT))
        reply = wire.read_frame(sock)
        assert reply is not None and reply.status == wire.STATUS_OK and (reply.start, reply.end) == (12, 0)
        assert _ping_ok(sock)
    node.engine.free("raw")
    node.engine.free("raw2")
    assert node.state() == state
    dropped = node.counters()[2]
    with _raw(node) as sock:  # a payload too large to drain: refused, and the connection closes
        sock.sendall(Frame(wire.OP_OPEN, 7, end=1, text="big", payload_len=wire.MAX_CALL_BYTES + 1).pack())
        reply = wire.read_frame(sock)
        assert reply is not None and reply.status == INVALID and "exceeds" in reply.text
        assert wire.read_frame(sock, eof_ok=True) is None
    assert node.counters()[2] == dropped + 1
    assert node.state() == state
    node.assert_nothing_leaked()


def test_node_without_open_gets_the_rpc_from_then_on(node: Node, transport: str) -> None:
    server = node.server.bulk
    assert server is not None

    server.ops = server.ops - {wire.OP_OPEN}  # its HELLO says so
    node.cache(PROMPT[:12])
    with CacheClient(node.address) as client:
        assert open_result(client, "a", PROMPT) == OpenResult(12, 0)  # the rpc answered
        channel = channel_of(client)
        assert not channel.capabilities(5.0).serves(wire.OP_OPEN) and channel.num_opens == 0
        errors = node.counters()[1]
        assert open_result(client, "b", PROMPT) == OpenResult(12, 0)
        assert node.counters()[1] == errors  # the channel was not asked again
        assert node.rpc_count("Open") == 2
        for seq_id in ("a", "b"):
            client.sequence(seq_id).close()
    node.assert_nothing_leaked()


def test_asyncio_client_opens_over_the_channel(node: Node) -> None:
    node.cache(PROMPT[:12], salt=b"t")

    async def run(config: ClientConfig) -> list[OpenResult]:
        async with AsyncCacheClient(node.address, config) as client:
            results = []
            for i, limit in enumerate((None, 4)):
                seq = await client.open(f"s{i}", PROMPT, max_cached_tokens=limit)
                results.append(OpenResult(seq.num_cached_tokens, seq.num_host_hit_tokens))
            with pytest.raises(InvalidArgument, match="already exists"):
                await client.open("s0", PROMPT)
            for i in range(2):
                await (await client.sequence(f"s{i}")).close()
            return results

    requests = node.counters()[0]
    got = asyncio.run(run(ClientConfig(tenant_salt=b"t")))
    assert node.counters()[0] == requests + 2
    want = asyncio.run(run(ClientConfig(tenant_salt=b"t", bulk_min_bytes=None)))
    assert node.counters()[0] == requests + 2
    assert got == want == [OpenResult(12, 0), OpenResult(4, 0)]
    node.assert_nothing_leaked()

"""Every CacheNode rpc over a real server and channel (sync client), with attention
checked against float64 dense attention over the KV the test appended, and the
node's integrity check after each scenario."""

from __future__ import annotations

import grpc
import pytest
import torch
from kvref import SPEC, assert_attention, rand_kv, rand_q

from pagedkv.client import (
    CacheClient,
    CapacityExceeded,
    ClientConfig,
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    SequenceNotFound,
    Unavailable,
    channels,
)
from pagedkv.protos import pagedkv_pb2 as pb

BS = SPEC.block_size


@pytest.fixture
def client(node):
    with CacheClient(node.address) as c:
        yield c
        c.check_integrity()


def test_prefill_then_decode_matches_dense_reference(client: CacheClient) -> None:
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    k, v = rand_kv(10, seed=1)
    with client.open("a", prompt) as seq:
        assert seq.num_cached_tokens == 0
        assert seq.append(prompt, k, v) == 10
        # one decode step: layer 0 appends the token, layer 1 writes into its slot
        k1, v1 = rand_kv(1, seed=3)
        for layer in range(SPEC.num_layers):
            q1 = rand_q(1, seed=10 + layer)[0]
            res = seq.attend(layer, q1, k1[layer, 0], v1[layer, 0], token_id=7 if layer == 0 else None)
            full_k = torch.cat([k[layer], k1[layer]])
            full_v = torch.cat([v[layer], v1[layer]])
            assert res.out.shape == (4, SPEC.head_dim) and res.lse.shape == (4,)
            assert_attention(type(res)(res.out[None], res.lse[None]), q1[None], full_k, full_v)
        rk, rv = seq.read_kv()
        assert torch.equal(rk, torch.cat([k, k1], dim=1)) and torch.equal(rv, torch.cat([v, v1], dim=1))
        client.check_integrity()
    assert client.stats().counters["used_blocks"] == 0


@pytest.mark.parametrize("num_q_heads", [SPEC.num_kv_heads, 2 * SPEC.num_kv_heads])
def test_prefill_matches_dense_reference(client: CacheClient, num_q_heads: int) -> None:
    prompt = list(range(10))
    k, v = rand_kv(10, seed=1)
    with client.open("g", prompt) as seq:
        seq.append(prompt, k, v)
        # the last 3 tokens' queries over the cache, causally, per layer
        q = rand_q(3, seed=2, heads=num_q_heads)
        for layer in range(SPEC.num_layers):
            assert_attention(seq.attend_prefill(layer, q), q, k[layer], v[layer], causal_offset=7)
        # chunked prefill that appends its own tokens at layer 0, then writes layer 1
        k2, v2 = rand_kv(2, seed=3)
        q2 = rand_q(2, seed=4, heads=num_q_heads)
        res = seq.attend_prefill(0, q2, k2[0], v2[0], [10, 11])
        assert_attention(res, q2, torch.cat([k[0], k2[0]]), torch.cat([v[0], v2[0]]), causal_offset=10)


def test_batched_decode_one_rpc_per_layer(client: CacheClient) -> None:
    kvs = {}
    seqs = []
    for i, n in enumerate((5, 9, 12)):
        toks = list(range(1000 * i, 1000 * i + n))
        kvs[i] = rand_kv(n, seed=20 + i)
        seq = client.open(f"s{i}", toks)
        seq.append(toks, *kvs[i])
        seqs.append(seq)
    knew, vnew = rand_kv(3, seed=30)  # token b of the batch: knew[:, b]
    for layer in range(SPEC.num_layers):
        q = rand_q(3, seed=40 + layer)
        res = client.attend_batch(
            seqs,
            layer,
            q,
            knew[layer],
            vnew[layer],
            [1, 2, 3] if layer == 0 else None,
            return_block_mass=True,
        )
        assert res.block_mass is not None and res.block_mass.shape[0] == 3
        torch.testing.assert_close(res.block_mass.sum(dim=1), torch.full((3,), 4.0), atol=1e-4, rtol=0)
        for b in range(3):
            k_all = torch.cat([kvs[b][0][layer], knew[layer, b : b + 1]])
            v_all = torch.cat([kvs[b][1][layer], vnew[layer, b : b + 1]])
            assert_attention(type(res)(res.out[b : b + 1], res.lse[b : b + 1]), q[b : b + 1], k_all, v_all)
    for seq in seqs:
        seq.close()
    client.check_integrity()
    assert client.stats().counters["used_blocks"] == 0


def test_prefix_reuse_fork_and_copy_on_write(client: CacheClient) -> None:
    prompt = list(range(10))
    k, v = rand_kv(10, seed=5)
    with client.open("parent", prompt) as parent:
        parent.append(prompt, k, v)
        assert client.lookup(prompt) == 8  # two full blocks are keyed
        with client.open("again", prompt) as again:
            assert again.num_cached_tokens == 8
            again.append(prompt[8:], k[:, 8:], v[:, 8:])
            rk, _ = again.read_kv()
            assert torch.equal(rk, k)
        with parent.fork("child") as child:
            before = client.stats().counters["cow_copies"]
            kc, vc = rand_kv(1, seed=6)
            child.append([42], kc, vc)  # writes the shared partial block -> copy first
            assert client.stats().counters["cow_copies"] == before + 1
            ck, cv = child.read_kv()
            assert torch.equal(ck, torch.cat([k, kc], dim=1)) and torch.equal(cv, torch.cat([v, vc], dim=1))
            pk, _ = parent.read_kv()
            assert torch.equal(pk, k)  # the parent never sees the child's token
            q = rand_q(1, seed=7)
            assert_attention(child.attend(1, q), q, ck[1], cv[1])
            client.check_integrity()
    assert client.stats().counters["used_blocks"] == 0


def test_swap_out_and_in_across_the_wire(client: CacheClient) -> None:
    prompt = list(range(50, 63))
    k, v = rand_kv(13, seed=8)
    with client.open("s", prompt) as seq:
        seq.append(prompt, k, v)
        assert seq.swap_out() == 4
        stats = client.stats().counters
        assert stats["num_swapped"] == 1 and stats["host_used_blocks"] == 4
        with pytest.raises(FailedPrecondition, match="swapped out"):
            seq.attend(0, rand_q(1, 1)[0])
        with pytest.raises(FailedPrecondition):
            seq.read_kv()
        with pytest.raises(FailedPrecondition, match="already|swapped"):
            seq.swap_out()
        client.check_integrity()
        assert seq.swap_in() >= 1
        rk, rv = seq.read_kv()
        assert torch.equal(rk, k) and torch.equal(rv, v)
        with pytest.raises(FailedPrecondition, match="not swapped"):
            seq.swap_in()
    assert client.stats().counters["host_used_blocks"] == 0


def test_streamed_append_and_read_kv_in_many_chunks(node) -> None:
    config = ClientConfig(chunk_bytes=1000)  # forces ~ (2*2*40*2*8*4)/1000 = 21 chunks each way
    with CacheClient(node.address, config) as client:
        toks = list(range(40))
        k, v = rand_kv(40, seed=9)
        with client.open("big", toks) as seq:
            seq.append(toks, k, v)
            rk, rv = seq.read_kv(3, 37)
            assert torch.equal(rk, k[:, 3:37]) and torch.equal(rv, v[:, 3:37])
            rk, _ = seq.read_kv(5, 5)
            assert rk.shape == (SPEC.num_layers, 0, SPEC.num_kv_heads, SPEC.head_dim)
            with pytest.raises(InvalidArgument, match="range"):
                seq.read_kv(10, 41)
        client.check_integrity()


def test_pin_unpin_budget_stats_ping(make_node) -> None:
    node = make_node(num_blocks=8, num_host_blocks=0)
    with CacheClient(node.address) as client:
        client.ping()
        stats = client.stats()
        assert stats.spec == SPEC and stats.policy == "lru" and stats.counters["num_blocks"] == 8
        prompt = list(range(8))
        with client.open("p", prompt) as seq:
            seq.append(prompt, *rand_kv(8, 1))
        assert client.pin(prompt) == 8
        # fill the pool: the pinned prefix must survive eviction
        for i in range(3):
            toks = list(range(100 * (i + 1), 100 * (i + 1) + 8))
            with client.open(f"f{i}", toks) as seq:
                seq.append(toks, *rand_kv(8, i))
        assert client.lookup(prompt) == 8
        assert client.unpin(prompt) == 8
        with pytest.raises(InvalidArgument, match="pinned"):
            client.unpin(prompt)
        toks = list(range(500, 532))
        with client.open("budget", toks[:24]) as seq:
            seq.append(toks[:24], *rand_kv(24, 3))
            seq.set_budget(16, sink_blocks=1, recent_blocks=2)
            assert client.stats().counters["budget_dropped_blocks"] == 2
            with pytest.raises(InvalidArgument, match="budget"):
                seq.set_budget(4, sink_blocks=1, recent_blocks=2)
            seq.set_budget(None)
        client.check_integrity()
        assert client.stats().counters["used_blocks"] == 0


# ---------------------------------------------------------------- bad input over the wire


def _raw_stub(address: str, max_send: int = 256 * 1024 * 1024):
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", max_send)])
    from pagedkv.protos import pagedkv_pb2_grpc as pb_grpc

    return channel, pb_grpc.CacheNodeStub(channel)


def test_bad_input_gets_the_right_status_and_leaves_the_node_healthy(make_node) -> None:
    node = make_node(num_blocks=6, num_host_blocks=0)
    with CacheClient(node.address) as client:
        toks = list(range(6))
        seq = client.open("ok", toks)
        seq.append(toks, *rand_kv(6, 1))
        # wrong dtype
        with pytest.raises(InvalidArgument, match="dtype float64, this node serves float32"):
            seq.attend(0, rand_q(1, 1)[0].double())
        with pytest.raises(InvalidArgument, match="dtype"):
            seq.append([6], *(t.half() for t in rand_kv(1, 2)))
        # wrong shape
        with pytest.raises(InvalidArgument, match="shape"):
            seq.attend(0, torch.randn(3, SPEC.head_dim + 1))
        with pytest.raises(InvalidArgument, match="shape"):
            seq.append([6, 7], *rand_kv(1, 2))  # 2 tokens, KV for 1
        with pytest.raises(InvalidArgument, match="token_ids"):
            seq.attend(0, rand_q(1, 1)[0], *(t[0, 0] for t in rand_kv(1, 3)))  # layer 0 needs a token id
        # unknown sequence: the exact class comes back across the wire
        with pytest.raises(SequenceNotFound, match="nope"):
            client.sequence("nope").attend(0, rand_q(1, 1)[0])
        with pytest.raises(SequenceNotFound):
            client.sequence("nope").close()
        with pytest.raises(InvalidArgument, match="already exists"):
            client.open("ok", toks)
        # a full pool: 6 blocks, 2 used; 20 more tokens need 5
        with pytest.raises(CapacityExceeded, match="requested 5 blocks, only 4 available"):
            seq.append(list(range(20)), *rand_kv(20, 4))
        # more than the whole pool is refused from the header, before the bytes are buffered
        with pytest.raises(CapacityExceeded, match="whole pool"):
            seq.append(list(range(100)), *rand_kv(100, 4))

        channel, stub = _raw_stub(node.address)
        with channel:
            # garbage bytes: data length does not match dtype x shape
            q = pb.Tensor(dtype="float32", shape=[1, 4, 8], data=b"\x00" * 17)
            with pytest.raises(grpc.RpcError) as info:
                stub.Attend(pb.AttendRequest(seq_ids=["ok"], layer=1, q=q), timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "17 data bytes" in info.value.details()
            # token ids out of range on Open (the ids reach the engine as an array)
            with pytest.raises(grpc.RpcError) as info:
                stub.Open(pb.OpenRequest(seq_id="neg", token_ids=[3, -1, 4]), timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "token id -1 is not an int" in info.value.details()
            assert stub.Open(pb.OpenRequest(seq_id="empty"), timeout=5).num_cached_tokens == 0
            stub.Free(pb.SeqRequest(seq_id="empty"), timeout=5)
            q = pb.Tensor(dtype="complex7", shape=[1], data=b"")
            with pytest.raises(grpc.RpcError) as info:
                stub.Attend(pb.AttendRequest(seq_ids=["ok"], layer=1, q=q), timeout=5)
            assert (
                info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                and "unknown dtype" in info.value.details()
            )
            # an Append stream that sends more bytes than its header declared
            head = pb.AppendHeader(
                seq_id="ok", token_ids=[6], kv=pb.TensorHeader(dtype="float32", shape=[2, 2, 1, 2, 8])
            )
            one_token = 2 * 2 * 1 * 2 * 8 * 4  # [2, layers, 1, kv_heads, head_dim] float32
            streams = {
                "more than the 1 tokens": [
                    pb.AppendChunk(header=head, data=bytes(one_token), num_tokens=1),
                    pb.AppendChunk(data=bytes(one_token), num_tokens=1),
                ],
                "200 data bytes": [pb.AppendChunk(header=head, data=bytes(200), num_tokens=1)],
                "sent 1 tokens, its header declared 2": [  # ends early
                    pb.AppendChunk(
                        header=pb.AppendHeader(
                            seq_id="ok",
                            token_ids=[6, 7],
                            kv=pb.TensorHeader(dtype="float32", shape=[2, 2, 2, 2, 8]),
                        ),
                        data=bytes(one_token),
                        num_tokens=1,
                    )
                ],
                "at least one token": [pb.AppendChunk(header=head, data=b"", num_tokens=0)],
            }
            for message, chunks in streams.items():
                with pytest.raises(grpc.RpcError) as info:
                    stub.Append(iter(chunks), timeout=5)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
                assert message in info.value.details()
            with pytest.raises(grpc.RpcError) as info:
                stub.Append(iter([pb.AppendChunk(data=b"x")]), timeout=5)
            assert "header" in info.value.details()
            # oversized unary payload: over the server's 64 MiB limit
            big = pb.Tensor(dtype="float32", shape=[1, 4, 8], data=bytes(65 * 1024 * 1024))
            with pytest.raises(grpc.RpcError) as info:
                stub.Attend(pb.AttendRequest(seq_ids=["ok"], layer=1, q=big), timeout=10)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in info.value.details()
        # the client refuses to send it too (same limit on the channel)
        with pytest.raises(CapacityExceeded):
            seq.attend(0, torch.randn(1, 4 * 1024 * 1024 + 1, 4))

        assert node.health() == "SERVING"
        client.ping()
        client.check_integrity()
        k, v = rand_kv(1, 7)
        assert seq.append([6], k, v) == 7  # the sequence is intact and usable
        seq.close()
        client.check_integrity()
        counters = client.stats().counters
        assert counters["used_blocks"] == 0 and counters["num_sequences"] == 0
    errors = node.metrics.registry.get_sample_value
    assert errors("pagedkv_rpc_errors_total", {"method": "Attend", "code": "INVALID_ARGUMENT"}) >= 4


def test_unexpected_exception_becomes_internal_and_the_server_survives(node, monkeypatch) -> None:
    def boom(*args, **kwargs):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(node.engine, "lookup", boom)
    with CacheClient(node.address) as client:
        with pytest.raises(IntegrityError, match="internal error: RuntimeError: kaboom"):
            client.lookup([1, 2, 3])
        client.ping()
    assert node.health() == "SERVING"


def test_unreachable_node_raises_unavailable_after_bounded_retries() -> None:
    config = ClientConfig(deadline_s=1.0, initial_backoff_s=0.01, max_backoff_s=0.02)
    with CacheClient("127.0.0.1:1", config) as client, pytest.raises(Unavailable):
        client.ping()


def test_graceful_shutdown_flips_health(make_node) -> None:
    node = make_node()
    assert node.health() == "SERVING"
    node.server.health.enter_graceful_shutdown()
    assert node.health() == "NOT_SERVING"
    node.server.stop(0.5)
    config = ClientConfig(deadline_s=0.5, max_attempts=1)
    with CacheClient(node.address, config) as client, pytest.raises(Unavailable):
        client.ping()


def test_channels_are_shared_per_address(node) -> None:
    a, b = CacheClient(node.address), CacheClient(node.address)
    assert channels.acquire(node.address, a.config) is channels.acquire(node.address, b.config)
    channels.release(node.address, a.config)
    channels.release(node.address, a.config)
    a.close()
    b.ping()  # still open: b holds it
    b.close()

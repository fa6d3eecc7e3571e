"""AttendPrefillBatch over a real server and channel: several sequences' prefill at one layer in
one rpc, checked against float64 dense attention; bad requests are refused with a clear error
and change nothing (lengths, K/V, blocks, integrity)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from kvref import SPEC, assert_attention, rand_kv, rand_q

from pagedkv.client import AsyncCacheClient, CacheClient, CapacityExceeded, InvalidArgument, SequenceNotFound
from pagedkv.client.codec import prefill_batch_request
from pagedkv.client.control import call
from pagedkv.client.sync import split_prefill_batch

BS = SPEC.block_size


@pytest.fixture
def client(node: Any) -> Any:
    with CacheClient(node.address) as c:
        yield c
        c.check_integrity()


def _state(client: CacheClient, seqs: list[Any]) -> tuple:
    """Everything a refused request must leave as it was."""
    counters = client.stats().counters
    kv = [seq.read_kv() for seq in seqs]
    return counters["used_blocks"], counters["free_blocks"], [(k.clone(), v.clone()) for k, v in kv]


def _assert_same(before: tuple, after: tuple) -> None:
    assert before[:2] == after[:2]
    for (k0, v0), (k1, v1) in zip(before[2], after[2], strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_batch_appends_and_attends_every_sequence_like_single_prefills(client: CacheClient) -> None:
    # a: 6 cached tokens + 3 new; b: nothing yet + 5 new (different lengths, one rpc per layer)
    ka, va = rand_kv(9, seed=1)
    kb, vb = rand_kv(5, seed=2)
    ids_a, ids_b = list(range(100, 109)), list(range(200, 205))
    with client.open("a", ids_a[:6]) as a, client.open("b", ids_b) as b:
        a.append(ids_a[:6], ka[:, :6], va[:, :6])
        for layer in range(SPEC.num_layers):
            qa, qb = rand_q(3, seed=10 + layer), rand_q(5, seed=20 + layer)
            res = client.attend_prefill_batch(
                [a, b],
                layer,
                [3, 5],
                torch.cat([qa, qb]),
                torch.cat([ka[layer, 6:], kb[layer]]),
                torch.cat([va[layer, 6:], vb[layer]]),
                ids_a[6:] + ids_b if layer == 0 else None,
            )
            assert res.out.shape == (8, 4, SPEC.head_dim) and res.lse.shape == (8, 4)
            assert res.block_mass is None
            part_a = type(res)(res.out[:3], res.lse[:3])
            part_b = type(res)(res.out[3:], res.lse[3:])
            assert_attention(part_a, qa, ka[layer], va[layer], causal_offset=6)
            assert_attention(part_b, qb, kb[layer], vb[layer], causal_offset=0)
        rk, rv = a.read_kv()
        assert torch.equal(rk, ka) and torch.equal(rv, va)
        rk, rv = b.read_kv()
        assert torch.equal(rk, kb) and torch.equal(rv, vb)
        client.check_integrity()
        # without k/v the queries stand for each sequence's last n tokens
        qa, qb = rand_q(2, seed=30), rand_q(5, seed=31)
        res = client.attend_prefill_batch([a, b], 1, [2, 5], torch.cat([qa, qb]))
        assert_attention(type(res)(res.out[:2], res.lse[:2]), qa, ka[1], va[1], causal_offset=7)
        assert_attention(type(res)(res.out[2:], res.lse[2:]), qb, kb[1], vb[1], causal_offset=0)
    assert client.stats().counters["used_blocks"] == 0


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("duplicate", "more than once"),
        ("count_mismatch", "token counts"),
        ("zero_count", "num_tokens"),
        ("rows_mismatch", r"q has shape \(3, 4, 8\), expected \(2, '\*', 8\)"),
        ("token_count", "token ids"),
        ("tokens_past_layer_0", "layer 0 only"),
        ("k_without_v", "together"),
        ("bad_layer", "layer"),
        ("too_few_held", "fewer than"),
    ],
)
def test_bad_requests_are_refused_and_change_nothing(client: CacheClient, case: str, message: str) -> None:
    k, v = rand_kv(4, seed=1)
    with client.open("a", [1, 2, 3, 4]) as a, client.open("b", [5, 6]) as b:
        a.append([1, 2, 3, 4], k, v)
        b.append([5, 6], k[:, :2], v[:, :2])
        before = _state(client, [a, b])
        q, kn, vn = rand_q(3, seed=2), rand_kv(3, seed=3)[0][0], rand_kv(3, seed=4)[0][0]
        args: dict[str, Any] = {
            "duplicate": dict(seqs=[a, a], layer=0, num_tokens=[1, 2], q=q, k=kn, v=vn, token_ids=[7, 8, 9]),
            "count_mismatch": dict(
                seqs=[a, b], layer=0, num_tokens=[3], q=q, k=kn, v=vn, token_ids=[7, 8, 9]
            ),
            "zero_count": dict(seqs=[a, b], layer=0, num_tokens=[3, 0], q=q, k=kn, v=vn, token_ids=[7, 8, 9]),
            "rows_mismatch": dict(seqs=[a, b], layer=0, num_tokens=[1, 1], q=q, k=kn, v=vn, token_ids=[7, 8]),
            "token_count": dict(seqs=[a, b], layer=0, num_tokens=[1, 2], q=q, k=kn, v=vn, token_ids=[7, 8]),
            "tokens_past_layer_0": dict(
                seqs=[a, b], layer=1, num_tokens=[1, 2], q=q, k=kn, v=vn, token_ids=[7, 8, 9]
            ),
            "k_without_v": dict(
                seqs=[a, b], layer=0, num_tokens=[1, 2], q=q, k=kn, v=None, token_ids=[7, 8, 9]
            ),
            "bad_layer": dict(
                seqs=[a, b], layer=SPEC.num_layers, num_tokens=[1, 2], q=q, k=kn, v=vn, token_ids=None
            ),
            # b holds 2 tokens: 3 queries without new K/V cannot be its last 3
            "too_few_held": dict(seqs=[b], layer=1, num_tokens=[3], q=q),
        }[case]
        with pytest.raises(InvalidArgument, match=message):
            client.attend_prefill_batch(**args)
        _assert_same(before, _state(client, [a, b]))
        assert a.read_kv()[0].shape[1] == 4 and b.read_kv()[0].shape[1] == 2
        client.check_integrity()
    assert client.stats().counters["used_blocks"] == 0


def test_the_node_checks_counts_itself(client: CacheClient, node: Any) -> None:
    """A request built without the client's checks: one count for two sequences."""
    k, v = rand_kv(2, seed=1)
    with client.open("a", [1, 2]) as a, client.open("b", [3, 4]) as b:
        a.append([1, 2], k, v)
        b.append([3, 4], k, v)
        before = _state(client, [a, b])
        req = prefill_batch_request(["a", "b"], 1, [2], rand_q(2, seed=2), None, None, None)
        with pytest.raises(InvalidArgument, match=r"num_tokens must hold one count >= 1 per sequence \(2\)"):
            call(client.node(node.address).data.grpc.stub.AttendPrefillBatch, req, 5.0)
        _assert_same(before, _state(client, [a, b]))


def test_unknown_sequence_is_not_found_and_changes_nothing(client: CacheClient, node: Any) -> None:
    k, v = rand_kv(2, seed=1)
    with client.open("a", [1, 2]) as a:
        a.append([1, 2], k, v)
        before = _state(client, [a])
        with pytest.raises(SequenceNotFound):
            client.attend_prefill_batch(
                [a, "nope"],
                0,
                [1, 1],
                rand_q(2, seed=2),
                rand_kv(2, seed=3)[0][0],
                rand_kv(2, seed=4)[0][0],
                [3, 4],
            )
        _assert_same(before, _state(client, [a]))
    assert client.stats().counters["used_blocks"] == 0


def test_running_out_of_room_keeps_earlier_rows_and_leaks_nothing(make_node: Any) -> None:
    node = make_node(num_blocks=3, num_host_blocks=0)  # 12 tokens of room
    with CacheClient(node.address) as client:
        a, b = client.open("a", [1], max_cached_tokens=0), client.open("b", [2], max_cached_tokens=0)
        k, v = rand_kv(10, seed=1)
        with pytest.raises(CapacityExceeded):  # a takes 2 blocks (6 tokens), b's 6 need 2 more
            client.attend_prefill_batch(
                [a, b],
                0,
                [6, 6],
                rand_q(12, seed=2),
                torch.cat([k[0], k[0, :2]]),
                torch.cat([v[0], v[0, :2]]),
                list(range(10, 22)),
            )
        assert b.read_kv()[0].shape[1] == 0  # b did not fit: unchanged
        assert a.read_kv()[0].shape[1] == 6  # the documented partial effect: a, before b, was appended
        client.check_integrity()
        a.close()
        b.close()
        assert client.stats().counters["used_blocks"] == 0
        client.check_integrity()


def test_async_client_batches_the_same_way(node: Any) -> None:
    ka, va = rand_kv(5, seed=1)
    kb, vb = rand_kv(3, seed=2)

    async def scenario() -> None:
        async with AsyncCacheClient(node.address) as client:
            async with client.open("a", [1, 2, 3, 4, 5]) as a, client.open("b", [6, 7, 8]) as b:
                for layer in range(SPEC.num_layers):
                    qa, qb = rand_q(5, seed=10 + layer), rand_q(3, seed=20 + layer)
                    res = await client.attend_prefill_batch(
                        [a, b],
                        layer,
                        [5, 3],
                        torch.cat([qa, qb]),
                        torch.cat([ka[layer], kb[layer]]),
                        torch.cat([va[layer], vb[layer]]),
                        [1, 2, 3, 4, 5, 6, 7, 8] if layer == 0 else None,
                    )
                    assert_attention(
                        type(res)(res.out[:5], res.lse[:5]), qa, ka[layer], va[layer], causal_offset=0
                    )
                    assert_attention(
                        type(res)(res.out[5:], res.lse[5:]), qb, kb[layer], vb[layer], causal_offset=0
                    )
                with pytest.raises(InvalidArgument, match="token counts"):
                    await client.attend_prefill_batch([a, b], 1, [8], rand_q(8, seed=3))
            await client.check_integrity()
            assert (await client.stats()).counters["used_blocks"] == 0

    asyncio.run(scenario())


def test_split_prefill_batch_groups_each_nodes_rows_in_order() -> None:
    where = [("n1", "a"), ("n2", "b"), ("n1", "c")]
    q = torch.arange(6.0)[:, None, None]  # rows: a = 0, 1 | b = 2, 3, 4 | c = 5
    parts = split_prefill_batch(where, [2, 3, 1], q, q + 10, q + 20, [100, 101, 102, 103, 104, 105])
    assert [(p.address, p.rows, p.seq_ids, p.num_tokens) for p in parts] == [
        ("n1", [0, 1, 5], ["a", "c"], [2, 1]),
        ("n2", [2, 3, 4], ["b"], [3]),
    ]
    assert parts[0].q.flatten().tolist() == [0.0, 1.0, 5.0]
    assert parts[1].k.flatten().tolist() == [12.0, 13.0, 14.0]
    assert parts[0].token_ids == [100, 101, 105] and parts[1].token_ids == [102, 103, 104]
    (one,) = split_prefill_batch([("n1", "a"), ("n1", "b")], [1, 1], q[:2], None, None, None)
    assert one.q is q[:2] or torch.equal(one.q, q[:2])
    with pytest.raises(InvalidArgument, match="2 token counts for 3 sequences"):
        split_prefill_batch(where, [1, 1], q, None, None, None)

"""A decode batch over several nodes where one node cannot take its rows' new tokens
(issue 20): those sequences spill to a new extent and the step is retried, and the rows
the other nodes already took are not appended twice. Against the float64 reference of
test_sharded.py, every node's integrity checked after every step."""

from __future__ import annotations

import pytest
import torch
from test_sharded import Q_HEADS, Cluster, Reference, assert_close, spec_of, start_cluster

from pagedkv.client import Sequence
from pagedkv.client.types import AttentionResult

FULL = {"free_blocks": 0, "used_blocks": 64}
EMPTY = {"free_blocks": 64, "used_blocks": 0}


def place_on(c: Cluster, node_id: str) -> None:
    """Every other node looks full to the coordinator: the next open lands on node_id."""
    for name in c.engines:
        c.coordinator.heartbeat(name, EMPTY if name == node_id else FULL)


def decode_batch(c: Cluster, seqs: list[Sequence], refs: list[Reference], token: int) -> None:
    kvs = [ref.kv(1) for ref in refs]
    for layer in range(c.spec.num_layers):
        q = torch.stack([ref.rand(Q_HEADS, c.spec.head_dim) for ref in refs])
        k = torch.stack([kv[0][layer, 0] for kv in kvs])
        v = torch.stack([kv[1][layer, 0] for kv in kvs])
        tokens = [token + i for i in range(len(seqs))] if layer == 0 else None
        res = c.client.attend_batch(seqs, layer, q, k, v, tokens)
        for row, ref in enumerate(refs):
            part = AttentionResult(res.out[row : row + 1], res.lse[row : row + 1])
            assert_close(part, ref.attention(layer, q[row : row + 1], ref.num_tokens - 1))
    c.check()


@pytest.mark.parametrize("other", ["one node", "two nodes"])
@pytest.mark.parametrize("full_first", [False, True], ids=["taken-first", "refused-first"])
def test_a_full_node_in_a_batch_spills_its_rows_and_appends_the_others_once(
    redis_url: str, other: str, full_first: bool
) -> None:
    """`full` fills the small node's pool; `other` lives on the big node (and, sharded, on
    n3 too): the batch's first step is refused on the small node only."""
    spec = spec_of(4)
    for c in start_cluster(redis_url, spec, {"small": 2, "big": 64, "n3": 64}):
        place_on(c, "small")
        full = c.client.open("full", [1])
        place_on(c, "big")
        cap = 8 if other == "two nodes" else None
        kept = c.client.open("kept", [2], max_extent_tokens=cap)
        place_on(c, "n3")  # where `kept` spills to when sharded
        refs = {"full": Reference(spec, seed=1), "kept": Reference(spec, seed=2)}
        for seq, n in ((full, 8), (kept, 11)):
            k, v = refs[seq.seq_id].kv(n)
            seq.append(list(range(n)), k, v)
        kept.max_extent_tokens = None
        for name in c.engines:
            c.coordinator.heartbeat(name, EMPTY)
        assert [e.route.node_id for e in full.extents] == ["small"]
        assert [e.route.node_id for e in kept.extents] == (["big", "n3"] if cap else ["big"])
        order = [full, kept] if full_first else [kept, full]
        for step in range(3):
            decode_batch(c, order, [refs[s.seq_id] for s in order], 500 + 2 * step)
        assert len(full.extents) == 2 and full.extents[1].first_token == 8  # spilled at the seal
        assert c.client.counters["spills"] == (2 if cap else 1)  # (kept spilled on its append)
        for seq in order:
            k_all, v_all = seq.read_kv()  # every token once, in order: none appended twice
            ref = refs[seq.seq_id]
            assert seq.num_tokens == ref.num_tokens
            torch.testing.assert_close(k_all, ref.k, rtol=0, atol=0)
            torch.testing.assert_close(v_all, ref.v, rtol=0, atol=0)
            seq.close()
        c.coordinator.wait_idle()
        assert sum(c.held().values()) == 0
        c.check()

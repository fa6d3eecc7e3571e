"""A decode step whose rows append or not (AttendRequest.appends, the bulk ATTEND counts):
what lets a batch of sequences sharded across nodes cost one call per node (a node holds
one sequence's tail, which appends, beside another's earlier extent, which only attends).

A real node server with its bulk listener; the same calls over gRPC and over the bulk
channel (shared memory where it can, else TCP), checked against float64 attention over
the K/V each sequence was given. A bad flag list is refused on both and changes nothing.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_bulk_attend import GRPC, Node, spec_of

from pagedkv.client import CacheClient, ClientConfig, shm
from pagedkv.protos.errors import InvalidArgument

Q_HEADS = 4


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Hq, D] over k, v [n, Hk, D] (every key visible), float64."""
    group = q.shape[0] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("hd,nhd->hn", q.double(), k) / math.sqrt(q.shape[-1])
    return torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), v), torch.logsumexp(scores, -1)


@pytest.mark.parametrize("path", ["grpc", "shm", "tcp"])
def test_only_the_flagged_rows_append(path: str, monkeypatch: pytest.MonkeyPatch):
    if path == "tcp":
        monkeypatch.setattr(shm, "is_supported", lambda: False)
    node = Node(spec_of("float32"))
    spec = node.spec
    g = torch.Generator().manual_seed(3)
    kv = {}
    for i, (sid, n) in enumerate((("tail", 5), ("sealed", 6), ("also-tail", 3))):
        k, v = torch.randn(2, spec.num_layers, n, 2, 8, generator=g)
        tokens = list(range(1000 * i, 1000 * i + n))  # no shared prefix
        node.engine.open(sid, tokens)
        node.engine.append(sid, tokens, k, v)
        kv[sid] = [k, v]
    config = GRPC if path == "grpc" else ClientConfig(bulk_min_bytes=0)
    try:
        with CacheClient(node.address, config) as client:
            ids = ["tail", "sealed", "also-tail"]
            flags = [True, False, True]
            new_k, new_v = torch.randn(2, spec.num_layers, 2, 2, 8, generator=g)  # the two appending rows
            for layer in range(spec.num_layers):
                q = torch.randn(3, Q_HEADS, 8, generator=g)
                tokens = [50, 51] if layer == 0 else None
                res = client.data.attend(ids, layer, q, new_k[layer], new_v[layer], tokens, appends=flags)
                for row, sid in enumerate(ids):
                    k, v = kv[sid][0][layer], kv[sid][1][layer]
                    if flags[row]:
                        j = sum(flags[:row])
                        k, v = torch.cat([k, new_k[layer, j, None]]), torch.cat([v, new_v[layer, j, None]])
                    out, lse = reference(q[row], k, v)
                    torch.testing.assert_close(res.out[row].double(), out, atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(res.lse[row].double(), lse, atol=1e-5, rtol=1e-5)
            assert [node.engine.sequence_length(s) for s in ids] == [6, 6, 4]
            before = node.state()
            q = torch.randn(3, Q_HEADS, 8, generator=g)
            one_k = new_k[0, :1]
            for bad, why in (
                (([True, False], one_k, [7]), "flags for 3 sequences"),
                (([False, False, False], one_k[:0], []), "at least one row that appends"),
                (([True, False, False], None, None), "flags need k and v"),
                (
                    ([True, False, False], new_k[0], [7]),
                    "expected \\(1, 2, 8\\)",
                ),  # two rows of k, one writer
            ):
                flag_list, k, tokens = bad
                with pytest.raises(InvalidArgument, match=why):
                    client.data.attend(ids, 0, q, k, k, tokens, appends=flag_list)
            assert node.state() == before  # nothing changed, the node still serves
            client.data.attend(ids, 0, q)
    finally:
        node.server.stop(0)
        node.engine.close()

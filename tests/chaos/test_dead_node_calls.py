"""Data calls to a node that died and stays down (issue 18), with real processes: a
redis-server, a coordinator and two nodes; node-0 is SIGKILLed with workers holding handles.

Before the coordinator has declared it dead every data call on its sequences answers
Unavailable naming its address (a node that is only slow, or a suspect, may come back: a
retry may succeed). Once declared dead, every data call kind answers SequenceLost naming the
node, as close does, on the plain sequence, in a batch beside a live one, and on a sequence
sharded across both nodes whose earlier (non-tail) extent was on the dead node. The node
cannot say this itself: the client asks the coordinator on the Unavailable (routing.py).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from harness import (
    DETECTION_BOUND_S,
    LEASE_S,
    PROMPT_TOKENS,
    Q_HEADS,
    SPEC,
    TOKEN,
    ChaosCluster,
    placed,
    wait_for,
)
from harness import seeded_kv as kv

from pagedkv.client import (
    AsyncCacheClient,
    AsyncSequence,
    CacheClient,
    ClientConfig,
    SequenceLost,
    Unavailable,
)

pytestmark = pytest.mark.timeout(180)


def data_calls(client: CacheClient, seq, live) -> dict:
    """Every data call kind on `seq` (a batch: beside `live`, on the other node)."""
    q = torch.randn(Q_HEADS, SPEC.head_dim)
    k1, v1 = (t[0, 0] for t in kv(1, 7))  # [kv_heads, D]: one new token at layer 0
    k, v = kv(1, 8)
    return {
        "append": lambda: seq.append([5], k, v),
        "attend": lambda: seq.attend(0, q, k1, v1, token_id=5),
        "attend_no_append": lambda: seq.attend(1, q),
        "attend_prefill": lambda: seq.attend_prefill(0, q[None], k1[None], v1[None], [5]),
        "read_kv": lambda: seq.read_kv(0, PROMPT_TOKENS),
        "attend_batch": lambda: client.attend_batch([live, seq], 1, torch.stack([q, q])),
        "attend_prefill_batch": lambda: client.attend_prefill_batch([seq], 1, [1], q[None]),
    }


def is_lost(client: CacheClient, seq_id: str) -> bool:
    """The coordinator has declared the sequence's node dead (its page table says lost)."""
    try:
        client.routing.describe(seq_id)
    except SequenceLost:
        return True
    except Unavailable:  # its node is a suspect: no verdict yet
        return False
    return False


@pytest.mark.parametrize(
    ("transports", "secure"),
    [(("shm", "unix", "tcp", "grpc"), True), (("tcp", "grpc"), False), (("grpc",), True)],
    ids=["shm-tickets", "tcp-no-secret", "grpc-tickets"],
)
def test_every_data_call_on_a_dead_nodes_sequence_answers_sequence_lost(tmp_path, transports, secure):
    """Whichever transport carried the call (over a connection the kill broke, or one
    refused) and whether or not the node holds tickets: the same answers."""
    config = ClientConfig(deadline_s=4.0, transports=transports)
    with (
        ChaosCluster(tmp_path, secure=secure) as cc,
        CacheClient(coordinator=cc.coordinator, token=TOKEN, spec=SPEC, config=config) as client,
    ):
        address = cc.cluster.node_addresses[0]
        seq, live = placed(client, "node-0", "plain"), placed(client, "node-1", "live")
        sharded = placed(client, "node-0", "sharded")
        aclient = AsyncCacheClient(coordinator=cc.coordinator, token=TOKEN, spec=SPEC, config=config)
        aseq = AsyncSequence(aclient, placed(aclient.sync, "node-0", "async"))
        sharded.extend()  # its tail continues on node-1; tokens [0, PROMPT_TOKENS) stay on node-0
        assert [e.route.node_id for e in sharded.extents] == ["node-0", "node-1"]
        cc.cluster.kill("node-0")  # SIGKILL; it stays down
        killed = time.monotonic()
        for call in data_calls(client, seq, live).values():
            with pytest.raises(Unavailable, match=address):
                call()
        # (no verdict before 1.5 L after the last beat, which came at most L/4 before the kill)
        assert time.monotonic() - killed < LEASE_S * 0.8, "too slow to see the calls before the verdict"

        wait_for(lambda: is_lost(client, seq.seq_id), DETECTION_BOUND_S + 2, "node-0 declared dead")
        wait_for(lambda: is_lost(client, sharded.seq_id), 2.0, "the sharded sequence lost")
        sharded_calls = ("attend_no_append", "attend_prefill", "read_kv")
        for target, names in ((seq, None), (sharded, sharded_calls)):
            for name, call in data_calls(client, target, live).items():
                if names is not None and name not in names:
                    continue
                for _ in range(2):  # every time, not once
                    with pytest.raises(SequenceLost, match="node-0") as info:
                        call()
                    assert (info.value.seq_id, info.value.node_id) == (target.seq_id, "node-0"), name
        # a token budget kept over both nodes asks each for its scores first: answered alike
        with pytest.raises(SequenceLost, match="node-0") as info:
            sharded.set_budget(4 * SPEC.block_size, 1, 1)
        assert (info.value.seq_id, info.value.node_id) == (
            sharded.seq_id,
            "node-0",
        ) and sharded.budget is None
        asyncio.run(_async_calls(aclient, aseq))
        live_k, _ = live.read_kv(0, PROMPT_TOKENS)  # the live node's sequence is untouched
        assert torch.equal(live_k, kv(PROMPT_TOKENS, int(live.seq_id.rsplit("-", 1)[1]))[0])
        for target in (seq, sharded):
            with pytest.raises(SequenceLost, match="node-0"):
                target.close()
            target.close()  # the record went with that report: a second close succeeds
        live.close()
        # Nobody left to say: the coordinator and the last node killed, a data call's
        # Unavailable stands, its check with the coordinator bounded (routing.py: 1 s).
        other = placed(client, "node-1", "orphan")
        cc.cluster.kill("coordinator")
        cc.cluster.kill("node-1")
        start = time.monotonic()
        with pytest.raises(Unavailable, match=cc.cluster.node_addresses[1]):
            other.read_kv(0, 1)
        assert time.monotonic() - start < 2.5


async def _async_calls(aclient: AsyncCacheClient, seq: AsyncSequence) -> None:
    """The asyncio client's data calls (the same client underneath, on its threads)."""
    q = torch.randn(Q_HEADS, SPEC.head_dim)
    for call in (seq.read_kv(0, 1), seq.attend(1, q), aclient.attend_batch([seq], 1, q[None])):
        with pytest.raises(SequenceLost, match="node-0") as info:
            await call
        assert (info.value.seq_id, info.value.node_id) == (seq.seq_id, "node-0")
    await aclient.close()

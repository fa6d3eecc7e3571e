"""How a worker learns of a loss (issue 18), pinned with real parts in one process: a node
served over gRPC without a cluster secret (no tickets: it cannot tell a lost sequence from
one nobody opened), a coordinator on a real redis-server served over gRPC, and the client.

- a sequence its node lost (the node came back empty) answers SequenceLost naming the node
  on every data call and on close, once; an id nobody opened and a closed one stay NOT_FOUND;
- the coordinator's close while the node is a suspect (lease lapsed, no verdict yet)
  changes nothing and answers Unavailable; a worker's close frees on the node first, so a
  node that answers is closed, and once it is declared dead the close answers SequenceLost.
"""

from __future__ import annotations

import time

import pytest
import torch

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.server import create_server as create_node_server
from pagedkv.client import CacheClient, ClientConfig, SequenceLost, SequenceNotFound, Unavailable
from pagedkv.cluster import free_port
from pagedkv.coordinator.auth import Tenants
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.records import Extent, SequenceRecord
from pagedkv.coordinator.redis_store import RedisStore
from pagedkv.coordinator.service import create_server as create_coordinator_server
from pagedkv.protos.spec import ModelSpec

pytestmark = pytest.mark.timeout(120)
SPEC = ModelSpec(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
PROMPT = list(range(1, 11))


def kv(n: int) -> torch.Tensor:
    return torch.randn(SPEC.num_layers, n, SPEC.num_kv_heads, SPEC.head_dim)


@pytest.fixture
def stack(redis_url):
    """A node (open trust: no tickets) registered as n1, a coordinator (lease 1 s, no reaper
    thread: the test beats and reaps), and a client of it."""
    engine = CacheEngine(EngineConfig(SPEC, 64, device="cpu", unknown_seq_grace_s=0.2))
    node_server, node_port = create_node_server(engine, "127.0.0.1:0", bulk_port=None)
    node_server.start()
    store = RedisStore(redis_url)
    coordinator = Coordinator(store, CoordinatorConfig(lease_ttl_s=1.0, probe_timeout_s=0.5))
    address = f"127.0.0.1:{node_port}"
    coordinator.register("n1", address, SPEC.to_dict(), 64, epoch=7)
    coord_server, coord_port = create_coordinator_server(coordinator, "127.0.0.1:0", tenants=Tenants())
    coord_server.start()
    client = CacheClient(
        coordinator=f"127.0.0.1:{coord_port}", spec=SPEC, config=ClientConfig(deadline_s=10.0)
    )
    yield engine, coordinator, client, address
    client.close()
    coord_server.stop(0)
    coordinator.stop()
    node_server.stop(0)
    store.close()


def opened(client: CacheClient, seq_id: str):
    seq = client.open(seq_id, PROMPT)
    seq.append(PROMPT, kv(len(PROMPT)), kv(len(PROMPT)))
    return seq


def test_a_lost_sequence_answers_sequence_lost_on_every_data_call_and_on_close(stack):
    engine, coordinator, client, address = stack
    seq, other = opened(client, "s"), opened(client, "t")
    other.close()
    coordinator.wait_idle()
    # The node restarted on its port and registered again: it came back empty, and without
    # tickets it knows nothing of "s" (its Register reply is the only other way to learn it).
    engine.reset()
    coordinator.register("n1", address, SPEC.to_dict(), 64, epoch=8)
    q = torch.randn(2, SPEC.head_dim)
    k1, v1 = torch.randn(1, SPEC.head_dim), torch.randn(1, SPEC.head_dim)
    calls = {
        "append": lambda: seq.append([5], kv(1), kv(1)),
        "attend": lambda: seq.attend(0, q, k1, v1, token_id=5),
        "attend_prefill": lambda: seq.attend_prefill(0, q[None], k1[None], v1[None], [5]),
        "read_kv": lambda: seq.read_kv(0, 4),
        "attend_batch": lambda: client.attend_batch([seq], 0, q[None]),
    }
    for name, call in calls.items():
        with pytest.raises(SequenceLost, match="'s' was lost: node n1 re-registered") as info:
            call()
        assert (info.value.seq_id, info.value.node_id) == ("s", "n1"), name
    with pytest.raises(SequenceLost, match="node n1") as info:
        seq.close()
    assert info.value.node_id == "n1"
    client.routing.close("s")  # the record went with that answer: a retried close succeeds
    # NOT_FOUND stays NOT_FOUND where nothing was lost: an id nobody opened, a closed one.
    data = client.node(address).data
    for seq_id in ("nobody", "t"):
        with pytest.raises(SequenceNotFound):
            data.read_kv(seq_id, 0, 1)
    assert engine.stats()["num_sequences"] == 0


def lapse(coordinator: Coordinator) -> None:
    """Until n1's lease lapsed (no beat for a lease): a suspect."""
    deadline = time.monotonic() + 10
    while coordinator.live_node("n1") is not None:
        assert time.monotonic() < deadline, "n1's lease did not lapse"
        time.sleep(0.05)


def test_a_close_while_the_node_is_a_suspect_waits_for_the_verdict(stack):
    """The coordinator's own close (an older client's: no node_freed) changes nothing while
    the node is a suspect and answers Unavailable; retried, it gets the verdict. A worker's
    close asks the node first: this node answers (it keeps no lease, so it is never fenced),
    so the close frees it there and succeeds; once the node is declared dead the page table
    says lost and the close answers SequenceLost."""
    engine, coordinator, client, address = stack
    back, dead = opened(client, "back"), opened(client, "dead")
    coordinator.wait_idle()
    lapse(coordinator)
    with pytest.raises(Unavailable, match="node n1 missed its lease .*suspect"):
        client.routing.close("back")
    assert coordinator.store.get_sequence("back").state == "active"
    assert engine.stats()["num_sequences"] == 2  # nothing changed anywhere
    back.close()  # the node answered the worker's Free: freed, the page table dropped
    assert back.is_closed and engine.stats()["num_sequences"] == 1
    with pytest.raises(SequenceNotFound):
        coordinator.store.get_sequence("back")
    # Declared dead (liveness.py: a grace, then a failed probe: the node answers another
    # epoch): the close reports the loss, once.
    deadline = time.monotonic() + 15
    while coordinator.reap() != ["n1"]:
        assert time.monotonic() < deadline, "n1 was not declared dead"
        time.sleep(0.1)
    with pytest.raises(SequenceLost, match="'dead' was lost: node n1 died") as info:
        dead.close()
    assert info.value.node_id == "n1" and dead.is_closed
    client.routing.close("dead")  # a second close succeeds
    with pytest.raises(SequenceNotFound):
        coordinator.store.get_sequence("dead")
    assert engine.stats()["num_sequences"] == 0  # (the node kept it: the worker's Free freed it)


def test_an_open_whose_node_open_never_came_answers_sequence_lost_within_a_second(stack):
    """The coordinator wrote the page table and answered the open, then died before its
    node Open went out (here: the record written as an open writes it, and no Open): the
    node never heard of the id, the record says live. The first data call's NOT_FOUND makes
    the coordinator ask the node, which does not hold it: lost, named, at once (not after
    reconciliation's ~3 leases)."""
    engine, coordinator, client, address = stack
    coordinator.store.create_sequence(SequenceRecord("ghost", "default", (Extent("n1", 0, 3),), 10))
    seq = client.sequence("ghost")  # the record alone says live
    start = time.monotonic()
    with pytest.raises(SequenceLost, match="'ghost' was lost: node n1 does not hold it") as info:
        seq.read_kv(0, 1)
    took = time.monotonic() - start
    assert info.value.node_id == "n1" and took < 2.0, took  # two 0.2 s graces and three round trips
    assert coordinator.store.get_sequence("ghost").state == "lost"
    with pytest.raises(SequenceLost, match="node n1"):  # every later data call says the same
        seq.append([1], kv(1), kv(1))
    with pytest.raises(SequenceLost, match="node n1"):
        seq.close()
    client.routing.close("ghost")  # the record went with that answer
    assert engine.stats()["num_sequences"] == 0


def test_an_open_whose_node_open_could_not_be_delivered_is_lost_not_forgotten(stack):
    """The node Open failed on the way (the coordinator could not reach the node: it died,
    or came back on its port while the coordinator's channel still waited out its
    reconnect backoff): the node has no tombstone to answer with, so the record is kept
    as lost, naming the node, instead of dropped (which left the worker NOT_FOUND)."""
    engine, coordinator, worker, address = stack
    # the coordinator sends the node Open (a worker that carries it learns on its own: below)
    client = CacheClient(coordinator=worker.address, spec=SPEC, config=ClientConfig(worker_opens=False))
    coordinator.register("n1", f"127.0.0.1:{free_port()}", SPEC.to_dict(), 64, epoch=9)  # nobody there
    seq = client.open("s", PROMPT)  # answered before the node Open (which fails)
    coordinator.wait_idle()
    with pytest.raises(SequenceLost, match="'s' was lost: its open could not be delivered to node n1"):
        client.sequence("s")
    with pytest.raises(SequenceLost, match="node n1") as info:
        seq.close()
    assert info.value.node_id == "n1"
    client.routing.close("s")
    with pytest.raises(SequenceNotFound):
        coordinator.store.get_sequence("s")
    assert engine.stats()["num_sequences"] == 0
    client.close()


def test_a_node_open_the_worker_could_not_deliver_is_lost_and_its_page_table_dropped(stack):
    """The worker carries the node Open (the client's default) and the node is not there:
    open() has answered; the next data call and the close raise SequenceLost naming the
    node, the page table is dropped (the id opens again), nothing is held anywhere."""
    engine, coordinator, client, address = stack
    coordinator.register("n1", f"127.0.0.1:{free_port()}", SPEC.to_dict(), 64, epoch=9)  # nobody there
    seq = client.open("s", PROMPT)
    with pytest.raises(
        SequenceLost, match="'s' was lost: its open could not be delivered to node n1"
    ) as info:
        seq.append(PROMPT, kv(len(PROMPT)), kv(len(PROMPT)))
    assert info.value.node_id == "n1"
    client.routing.node_opens.wait("s")  # the page table dropped
    with pytest.raises(SequenceNotFound):
        coordinator.store.get_sequence("s")
    with pytest.raises(SequenceLost, match="node n1"):
        seq.close()  # once
    client.routing.close("s")  # then closing is a no-op
    coordinator.register("n1", address, SPEC.to_dict(), 64, epoch=10)  # the node is back
    with client.open("s", PROMPT) as again:  # the id opens again
        assert again.append(PROMPT, kv(len(PROMPT)), kv(len(PROMPT))) == len(PROMPT)
    coordinator.wait_idle()  # the close's Free
    assert engine.stats()["num_sequences"] == 0

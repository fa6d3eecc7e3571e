"""Every attack of issue #17, sent as a hostile client would send it, against a real
secured cluster: each refused with the right status and message, and afterwards
(the `cluster` fixture) the victim's KV byte-identical, every node's invariants
intact, every server SERVING."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from hostile import Q_HEADS, QUOTA_BLOCKS, SPEC, TOKENS, Secured, kv, reply, send, status_of

from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import tensors, wire
from pagedkv.protos.errors import InvalidArgument, QuotaExceeded, SequenceNotFound
from pagedkv.protos.tickets import RIGHT_NODE, TICKET_KEY, Minter

NO_TICKET = "data calls need the ticket its coordinator issued for each sequence (none presented)"
NOT_COORDINATOR = "serves a cluster; only its coordinator may call it"
PROMPT = [1, 2, 3, 4, 5]


def _q(n: int = 1) -> pb.Tensor:
    return tensors.encode(torch.zeros(n, Q_HEADS, SPEC.head_dim))


def _kv_chunks(seq_id: str, tokens: list[int]) -> list[pb.AppendChunk]:
    k, v = kv(tokens, seed=99)
    data = tensors.byte_view(torch.stack((k, v)))[2].tobytes()
    shape = [2, SPEC.num_layers, len(tokens), SPEC.num_kv_heads, SPEC.head_dim]
    head = pb.AppendHeader(seq_id=seq_id, token_ids=tokens, kv=pb.TensorHeader(dtype="float32", shape=shape))
    return [pb.AppendChunk(header=head, data=data, num_tokens=len(tokens))]


def test_node_grpc_refuses_every_data_call_without_a_ticket(cluster: Secured) -> None:
    v = cluster.victim
    assert v is not None
    stub = cluster.node_stub(v.address)
    one = tensors.encode(torch.full((1, SPEC.num_kv_heads, SPEC.head_dim), 1e4))
    for seq_id in (v.node_seq_id, "victim"):  # by the node's id, and by the owner's
        data_calls = {
            "ReadKV": (stub.ReadKV, pb.ReadKVRequest(seq_id=seq_id)),
            "Attend": (stub.Attend, pb.AttendRequest(seq_ids=[seq_id], layer=0, q=_q())),
            "Attend+append": (
                stub.Attend,
                pb.AttendRequest(seq_ids=[seq_id], layer=0, q=_q(), k=one, v=one, token_ids=[7]),
            ),
            "AttendPrefill": (stub.AttendPrefill, pb.AttendPrefillRequest(seq_id=seq_id, layer=0, q=_q())),
            "AttendPrefillBatch": (
                stub.AttendPrefillBatch,
                pb.AttendPrefillBatchRequest(seq_ids=[seq_id], layer=0, num_tokens=[1], q=_q()),
            ),
            "Append": (stub.Append, iter(_kv_chunks(seq_id, [7]))),
            "SetBudget": (stub.SetBudget, pb.SetBudgetRequest(seq_id=seq_id, max_tokens=16)),
            "BlockMass": (stub.BlockMass, pb.BlockMassRequest(seq_id=seq_id, accumulated=True)),
            "DropBlocks": (stub.DropBlocks, pb.DropBlocksRequest(seq_id=seq_id, indices=[0])),
            # a worker's close frees on the node with its ticket: checked as a data call
            "Free": (stub.Free, pb.SeqRequest(seq_id=seq_id)),
        }
        for name, (fn, request) in data_calls.items():
            code, details = status_of(fn, request)
            assert code == "UNAUTHENTICATED" and NO_TICKET in details, (name, code, details)
        control_calls = {
            "Fork": (stub.Fork, pb.ForkRequest(parent_id=seq_id, child_id="stolen")),
            "SwapOut": (stub.SwapOut, pb.SeqRequest(seq_id=seq_id)),
            "SwapIn": (stub.SwapIn, pb.SeqRequest(seq_id=seq_id)),
        }
        for name, (fn, request) in control_calls.items():
            code, details = status_of(fn, request)
            assert code == "PERMISSION_DENIED" and NOT_COORDINATOR in details, (name, code, details)


def test_a_free_with_another_sequences_ticket_frees_nothing(cluster: Secured) -> None:
    """beta's ticket for its own sequence on the victim's node frees neither the victim (by
    the node's id or the owner's) nor anything else (the fixture checks the victim intact)."""
    v = cluster.victim
    assert v is not None
    stub = cluster.node_stub(v.address)
    own = _own_seq(cluster, v.address, "free")
    metadata = ((TICKET_KEY, own.route.ticket),)
    for seq_id in (v.node_seq_id, "victim"):
        code, details = status_of(stub.Free, pb.SeqRequest(seq_id=seq_id), metadata)
        assert code == "PERMISSION_DENIED" and "no ticket for sequence" in details, (code, details)
    assert status_of(stub.Free, pb.SeqRequest(seq_id=own.route.node_seq_id), metadata) == ("OK", "")
    own.close()  # its own Free answers NOT_FOUND now: the coordinator's Close still succeeds


def test_no_client_chooses_a_salt_on_a_cluster_node(cluster: Secured) -> None:
    """Open, Lookup, Pin and Unpin carry a tenant salt: on a node serving a cluster they are
    its coordinator's only, so nobody gets a prefix-hit oracle by guessing or learning a salt."""
    v = cluster.victim
    assert v is not None
    stub = cluster.node_stub(v.address)
    prompt = list(range(50_000, 50_000 + 100))
    salt = b"\x00" * 16
    own = _own_seq(cluster, v.address)
    for name, fn, request in (
        ("Open", stub.Open, pb.OpenRequest(seq_id="mine", token_ids=prompt, tenant_salt=salt)),
        ("Lookup", stub.Lookup, pb.LookupRequest(token_ids=prompt, tenant_salt=salt)),
        ("Pin", stub.Pin, pb.PinRequest(token_ids=prompt, tenant_salt=salt)),
        ("Unpin", stub.Unpin, pb.PinRequest(token_ids=prompt, tenant_salt=salt)),
    ):
        # with the attacker's own valid ticket too: a data ticket is no licence for control calls
        for metadata in (None, ((TICKET_KEY, own.route.ticket),)):
            code, details = status_of(fn, request, metadata)
            assert code == "PERMISSION_DENIED" and NOT_COORDINATOR in details, (name, code, details)
    own.close()


def _own_seq(cluster: Secured, address: str, name: str = "own") -> Any:
    """A sequence of beta's own on the node at `address` (its ticket is beta's to use). The
    ones placed elsewhere stay open until one lands there: each adds to its node's load, so
    placement turns to `address` whatever the opens of earlier tests left behind."""
    beta = cluster.clients["beta"]
    elsewhere = []
    try:
        for i in range(40):
            seq = beta.open(f"{name}-{i}", [7_000 + i, 1, 2])
            if seq.route.address == address:
                return seq
            elsewhere.append(seq)
    finally:
        for seq in elsewhere:
            seq.close()
    raise AssertionError(f"no beta sequence landed on {address}")


def test_bulk_channel_refuses_without_a_ticket(cluster: Secured) -> None:
    v = cluster.victim
    assert v is not None
    for connect in (cluster.bulk_tcp, cluster.bulk_unix):
        with connect(v.address) as sock:
            send(sock, wire.Frame(wire.OP_READ, 1, start=0, end=wire.END_OF_SEQUENCE, text=v.node_seq_id))
            r = reply(sock)
            assert r.status == wire.Status.UNAUTHENTICATED and NO_TICKET in r.text, r
            # an OPEN's salt is its caller's (direct mode): the coordinator's alone here
            send(sock, wire.Frame(wire.OP_OPEN, 2, end=3, text="mine", payload_len=8 * 3 + 16), bytes(40))
            r = reply(sock)
            assert r.status == wire.Status.PERMISSION_DENIED and NOT_COORDINATOR in r.text, r
            k, vv = kv([7], seed=3)
            body = torch.stack((k, vv))
            frame = wire.Frame(
                wire.OP_APPEND,
                3,
                end=1,
                num_layers=SPEC.num_layers,
                num_kv_heads=SPEC.num_kv_heads,
                head_dim=SPEC.head_dim,
                slab_tokens=1,
                text=v.node_seq_id,
                payload_len=body.numel() * 4,
            )
            send(sock, frame, torch.tensor([7]).numpy().tobytes() + wire.byte_view(body).tobytes())
            r = reply(sock)
            assert r.status == wire.Status.UNAUTHENTICATED and NO_TICKET in r.text, r


def test_coordinator_refuses_node_calls_without_the_cluster_secret(cluster: Secured) -> None:
    stub = cluster.coordinator_stub()
    spec = pb.ModelSpec(**SPEC.to_dict())
    fake = pb.RegisterRequest(node_id="fake", address="127.0.0.1:9", spec=spec, num_blocks=10**9)
    victim_node = cluster.victim.seq.route.node_id  # type: ignore[union-attr]
    takeover = pb.RegisterRequest(node_id=victim_node, address="127.0.0.1:9", spec=spec, num_blocks=10**9)
    prompt = list(range(50_000, 50_000 + 100))
    # (the victim's keys are salted with alpha's secret salt; the attack needs no valid key to be refused)
    removed = pb.ReportEventsRequest(
        node_id=victim_node, events=[pb.BlockEvent(kind=pb.BlockEvent.REMOVED, key=bytes(16))]
    )
    forged = Minter(_other_keys(), ttl_s=60).get(RIGHT_NODE, "fake")
    for metadata, want in ((None, "carries no cluster credential"), (((TICKET_KEY, forged),), "not signed")):
        for name, fn, request in (
            ("Register", stub.Register, fake),
            ("Register", stub.Register, takeover),
            (
                "Heartbeat",
                stub.Heartbeat,
                pb.HeartbeatRequest(node_id="fake", load=pb.NodeLoad(free_blocks=10**9)),
            ),
            ("ReportEvents", stub.ReportEvents, removed),
            (
                "Reserve",
                stub.Reserve,
                pb.ReserveRequest(node_id=victim_node, seq_id="beta/x", min_blocks=1, num_blocks=1),
            ),
        ):
            code, details = status_of(fn, request, metadata)
            assert code == "UNAUTHENTICATED" and want in details, (name, code, details)
    nodes = {n.node_id: n.address for n in cluster.cluster.stats().nodes}
    assert "fake" not in nodes and nodes[victim_node] != "127.0.0.1:9"
    # the prefix index still says where the victim's prompt is, and new opens go to real nodes
    alpha = cluster.clients["alpha"]
    assert alpha.lookup(prompt) == 96
    probe = alpha.open("probe", list(range(60_000, 60_100)))
    assert probe.route.address in cluster.node_addresses()
    probe.close()


def _other_keys():  # a secret of another cluster: its tickets are forgeries here
    from pagedkv.protos.tickets import ClusterKeys

    return ClusterKeys([b"another cluster's secret key .................."])


def test_a_registration_cannot_take_over_a_live_nodes_id(cluster: Secured) -> None:
    """Even with the cluster secret (a second node misconfigured with the same id)."""
    v = cluster.victim
    assert v is not None
    node_id = v.seq.route.node_id
    credential = Minter(cluster.keys, ttl_s=60).get(RIGHT_NODE, node_id)
    request = pb.RegisterRequest(
        node_id=node_id, address="127.0.0.1:9", spec=pb.ModelSpec(**SPEC.to_dict()), num_blocks=10**9
    )
    code, details = status_of(cluster.coordinator_stub().Register, request, ((TICKET_KEY, credential),))
    assert code == "FAILED_PRECONDITION" and f"node id {node_id!r} is live" in details, (code, details)
    assert cluster.clients["alpha"].sequence("victim").route.address == v.address  # not lost


def test_sequence_ids_are_scoped_by_tenant(cluster: Secured) -> None:
    alpha, beta = cluster.clients["alpha"], cluster.clients["beta"]
    # squatting: beta opens an id first; alpha's own open, appends and attention are alpha's
    squat = beta.open("shared-name", [1, 2, 3, 4])
    bk, bv = kv([1, 2, 3, 4], seed=5)
    squat.append([1, 2, 3, 4], bk, bv)
    mine = alpha.open("shared-name", [1, 2, 3, 4])
    assert mine.num_cached_tokens == 0  # no hit: another tenant's blocks
    ak, av = kv([1, 2, 3, 4], seed=6)
    mine.append([1, 2, 3, 4], ak, av)
    assert torch.equal(mine.read_kv()[0], ak) and torch.equal(squat.read_kv()[0], bk)
    mine.close()
    squat.close()
    # another tenant's id answers exactly as one nobody opened: no existence oracle
    answers = []
    for seq_id in ("victim", "never-opened-by-anyone"):
        with pytest.raises(SequenceNotFound) as err:
            beta.sequence(seq_id)
        answers.append(str(err.value).replace(seq_id, "ID"))
        assert beta.routing.close(seq_id) is None  # close is idempotent: OK for both, no oracle
        with pytest.raises(SequenceNotFound) as err:
            beta.routing.fork(seq_id, "child")
        answers.append(str(err.value).replace(seq_id, "ID"))
    assert answers[:2] == answers[2:], answers
    own = beta.open("victim", [9, 9, 9])  # beta's own "victim": another sequence altogether
    assert own.route.node_seq_id == "beta/victim"
    own.close()


def test_an_overlong_sequence_id_is_refused_naming_the_limit(cluster: Secured) -> None:
    """A 5,000-character id (one Redis key, and in every ticket and event) is refused before
    anything is placed: open, fork and close alike; the tenant's quota untouched."""
    alpha = cluster.clients["alpha"]
    long_id = "x" * 5000
    with pytest.raises(InvalidArgument, match="a seq_id of 5000 characters \\(at most 512\\)"):
        alpha.open(long_id, PROMPT)
    parent = alpha.open("parent", PROMPT)
    with pytest.raises(InvalidArgument, match="a child_id of 5000 characters"):
        alpha.routing.fork("parent", long_id)
    with pytest.raises(InvalidArgument, match="a seq_id of 5000 characters"):
        alpha.routing.close(long_id)
    ok = alpha.open("y" * 512, PROMPT)  # the limit itself is taken
    assert ok.route.node_seq_id == "alpha/" + "y" * 512
    ok.close()
    parent.close()
    with pytest.raises(SequenceNotFound):
        alpha.sequence(long_id[:512])


def test_quota_charges_the_blocks_a_sequence_holds(cluster: Secured) -> None:
    beta = cluster.clients["beta"]
    bs = SPEC.block_size
    prompt = list(range(80_000, 80_000 + QUOTA_BLOCKS * bs - 1))  # the whole quota at open
    seq = beta.open("hog", prompt)
    k, v = kv(prompt, seed=7)
    seq.append(prompt, k, v)
    seq.append([1], *kv([1], seed=8))  # the last slot of the 64th block: still within
    held = seq.read_kv()[0].shape[1]
    assert held == QUOTA_BLOCKS * bs
    more = list(range(16))
    with pytest.raises(QuotaExceeded, match="over quota"):
        seq.append(more, *kv(more, seed=9))
    one = torch.zeros(SPEC.num_kv_heads, SPEC.head_dim)
    with pytest.raises(QuotaExceeded):  # a decode step that would open block 65
        seq.attend(0, torch.zeros(Q_HEADS, SPEC.head_dim), one, one, token_id=5)
    with pytest.raises(QuotaExceeded):  # a fork reserves the parent's blocks (its copy-on-write fits)
        seq.fork("hog-child")
    assert seq.read_kv()[0].shape[1] == held  # nothing changed
    seq.swap_out()
    seq.swap_in()  # within its allowance: no more quota needed
    assert torch.equal(seq.read_kv()[0][:, : len(prompt)], k)
    seq.close()
    # a sequence grows past its prompt's blocks while the tenant has room
    small = beta.open("grows", [1, 2])
    grown = list(range(200))
    small.append(grown, *kv(grown, seed=10))
    assert small.read_kv()[0].shape[1] == 200
    small.close()
    time.sleep(0.2)  # (the close's node Free is sent after its reply)
    again = beta.open("hog-again", prompt)  # the closes gave the quota back
    again.close()


def test_internal_errors_of_bad_shapes_and_specs_are_invalid_argument(cluster: Secured) -> None:
    beta = cluster.clients["beta"]
    seq = beta.open("shapes", [1, 2, 3])
    seq.append([1, 2, 3], *kv([1, 2, 3], seed=11))
    stub = cluster.node_stub(seq.route.address)
    metadata = ((TICKET_KEY, seq.route.ticket),)
    huge = pb.Tensor(dtype="float32", shape=[0, 2**62, 4], data=b"")
    code, details = status_of(
        stub.Attend, pb.AttendRequest(seq_ids=[seq.route.node_seq_id], layer=0, q=huge), metadata
    )
    assert code == "INVALID_ARGUMENT" and "too large" in details, (code, details)
    coord = cluster.coordinator_stub()
    auth = (("authorization", f"Bearer {TOKENS['beta']}"),)
    bad = pb.ModelSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", block_size=0)
    for name, fn, request in (
        ("Lookup", coord.Lookup, pb.CoordLookupRequest(token_ids=[1, 2], spec=bad)),
        ("Pin", coord.Pin, pb.CoordPinRequest(token_ids=[1, 2], spec=bad)),
        ("Unpin", coord.Unpin, pb.CoordPinRequest(token_ids=[1, 2], spec=bad)),
    ):
        code, details = status_of(fn, request, auth)
        assert code == "INVALID_ARGUMENT" and "block_size must be a positive int" in details, (name, details)
    seq.close()

"""A seeded, bounded fuzz of every surface a hostile client reaches: the node's rpcs,
the coordinator's rpcs and the bulk channel's frames (TLS TCP and the same-host
socket). The attacker holds a valid ticket for a sequence of its own (so requests
get past the gate and reach the node's validation) and throws garbage otherwise.
Bad input must never answer INTERNAL or UNKNOWN; afterwards the victim is intact
and every server SERVING (the `cluster` fixture)."""

from __future__ import annotations

import contextlib
import random
import socket
import struct
from collections import Counter
from typing import Any

import grpc
from hostile import SPEC, TOKENS, Secured, kv

from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import wire
from pagedkv.protos.tickets import TICKET_KEY

RPC_CASES = 2500  # per rpc surface (seeded: a failure reproduces)
CASES = 1500  # bulk frames over the same-host socket
TCP_CASES = 150  # and over TLS TCP
BAD = {"INTERNAL", "UNKNOWN"}
DTYPES = ["float32", "float16", "bfloat16", "int64", "uint8", "bool", "", "complex64", "float32\x00"]
DIMS = [0, 1, 2, 3, 4, 32, 64, 2**31 - 1, 2**31, 2**62, -1, -(2**40)]
IDS = [0, 1, 5, 2**31, 2**63 - 1, -1, -(2**63)]
SEQS = [0, 1, 5, 2**63 - 1, 2**63, 2**64 - 1]  # uint64 fields


def _tensor(r: random.Random) -> pb.Tensor:
    if r.random() < 0.5:  # almost right: the node's own dtype and head_dim
        b, h = r.choice([1, 2, 3]), r.choice([2, 4, 3])
        shape = r.choice(
            [[b, h, SPEC.head_dim], [b, h, SPEC.head_dim + 1], [b, SPEC.num_kv_heads, SPEC.head_dim]]
        )
        n = 4 * _prod(shape)
        data = bytes(r.choice([n, n, n - 4, n + 4, 0])) if n < 1 << 16 else b""
        return pb.Tensor(dtype="float32", shape=shape, data=data)
    shape = [r.choice(DIMS) for _ in range(r.randrange(0, 7))]
    return pb.Tensor(dtype=r.choice(DTYPES), shape=shape, data=r.randbytes(r.choice([0, 4, 64, 4096])))


def _prod(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _tokens(r: random.Random) -> list[int]:
    return [r.choice(IDS) for _ in range(r.randrange(0, 6))]


def _spec(r: random.Random) -> pb.ModelSpec | None:
    return r.choice(
        [
            None,
            pb.ModelSpec(**SPEC.to_dict()),
            pb.ModelSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", block_size=0),
            pb.ModelSpec(num_layers=-1, num_kv_heads=2, head_dim=32, dtype="float32", block_size=16),
            pb.ModelSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype="int8", block_size=16),
            pb.ModelSpec(block_size=-5),
            # the model's name: empty, too long, control bytes, another model's
            pb.ModelSpec(**{**SPEC.to_dict(), "model": r.choice(["x" * 5000, "m\x00", "\n", "other/model"])}),
        ]
    )


def _call(fn: Any, request: Any, metadata: Any) -> str:
    try:
        reply = fn(request, timeout=10, metadata=metadata)
        if not hasattr(reply, "ListFields"):  # a stream
            for _ in reply:
                pass
    except grpc.RpcError as err:
        return str(err.code().name)  # type: ignore[attr-defined]
    return "OK"


def test_node_rpcs(cluster: Secured) -> None:
    r = random.Random(17)
    beta = cluster.clients["beta"]
    own = beta.open("fuzz-node", [11, 12, 13, 14, 15])
    own.append([11, 12, 13, 14, 15], *kv([1, 2, 3, 4, 5], seed=2))
    stub = cluster.node_stub(own.route.address)
    ids = [own.route.node_seq_id] * 12 + [
        "alpha/victim",
        "",
        "x" * 5000,
        "bé/ü",
        "beta/fuzz-node\x00",
        "beta/none",
    ]
    # mostly its own valid ticket: past the gate, into the node's validation
    tickets = [own.route.ticket] * 9 + [own.route.ticket[:-1], r.randbytes(80), b""]
    codes: Counter[str] = Counter()
    bad = []
    for i in range(RPC_CASES):
        seq_id = r.choice(ids)
        ticket = r.choice(tickets)
        metadata = ((TICKET_KEY, ticket),) if ticket and r.random() < 0.9 else None
        method = r.choice(
            ["Open", "Lookup", "Fork", "Free", "SwapOut", "SwapIn", "Pin", "Stats", "Ping", "CheckIntegrity"]
            + ["Append", "Attend", "AttendPrefill", "AttendPrefillBatch", "ReadKV", "SetBudget"] * 4
            + ["BlockMass", "DropBlocks"] * 2
        )
        layer = r.choice([0, 0, 1, -1, 2, 2**31 - 1])
        if method == "Open":
            req: Any = pb.OpenRequest(seq_id=seq_id, token_ids=_tokens(r), tenant_salt=r.randbytes(16))
        elif method == "Lookup":
            req = pb.LookupRequest(token_ids=_tokens(r))
        elif method == "Append":
            t = _tensor(r)
            shape = [r.choice(DIMS) for _ in range(r.randrange(0, 6))]
            head = pb.AppendHeader(
                seq_id=seq_id, token_ids=_tokens(r), kv=pb.TensorHeader(dtype=t.dtype, shape=shape)
            )
            chunks = [pb.AppendChunk(header=head, data=t.data, num_tokens=r.choice([0, 1, 2, -1]))]
            chunks += [pb.AppendChunk(data=r.randbytes(64), num_tokens=1)] * r.randrange(0, 2)
            req = iter(chunks)
        elif method == "Attend":
            req = pb.AttendRequest(seq_ids=[seq_id] * r.choice([1, 1, 2]), layer=layer, q=_tensor(r))
            if r.random() < 0.5:
                req.k.CopyFrom(_tensor(r))
                req.v.CopyFrom(_tensor(r))
                req.token_ids.extend(_tokens(r))
            req.return_block_mass = r.random() < 0.3
            if r.random() < 0.3:  # which rows append: any length, with or without k/v
                req.appends.extend(r.random() < 0.5 for _ in range(r.randrange(0, 4)))
        elif method == "AttendPrefill":
            req = pb.AttendPrefillRequest(seq_id=seq_id, layer=layer, q=_tensor(r), token_ids=_tokens(r))
            if r.random() < 0.5:
                req.k.CopyFrom(_tensor(r))
                req.v.CopyFrom(_tensor(r))
        elif method == "AttendPrefillBatch":
            req = pb.AttendPrefillBatchRequest(
                seq_ids=[seq_id], layer=layer, num_tokens=[r.choice([1, 2, 0, -1, 2**31])], q=_tensor(r)
            )
        elif method == "Fork":
            req = pb.ForkRequest(parent_id=seq_id, child_id=r.choice(ids))
        elif method == "Free" and seq_id == own.route.node_seq_id:
            # (freeing its own sequence would leave every later call on it waiting out the
            # node's grace for a late open, 0.5 s each: the cases after it test nothing more)
            req = pb.SeqRequest(seq_id=r.choice(ids[12:]))
        elif method in ("Free", "SwapOut", "SwapIn"):
            req = pb.SeqRequest(seq_id=seq_id)
        elif method == "ReadKV":
            req = pb.ReadKVRequest(
                seq_id=seq_id, start=r.choice(IDS), chunk_bytes=r.choice([0, 1, -1, 2**40])
            )
            if r.random() < 0.5:
                req.end = r.choice(IDS)
        elif method == "Pin":
            req = pb.PinRequest(token_ids=_tokens(r), tenant_salt=r.randbytes(16))
        elif method == "BlockMass":
            part = pb.MassQueries(
                layer=layer,
                q=_tensor(r),
                lse=[r.choice([0.0, -1e30, float("nan"), float("inf"), 3.5])] * r.choice([0, 1, 4, 8, 1000]),
                visible=[r.choice([0, 1, 2, -1, 2**40]) for _ in range(r.choice([0, 1, 2, 4]))],
            )
            req = pb.BlockMassRequest(
                seq_id=seq_id, queries=[part] * r.choice([0, 1, 3]), accumulated=r.random() < 0.2
            )
        elif method == "DropBlocks":
            req = pb.DropBlocksRequest(
                seq_id=seq_id, indices=[r.choice([0, 1, 2, -1, 2**31 - 1]) for _ in range(r.randrange(0, 4))]
            )
        elif method == "SetBudget":
            req = pb.SetBudgetRequest(
                seq_id=seq_id, max_tokens=r.choice(IDS), sink_blocks=r.choice([0, -1, 1, 2**31 - 1])
            )
        else:
            req = pb.Empty()
        code = _call(getattr(stub, method), req, metadata)
        codes[code] += 1
        if code in BAD:
            bad.append((i, method, code))
    print("node rpcs:", dict(codes))
    assert not bad, bad[:10]
    assert (
        codes["OK"] and codes["UNAUTHENTICATED"] and codes["PERMISSION_DENIED"] and codes["INVALID_ARGUMENT"]
    ), codes
    with contextlib.suppress(Exception):
        own.close()


def test_coordinator_rpcs(cluster: Secured) -> None:
    r = random.Random(29)
    stub = cluster.coordinator_stub()
    tokens = [
        ("authorization", f"Bearer {TOKENS['beta']}"),
        ("authorization", "Bearer forged"),
        ("authorization", "Basic x"),
    ]
    ids = ["fz-a", "fz-b", "victim", "", "x" * 5000, "a/b/c", "fz-\x00"]
    codes: Counter[str] = Counter()
    bad = []
    for i in range(RPC_CASES):
        # mostly the attacker's valid token: past authentication, into validation and the store
        auth = r.choice(
            [None, (tokens[1],), (tokens[2],), ((TICKET_KEY, r.randbytes(60)),)] + [(tokens[0],)] * 6
        )
        method = r.choice(
            ["Open", "Lookup", "Fork", "Close", "SwapOut", "SwapIn", "Pin", "Unpin", "Describe", "Stats"]
            + ["Register", "Heartbeat", "ReportEvents", "Reserve"]
        )
        seq_id = r.choice(ids)
        spec = _spec(r)
        if method == "Open":
            req: Any = pb.CoordOpenRequest(seq_id=seq_id, token_ids=_tokens(r), spec=spec)
            if r.random() < 0.3:
                req.max_cached_tokens = r.choice(IDS)
        elif method == "Lookup":
            req = pb.CoordLookupRequest(token_ids=_tokens(r), spec=spec)
        elif method == "Fork":
            req = pb.CoordForkRequest(parent_id=seq_id, child_id=r.choice(ids))
        elif method in ("Close", "SwapOut", "SwapIn", "Describe"):
            # node_not_found: the coordinator then asks the node (only for this tenant's ids)
            req = pb.CoordSeqRequest(seq_id=seq_id, node_not_found=r.random() < 0.3)
        elif method in ("Pin", "Unpin"):
            req = pb.CoordPinRequest(token_ids=_tokens(r), spec=spec)
        elif method == "Register":
            req = pb.RegisterRequest(
                node_id=seq_id, address="127.0.0.1:9", spec=spec, num_blocks=r.choice(IDS)
            )
        elif method == "Heartbeat":
            req = pb.HeartbeatRequest(node_id=seq_id, load=pb.NodeLoad(free_blocks=r.choice(IDS)))
        elif method == "ReportEvents":
            req = pb.ReportEventsRequest(
                node_id=seq_id,
                events=[pb.BlockEvent(kind=r.choice([0, 1, 2, 7]), key=r.randbytes(r.choice([16, 3])))],
            )
            if r.random() < 0.5:  # numbered (queued, applied in batches)
                req.epoch, req.first_seq, req.base_seq = (r.choice(SEQS) for _ in range(3))
        elif method == "Reserve":
            req = pb.ReserveRequest(
                node_id=seq_id, seq_id=seq_id, min_blocks=r.choice(IDS), num_blocks=r.choice(IDS)
            )
        else:
            req = pb.Empty()
        code = _call(getattr(stub, method), req, auth)
        codes[code] += 1
        if code in BAD:
            bad.append((i, method, code))
    print("coordinator rpcs:", dict(codes))
    assert not bad, bad[:10]
    assert codes["OK"] and codes["UNAUTHENTICATED"] and codes["INVALID_ARGUMENT"], codes
    beta = cluster.clients["beta"]
    for seq_id in ids:  # whatever the fuzz opened (or forked) with beta's token
        with contextlib.suppress(Exception):
            beta.routing.close(seq_id)


def test_bulk_frames(cluster: Secured) -> None:
    """Each frame on a fresh connection (the attacker's ticket presented first on most),
    then the sending side shut: a frame that promises more than it sends ends at once
    instead of waiting out the node's timeout. The same-host socket carries CASES of
    them (its dispatch is the TCP port's); TLS TCP carries TCP_CASES, each cut after a
    short wait for its reply."""
    r = random.Random(43)
    beta = cluster.clients["beta"]
    own = beta.open("fuzz-bulk", [21, 22, 23])
    own.append([21, 22, 23], *kv([1, 2, 3], seed=4))
    address = own.route.address
    ids = [own.route.node_seq_id] * 3 + ["alpha/victim", "", "zz"]
    statuses: Counter[int] = Counter()
    bad = []
    for i in range(CASES + TCP_CASES):
        is_tcp = i >= CASES
        sock: Any = cluster.bulk_tcp(address) if is_tcp else cluster.bulk_unix(address)
        try:
            if r.random() < 0.7:  # most connections present the attacker's valid ticket first
                sock.sendall(wire.encode_auth(1, [own.route.ticket]))
                wire.read_reply(sock)
            op = r.randrange(0, 15)
            payload = _bulk_payload(r, op)
            frame = wire.Frame(
                op,
                i,
                dtype=r.choice(wire.DTYPES),
                start=r.choice([0, 1, 3, 2**63, 2**64 - 1]),
                end=r.choice([0, 1, 3, 2**32, wire.END_OF_SEQUENCE]),
                num_layers=r.choice([0, 2, 65535]),
                num_kv_heads=r.choice([0, 2]),
                head_dim=r.choice([0, 32, 65535]),
                slab_tokens=r.choice([0, 1, 2**32 - 1]),
                text=r.choice(ids),
                payload_len=len(payload) if r.random() < 0.8 else r.choice([0, len(payload) + 1, 2**40]),
            )
            sock.sendall(frame.pack() + payload)
            if is_tcp:
                sock.settimeout(0.2)
            else:
                sock.shutdown(socket.SHUT_WR)
            reply = wire.read_reply(sock)
        except (wire.ProtocolError, OSError):
            reply = None
        finally:
            sock.close()
        if reply is not None:
            statuses[reply.status] += 1
            if reply.status in (wire.Status.INTERNAL, wire.Status.UNKNOWN):
                bad.append((i, op, reply.text))
    print("bulk frames:", {wire.Status(k).name: v for k, v in statuses.items()})
    assert not bad, bad[:10]
    assert statuses[wire.Status.OK] and statuses[wire.Status.INVALID_ARGUMENT], statuses
    own.close()


def _bulk_payload(r: random.Random, op: int) -> bytes:
    if op in (wire.OP_ATTEND, wire.OP_ATTEND_PREFILL_BATCH) and r.random() < 0.6:
        fields = [
            r.choice([0, 1, -1, 2**31 - 1]),
            r.randrange(8),
            r.randrange(4),
            r.randrange(3),
            r.randrange(4),
            r.randrange(40),
        ]
        head = wire.CALL.pack(*fields)
        descs = b"".join(
            wire.TENSOR.pack(
                r.randrange(12), r.randrange(7), *[r.choice([0, 1, 4, 32, 2**32 - 1]) for _ in range(5)]
            )
            for _ in range(r.randrange(1, 4))
        )
        return head + descs + r.randbytes(r.choice([0, 8, 64, 600]))
    if op == wire.OP_AUTH:
        return r.choice([b"", struct.pack("<BH", 1, 5) + b"abc", struct.pack("<BH", 9, 0), r.randbytes(30)])
    return r.randbytes(r.choice([0, 0, 8, 24, 32, 100]))

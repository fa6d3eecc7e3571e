"""The bulk wire codec (protos/wire/): every op's request and reply encoded by one
side's code and decoded by the other's, over a real socket pair where a socket is
read, and the malformed inputs each decoder must refuse."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
import torch

from pagedkv.protos import wire
from pagedkv.protos.errors import InvalidArgument, SequenceNotFound, SpecMismatch
from pagedkv.protos.wire import Frame


@pytest.fixture
def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


def roundtrip(pair: tuple[socket.socket, socket.socket], frame: Frame) -> Frame:
    a, b = pair
    a.sendall(frame.pack())
    got = wire.read_frame(b)
    assert got is not None
    return got


@pytest.mark.parametrize("op", sorted(wire.OP_NAMES))
def test_every_ops_frame_round_trips(pair: tuple[socket.socket, socket.socket], op: int) -> None:
    frame = Frame(
        op, 2**63 + 5, "bfloat16", wire.Status.OK, 3, wire.END_OF_SEQUENCE, 28, 4, 128, 512, "seq-ü", "x", 99
    )
    assert roundtrip(pair, frame) == frame


def test_frame_texts_are_capped_and_bad_headers_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    long = "y" * (wire.MAX_TEXT_BYTES + 10)
    assert roundtrip(pair, Frame(wire.OP_PING, text=long)).text == long[: wire.MAX_TEXT_BYTES]
    a, b = pair
    a.sendall(b"XXXX" + Frame(wire.OP_PING).pack()[4:])
    with pytest.raises(wire.ProtocolError, match="bad magic"):
        wire.read_frame(b)


def test_call_round_trips_for_attend_and_prefill_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 8, generator=gen)
    k = torch.randn(3, 2, 8, generator=gen).to(torch.bfloat16)
    v = torch.randn(3, 2, 8, generator=gen).to(torch.bfloat16)
    ids = np.array([7, 2**40, 0], dtype=np.int64)
    encoder, decoder = wire.IdsMemo(), wire.IdsMemo()
    for op, counts, mass in ((wire.OP_ATTEND, [], True), (wire.OP_ATTEND_PREFILL_BATCH, [1, 2], False)):
        seqs = ["a", "bé", "c"] if op == wire.OP_ATTEND else ["a", "bé"]
        head, size = wire.encode_call_body(seqs, -1, q, k, v, ids, counts, mass, encoder)
        body = b"".join(bytes(p) for p in wire.call_parts(head, [q, k, v]))
        assert len(body) == size
        call = wire.decode_call(op, memoryview(bytearray(body)), decoder)
        assert (call.layer, call.want_mass, call.seq_ids, call.counts) == (-1, mass, seqs, counts)
        assert call.token_ids == ids.tolist()
        assert torch.equal(call.q, q) and call.k is not None and call.v is not None
        assert call.k.dtype == torch.bfloat16 and torch.equal(call.k, k) and torch.equal(call.v, v)
    head, size = wire.encode_call_body(["s"], 0, q[:1], None, None, None, [], False, encoder)
    call = wire.decode_call(
        wire.OP_ATTEND, memoryview(bytearray(b"".join(wire.call_parts(head, [q[:1]])))), decoder
    )
    assert call.k is None and call.v is None and call.token_ids is None and torch.equal(call.q, q[:1])


def test_call_values_the_frame_cannot_carry_are_refused_before_sending() -> None:
    q = torch.zeros(1, 2, 4)
    memo = wire.IdsMemo()
    bad = {
        "count over int32": dict(seq_ids=["a"], num_tokens=[2**40]),
        "id over 64 KiB": dict(seq_ids=["x" * 70_000], num_tokens=[]),
        "id not a str": dict(seq_ids=[3], num_tokens=[]),
    }
    for name, kw in bad.items():
        with pytest.raises(wire.Unencodable):
            wire.encode_call_body(kw["seq_ids"], 0, q, None, None, None, kw["num_tokens"], False, memo)
        assert issubclass(wire.Unencodable, InvalidArgument), name
    with pytest.raises(wire.Unencodable, match="dims"):
        wire.encode_call_body(["a"], 0, torch.zeros(1, 1, 1, 1, 1, 1), None, None, None, [], False, memo)


def test_call_decoder_refuses_sections_that_disagree() -> None:
    q = torch.zeros(1, 2, 4)
    head, _ = wire.encode_call_body(["a"], 0, q, None, None, None, [], False, wire.IdsMemo())
    body = bytearray(b"".join(wire.call_parts(head, [q])))
    with pytest.raises(InvalidArgument, match="runs past"):
        wire.decode_call(wire.OP_ATTEND, memoryview(body[:-4]), wire.IdsMemo())
    with pytest.raises(InvalidArgument, match="its sections take"):
        wire.decode_call(wire.OP_ATTEND, memoryview(body + b"\0" * 8), wire.IdsMemo())
    with pytest.raises(InvalidArgument, match="CALL header"):
        wire.decode_call(wire.OP_ATTEND, memoryview(bytearray(4)), wire.IdsMemo())


def test_reply_round_trips_and_matches_the_expected_head() -> None:
    q = torch.zeros(5, 4, 8, dtype=torch.float16)
    descs = [("float16", (5, 4, 8)), ("float32", (5, 4)), ("float32", (5, 9))]
    for placement in (wire.PLACED_INLINE, wire.PLACED_REGION):
        head = wire.encode_reply(wire.OP_ATTEND, 4, descs, placement, 123)
        frame_len = wire.FRAME.size
        assert wire.FRAME.unpack_from(head)[-1] == wire.REPLY_SIZE + 123
        got_placement, got = wire.decode_reply(head[frame_len:])
        assert got_placement == placement
        assert got == [(torch.float16, (5, 4, 8)), (torch.float32, (5, 4)), (torch.float32, (5, 9))]
        plain = wire.encode_reply(wire.OP_ATTEND, 4, descs[:2], placement, 0)[frame_len:]
        assert wire.decode_result_head(q, placement) == plain
    with pytest.raises(wire.ProtocolError, match="1 tensors"):
        wire.decode_reply(wire.reply_body(descs[:1], wire.PLACED_INLINE))


def test_open_round_trips() -> None:
    ids = np.array([1, 2, 2**62], dtype=np.int64)
    for limit in (None, 0, 17):
        raw = wire.encode_open(9, "req-ü", ids, b"salt", limit)
        frame_len = wire.FRAME.size + len("req-ü".encode())
        fields = wire.FRAME.unpack_from(raw)
        frame = Frame(wire.OP_OPEN, 9, start=fields[6], end=fields[7], text="req-ü", payload_len=fields[-1])
        req = wire.decode_open(frame, raw[frame_len:])
        assert (req.seq_id, req.token_ids.tolist(), req.salt, req.max_cached_tokens) == (
            "req-ü",
            ids.tolist(),
            b"salt",
            limit,
        )
    short = Frame(wire.OP_OPEN, 1, end=4, text="s", payload_len=8)
    with pytest.raises(InvalidArgument, match="cannot hold 4 token ids"):
        wire.decode_open(short, bytes(8))
    with pytest.raises(wire.Unencodable, match="sequence id"):
        wire.encode_open(1, "x" * (wire.MAX_TEXT_BYTES + 1), ids, b"", None)


def test_hello_round_trips_over_a_socket(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    caps = wire.Capabilities(frozenset({wire.OP_ATTEND, wire.OP_OPEN}), "pagedkv-bulk-x", 1 << 20, 2 << 20, 8)

    def node() -> None:
        f = wire.read_frame(b)
        assert f is not None and f.op == wire.OP_HELLO
        payload = caps.encode()
        b.sendall(Frame(f.op, f.request_id, payload_len=len(payload)).pack() + payload)

    t = threading.Thread(target=node)
    t.start()
    got = wire.hello(a, 3)
    t.join(5)
    assert got == caps and got.serves(wire.OP_OPEN) and not got.serves(wire.OP_READ_SHM)
    with pytest.raises(wire.ProtocolError, match="malformed HELLO"):
        wire.Capabilities.decode(b"{}")


def test_error_replies_carry_the_class_and_status(pair: tuple[socket.socket, socket.socket]) -> None:
    for exc, status in (
        (SequenceNotFound("s-1"), wire.Status.NOT_FOUND),
        (SpecMismatch("wrong shape"), wire.Status.INVALID_ARGUMENT),
        (RuntimeError("a bug"), wire.Status.INTERNAL),
    ):
        frame, name = wire.error_frame(wire.OP_ATTEND, 5, exc, end=7)
        got = roundtrip(pair, frame)
        assert got.status == status and name == status.name and got.end == 7
        err = wire.error_of(got.status, got.text, got.extra, "node n1")
        assert str(err).startswith("node n1: ")
        if not isinstance(exc, RuntimeError):
            assert type(err) is type(exc) and vars(err).get("seq_id") == vars(exc).get("seq_id")
    a, b = pair
    a.sendall(wire.error_slab(SequenceNotFound("gone")))
    n, status, text, extra = wire.read_slab(b)
    assert (n, status, extra) == (0, wire.Status.NOT_FOUND, 'SequenceNotFound {"seq_id": "gone"}')
    assert "gone" in text

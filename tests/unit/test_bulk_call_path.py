"""The per-call pieces of the bulk channel's attend path that are kept from call to
call or read ahead: a reply's frame and REPLY taken in one recv (read_frame_ahead),
the sequence ids' encoding reused by the client and their parse reused by the node
(each one entry, compared by value), and an idle connection's liveness check. Each
is checked against the plain computation it stands for, on real socket pairs."""

from __future__ import annotations

import socket
import struct
import threading

import pytest
import torch

from pagedkv.protos import wire
from pagedkv.protos.errors import InvalidArgument
from pagedkv.protos.wire import Frame, ProtocolError

REPLY = wire.REPLY.pack(2, wire.PLACED_REGION) + bytes(range(3 * wire.TENSOR.size))


@pytest.fixture
def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def reply_buf() -> bytearray:
    return bytearray(wire.FRAME.size + wire.REPLY_SIZE)


# -- read_frame_ahead -------------------------------------------------------------


def test_ok_reply_and_its_head_come_in_one_recv(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    frame = Frame(wire.OP_ATTEND_SHM, 7, payload_len=wire.REPLY_SIZE)
    b.sendall(frame.pack() + REPLY)
    buf = reply_buf()
    got, ahead = wire.read_frame_ahead(a, buf)
    assert got == frame and ahead == wire.REPLY_SIZE
    assert bytes(buf[wire.FRAME.size :]) == REPLY


def test_reply_payload_past_the_buffer_stays_in_the_socket(pair: tuple[socket.socket, socket.socket]) -> None:
    """Over TCP the tensors follow REPLY: only REPLY_SIZE bytes are taken with the frame."""
    a, b = pair
    tail = bytes(range(200))
    b.sendall(Frame(wire.OP_ATTEND, 1, payload_len=wire.REPLY_SIZE + len(tail)).pack() + REPLY + tail)
    buf = reply_buf()
    got, ahead = wire.read_frame_ahead(a, buf)
    assert ahead == wire.REPLY_SIZE and got.payload_len == wire.REPLY_SIZE + len(tail)
    assert wire.recv_bytes(a, len(tail), "tail") == tail


def test_error_texts_are_read_and_moved_out_of_the_way(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    err = Frame(wire.OP_ATTEND_SHM, 3, status=3, text="bad q: ünïcode", extra="InvalidArgument")
    b.sendall(err.pack())
    got, ahead = wire.read_frame_ahead(a, reply_buf())
    assert got == err and ahead == 0
    # texts followed by payload bytes in the same send: the payload lands at FRAME.size
    b.sendall(Frame(wire.OP_ATTEND, 4, text="t", extra="xy", payload_len=wire.REPLY_SIZE).pack() + REPLY)
    buf = reply_buf()
    got, ahead = wire.read_frame_ahead(a, buf)
    assert (got.text, got.extra) == ("t", "xy") and 0 < ahead <= wire.REPLY_SIZE
    assert bytes(buf[wire.FRAME.size : wire.FRAME.size + ahead]) == REPLY[:ahead]
    rest = wire.recv_bytes(a, wire.REPLY_SIZE - ahead, "rest")
    assert bytes(buf[wire.FRAME.size : wire.FRAME.size + ahead]) + rest == REPLY


def test_a_header_split_over_sends_is_completed(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    err = Frame(wire.OP_ATTEND, 9, status=5, text="x" * 300, extra="SequenceNotFound")
    data = err.pack()
    b.sendall(data[:10])
    later = threading.Timer(0.05, lambda: b.sendall(data[10:]))
    later.start()
    got, ahead = wire.read_frame_ahead(a, reply_buf())
    later.join()
    assert got == err and ahead == 0


def test_read_frame_ahead_refuses_what_read_frame_refuses(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.sendall(b"XXXX" + Frame(wire.OP_PING).pack()[4:])
    with pytest.raises(ProtocolError, match="bad magic"):
        wire.read_frame_ahead(a, reply_buf())
    b.sendall(Frame(wire.OP_PING).pack()[:20])
    b.shutdown(socket.SHUT_WR)
    with pytest.raises(ProtocolError, match="closed after .* of a frame header"):
        wire.read_frame_ahead(a, reply_buf())
    with pytest.raises(ProtocolError, match="closed before a frame header"):
        wire.read_frame_ahead(a, reply_buf())


def test_frames_round_trip(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    frames = [
        Frame(wire.OP_READ, 2**40, "bfloat16", 0, 5, wire.END_OF_SEQUENCE, 3, 4, 128, 77, "seq-é", "", 9),
        Frame(wire.OP_PING),
        Frame(wire.OP_ATTEND, 1, status=13, text="boom", extra="Internal"),
    ]
    for f in frames:
        b.sendall(f.pack())
        assert wire.read_frame(a) == f
    assert Frame(wire.OP_PING).dtype == "float32"
    assert frames[0]._replace(op=wire.OP_APPEND).op == wire.OP_APPEND


# -- the client's encoding of the sequence ids ---------------------------------------


def fresh_section(ids: list[str]) -> bytes:
    raw = [s.encode() for s in ids]
    return struct.pack(f"<{len(raw)}H", *map(len, raw)) + b"".join(raw)


def test_client_reuses_the_last_batchs_ids_by_value() -> None:
    memo = wire.IdsMemo()
    ids = [f"seq-{i}" for i in range(32)]
    first = memo.encode(ids)
    assert first == fresh_section(ids)
    assert memo.encode(list(ids)) is first  # an equal list: reused
    ids[3] = "seq-ü"  # the caller changed its list: encoded again, non-ASCII too
    again = memo.encode(ids)
    assert again is not first and again == fresh_section(ids)
    assert memo.encode(tuple(ids)) == again  # any sequence works (a tuple is not memoized)
    assert memo.encode([]) == b""


def test_ids_the_frame_cannot_carry_are_refused_before_sending() -> None:
    q = torch.zeros(1, 2, 4)
    memo = wire.IdsMemo()
    for bad in (["x" * 70_000], [3]):
        with pytest.raises(wire.Unencodable):
            wire.encode_call_body(bad, 0, q, None, None, None, (), False, memo)  # type: ignore[arg-type]
    head, _ = wire.encode_call_body(["a", "b"], 0, q, None, None, None, (), False, memo)
    assert head.endswith(fresh_section(["a", "b"]))


# -- the node's parse of the sequence ids ------------------------------------------


def test_node_reuses_the_last_parse_only_for_the_same_bytes_and_count() -> None:
    memo = wire.IdsMemo()
    ids = ["a", "bb", "ccc"]
    raw = fresh_section(ids)
    first = memo.decode(raw, 3)
    assert first == ids
    first.append("mutated")  # the engine's to keep: the memo holds its own list
    assert memo.decode(raw, 3) == ids
    # the same bytes with another count are parsed again (and refused)
    with pytest.raises(InvalidArgument, match="overrun|bytes after"):
        memo.decode(raw, 2)
    with pytest.raises(InvalidArgument, match="not UTF-8"):
        memo.decode(b"\x01\x00\xff", 1)
    assert memo.decode(raw, 3) == ids


# -- idle connections ----------------------------------------------------------------


def test_idle_connection_liveness(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.settimeout(2.0)
    assert wire.is_alive(a)
    b.sendall(b"x")  # bytes on an idle connection: out of sync
    assert not wire.is_alive(a)
    a.recv(1)
    assert wire.is_alive(a) and a.gettimeout() == 2.0
    b.close()  # the node went away
    assert not wire.is_alive(a)
    a.close()
    assert not wire.is_alive(a)

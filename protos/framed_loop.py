"""FramedLoop: the framed port's plain-TCP connections, all served by one thread.

A node's link beats every lease/4 and sends its block events one-way: 1,000 nodes are
~1,300 beats a second on 1,000 connections, each call a few microseconds of work. A thread
per connection held 1,000 threads for that, and beats arriving together woke as many, which
then handed the interpreter lock to one another; a worker's Open and Close did the same
around each of their store calls. Here one thread waits on every such connection (epoll),
reads what each ready one sent and answers its requests in order. FramedServer hands a
plain-TCP connection over once it has served one of its `loop_methods` there; a TLS
connection keeps its thread; a method the loop does not serve is refused.

A link whose requests may wait (FRAME's `end` at least PACE_S: a node's beats and one-way
reports) is paced: a request that comes after a quiet spell is served at once, but while
such requests stream in they are served together at most every PACE_S, so that one wake-up
of this thread serves many (a wake-up from idle cost more than serving a lone report). A
request that may not wait moves its link back to being served as its bytes come. The calls
of the server's `batches` methods read in one wake-up are answered together (a turn's beats,
opens or closes: their store writes in one round trip), each link's later requests after
its answer. A batched call that allows more than two pacing periods (a node's beat allows 50
ms) is held for what its `end` leaves after them, or until its link sends more: at
a few hundred beats a second, answered as they came each turn took one or two, and a turn's
wake-ups and store round trip cost more than its beats (bench/README "Control plane at
scale"). A batched call that would wait here on another thread is handed back (its answer
raises Offload, answer_batch gives None): the loop answers it with the method's own
handler on a pool thread (OFFLOAD_THREADS), and its link reads nothing more until then.

The limits stay those of a connection's thread: a request the server refuses by its header
is answered and the connection closed; one not all there within its deadline (the frame
timeout plus its payload at the minimum rate) closes it, so does `idle_timeout_s` without a
byte, and so does a peer that lets MAX_UNSENT bytes of replies wait unread; a link leaves
the server's max_connections (its threads) for the loop's MAX_LINKS; a large request
being received counts against the listener's max_inflight_bytes (one over READ_BYTES at its
whole size from its header on, as a connection thread reserves it: it is received into a
buffer of that size and its payload handed on from there, not copied). A handler runs on
this thread: what it waits for (a store call) every adopted connection waits for, so the
coordinator fails beats at once for a moment after the store failed one (membership.py).
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .errors import CapacityExceeded, InvalidArgument
from .serving import name_os_thread
from .wire import Frame, ProtocolError, error_frame
from .wire import frame as wire_frame
from .wire.limits import BulkLimits, Refused

logger = logging.getLogger("pagedkv.framed")
READ_BYTES = 64 << 10  # one receive per ready connection and sweep
MAX_UNSENT = 1 << 20  # replies a peer leaves unread before it is closed
SWEEP_S = 0.5  # deadlines and idle connections are checked this often
# Links one loop serves; unlike the server's threads (max_connections), one costs a socket and
# a few buffers. 1,000 nodes beating to one coordinator need 1,000 (and as many descriptors).
MAX_LINKS = 1 << 14
# Paced links are served at most this often while their requests stream in: 1,200 lone
# reports a second then take ~6 a wake-up, not one. A request marks itself pliable by its
# FRAME's `end` (the microseconds the server may hold it); a node's reports allow 10 ms.
PACE_S = 0.005
PACE_US = round(PACE_S * 1e6)
_PACED = object()  # the key of the paced links' selector, watched by the main one
PACED_READS = 8  # receives per paced link and turn while each fills READ_BYTES
MAX_HOLD_S = 0.1  # a batched call is held no longer than this, whatever its `end` allows
# Threads for the requests a handler hands back (Offload: it would wait on another thread);
# each link has one such request at most, served before anything it sent after.
OFFLOAD_THREADS = 8


class _Call:
    """A batched method's request read and not answered yet: answered together with the others
    of its method once one of them is due (`due`, monotonic: at once unless its `end` allows a
    hold)."""

    __slots__ = ("due", "frame", "link", "payload")

    def __init__(self, link: _Link, frame: Frame, payload: bytes | memoryview, due: float) -> None:
        self.link, self.frame, self.payload, self.due = link, frame, payload, due


class _Link:
    __slots__ = (
        "buf",
        "deadline",
        "partial_at",
        "big",
        "big_at",
        "events",
        "held",
        "is_paced",
        "is_waiting",
        "key",
        "last_seen",
        "out",
        "sock",
    )

    def __init__(self, key: object, sock: socket.socket, buffered: bytes, is_paced: bool) -> None:
        self.key = key  # the server's handle, given back when the connection ends
        self.sock = sock
        self.buf = bytearray(buffered)
        self.out = bytearray()
        self.deadline = 0.0  # the partial request in buf must be whole by then (0: none)
        self.partial_at = 0.0  # when that request's first bytes came
        self.held = 0  # of buf (or big), the bytes counted against the listener's budget
        # A request larger than READ_BYTES is received into a buffer of its own size (receives
        # into buf grew it by a copy each, and its payload was copied out once more).
        self.big: bytearray | None = None
        self.big_at = 0  # of big, the bytes received
        self.last_seen = time.monotonic()
        self.is_paced = is_paced  # watched by the paced selector (its requests may wait)
        self.is_waiting = False  # a request of it waits in the loop's batch: serve nothing more yet
        self.events = selectors.EVENT_READ  # what its selector watches (WRITE too while out waits)


class FramedLoop:
    """Serves adopted connections with `server`'s checks and handlers (FramedServer's
    check_request, answer, run_one_way), its UNARY calls of `loop_methods` only; `release(key)`
    when one ends."""

    def __init__(self, server: Any, release: Callable[[object], None]) -> None:
        self._server = server
        self._limits: BulkLimits = server.limits
        self._release = release
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._paced = selectors.DefaultSelector()  # paced links; its fd is watched by _sel, or not
        self._adopted: list[_Link] = []
        self._links: dict[int, _Link] = {}
        self._lock = threading.Lock()
        self._is_stopping = False
        self._held = 0  # of the listener's budget (max_inflight_bytes), the bytes its links hold
        self.num_paced_turns = 0  # times the paced links that were ready were served together
        # Requests of the server's batched methods read this wake-up, answered together after it
        # (a beat's store write: one round trip for all); their links read nothing more till then.
        self._batch: list[_Call] = []
        self.num_batches = 0  # answer_batch calls
        # Requests answered off this thread (Offload), their replies handed back with a wake-up
        self._offloads: ThreadPoolExecutor | None = None
        self._answered: list[tuple[_Link, bytes | None]] = []
        self.num_offloaded = 0
        self._thread = threading.Thread(target=self._run, name="frame-loop", daemon=True)

    def start(self) -> FramedLoop:
        self._thread.start()
        return self

    def adopt(self, key: object, sock: socket.socket, buffered: bytes, is_paced: bool = False) -> None:
        """Serve `sock` from now on (`buffered`: what its thread had received and not read;
        `is_paced`: its last request may wait, is_pliable)."""
        sock.setblocking(False)
        with self._lock:
            if self._is_stopping:
                sock.close()
                self._release(key)
                return
            self._adopted.append(_Link(key, sock, buffered, is_paced))
        with contextlib.suppress(BlockingIOError):
            self._wake_w.send(b"\0")

    def stop(self) -> None:
        with self._lock:
            self._is_stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        if self._thread.is_alive():
            self._thread.join(5)
        if self._offloads is not None:
            self._offloads.shutdown(wait=False, cancel_futures=True)

    @property
    def num_links(self) -> int:
        return len(self._links)

    @property
    def num_paced(self) -> int:
        """Links served in turns now (their last request may wait)."""
        links = self._paced.get_map()
        return 0 if links is None else len(links)  # (None once stopped)

    def _run(self) -> None:
        name_os_thread()
        paced_fd = self._paced.fileno()
        self._sel.register(paced_fd, selectors.EVENT_READ, _PACED)
        is_armed = True  # paced_fd watched: a paced request after a quiet spell is served at once
        paced_at = float("-inf")  # when the paced links were served last
        due = 0.0  # (not armed) when they are served next
        now = time.monotonic()
        next_sweep = now + SWEEP_S
        try:
            while not self._is_stopping:
                timeout = SWEEP_S if is_armed else max(0.0, due - now)
                if self._batch:  # (held calls: wake when the first is due)
                    timeout = min(timeout, max(0.0, min(c.due for c in self._batch) - now))
                is_paced_ready = False
                for key, mask in self._sel.select(timeout):
                    link = key.data
                    if link is None:
                        self._take_adopted()
                    elif link is _PACED:
                        is_paced_ready = True
                    else:
                        self._ready(link, mask)
                now = time.monotonic()
                if is_paced_ready and now - paced_at < PACE_S:  # a stream: it waits for its turn
                    self._sel.unregister(paced_fd)
                    is_armed, due = False, paced_at + PACE_S
                elif is_paced_ready or (not is_armed and now >= due):
                    if self._serve_paced() or is_armed:
                        paced_at, due = now, now + PACE_S
                    else:  # quiet again: the next one is served as it comes
                        self._sel.register(paced_fd, selectors.EVENT_READ, _PACED)
                        is_armed = True
                while (method := self._due_method(now)) is not None:
                    self._answer_batch(method)
                if now >= next_sweep:
                    next_sweep = now + SWEEP_S
                    self._sweep(now)
        except Exception:  # a bug: every adopted connection ends (their clients reconnect)
            logger.exception("framed loop failed")
        finally:
            with self._lock:
                self._is_stopping = True
                adopted, self._adopted = self._adopted, []
            for link in [*self._links.values(), *adopted]:
                self._close(link)
            self._sel.close()
            self._paced.close()
            self._wake_r.close()
            self._wake_w.close()

    def _take_adopted(self) -> None:
        with contextlib.suppress(BlockingIOError):
            self._wake_r.recv(4096)
        with self._lock:
            adopted, self._adopted = self._adopted, []
            answered, self._answered = self._answered, []
        for link in adopted:
            self._links[link.sock.fileno()] = link
            self._selector(link).register(link.sock, link.events, link)
            if link.buf:
                self._serve(link)
        for link, reply in answered:
            if link.sock.fileno() < 0:
                continue  # (closed meanwhile)
            if reply is None:  # its handler failed (a bug, logged): as a failed request here
                self._close(link)
                continue
            link.out += reply
            link.is_waiting = False
            self._serve(link)

    def _offload(self, link: _Link, f: Frame, payload: bytes | memoryview) -> None:
        """Answer `f` on a pool thread; the link reads nothing more until its reply is back."""
        link.is_waiting = True
        self.num_offloaded += 1
        if self._offloads is None:
            self._offloads = ThreadPoolExecutor(OFFLOAD_THREADS, "frame-offload", name_os_thread)

        def run() -> None:
            reply: bytes | None = None
            try:
                reply = self._server.answer(f, payload)
            except BaseException:  # a bug: this link ends
                logger.exception("framed call of %s failed off the loop", f.text[:64])
            with self._lock:
                self._answered.append((link, reply))
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0")

        with contextlib.suppress(RuntimeError):  # stopping: every link closes with the loop
            self._offloads.submit(run)

    def _selector(self, link: _Link) -> selectors.BaseSelector:
        return self._paced if link.is_paced else self._sel

    def _serve_paced(self) -> int:
        """Serve the paced links that are ready; how many were."""
        ready = self._paced.select(0)
        for key, mask in ready:
            self._ready(key.data, mask)
        self.num_paced_turns += bool(ready)
        return len(ready)

    def _ready(self, link: _Link, mask: int) -> None:
        if mask & selectors.EVENT_READ:
            for _ in range(PACED_READS if link.is_paced else 1):  # (a paced link's bytes waited)
                if self._read(link) < READ_BYTES or link.is_waiting:  # (waiting: read no more)
                    break
        if mask & selectors.EVENT_WRITE and link.sock.fileno() >= 0:
            self._flush(link)

    def _read(self, link: _Link) -> int:
        """One receive, and the requests it completed served; the bytes it took. A large
        request being received takes its own bytes only (what follows stays in the socket)."""
        big, data = link.big, b""
        try:
            if big is None:
                n = len(data := link.sock.recv(READ_BYTES))
            else:
                with memoryview(big) as view:
                    n = link.sock.recv_into(view[link.big_at :])
        except BlockingIOError:
            return 0
        except OSError as exc:
            logger.info("framed connection dropped: %s", exc)
            self._close(link)
            return 0
        if not n:
            self._close(link)
            return 0
        link.last_seen = time.monotonic()
        if big is None:
            link.buf += data
            self._serve(link)
        else:
            link.big_at += n
            if link.big_at == len(big):  # whole: its call owns it now, as a connection thread's payload
                link.big, link.big_at = None, 0
                self._count(link, 0)
                self._serve(link, big)
        return n if link.sock.fileno() >= 0 else 0

    def _receive_whole(self, link: _Link, size: int) -> bool:
        """Receive the partial request in buf (`size` bytes in all) into a buffer of its own,
        counted against the budget from now; False when that closed the link."""
        if not self._count(link, size):
            return False
        buf = link.buf
        big = bytearray(size)
        big[: len(buf)] = buf
        link.big, link.big_at = big, len(buf)
        buf.clear()
        return True

    def _serve(self, link: _Link, whole: bytearray | None = None) -> None:
        """Answer every whole request in link.buf (after `whole`, a large one received into its
        own buffer), in order; keep a partial one's bytes."""
        if link.is_waiting:  # what it sends meanwhile waits in buf, within the budget
            for call in self._batch:  # a held call of it is answered now: its link has more to say
                if call.link is link:
                    call.due = 0.0
            self._hold(link)
            return
        buf, pos, pliable = link.buf, 0, link.is_paced
        head: tuple[Frame, int] | None = None
        try:
            while True:
                if whole is not None:  # (its header was checked as its first bytes came)
                    parsed = wire_frame.frame_at(whole)
                    assert parsed is not None
                    f, at = parsed
                    payload: bytes | memoryview = memoryview(whole)[at:]
                    whole = None
                else:
                    if (parsed := wire_frame.frame_at(buf, pos)) is None:
                        break
                    f, at = parsed
                    self._server.check_request(f)
                    if len(buf) - at < f.payload_len:
                        break
                    payload = bytes(buf[at : at + f.payload_len])
                    pos = at + f.payload_len
                if f.op != wire_frame.OP_PING:
                    pliable = is_pliable(f)
                if f.op == wire_frame.OP_NOTIFY:
                    self._server.run_one_way(f, payload)
                elif f.op == wire_frame.OP_UNARY and f.text in self._server.batches:
                    # (it may have waited a pacing period unread; `end` is the client's word: capped)
                    hold_s = min(f.end / 1e6, MAX_HOLD_S) - 2 * PACE_S
                    self._batch.append(
                        _Call(link, f, payload, link.last_seen + hold_s if hold_s > 0 else 0.0)
                    )
                    link.is_waiting = True
                    break  # (what follows waits for its answer: replies go in request order)
                elif f.op == wire_frame.OP_UNARY and f.text in self._server.loop_methods:
                    link.out += self._server.answer(f, payload)
                elif f.op == wire_frame.OP_UNARY:  # (this thread serves every node: nothing else)
                    served = ", ".join(sorted(self._server.loop_methods))
                    msg = f"framed port: {f.text[:64]!r} is not served on a node's link (it carries {served})"
                    link.out += error_frame(f.op, f.request_id, InvalidArgument(msg))[0].pack()
                else:  # PING
                    link.out += Frame(f.op, f.request_id).pack()
            # The next request's header, if whole, checked here too (a large one is sized by it);
            # after a batched call it is read once that call is answered (replies in order).
            if not link.is_waiting and (head := wire_frame.frame_at(buf, pos)) is not None:
                self._server.check_request(head[0])
        except Refused as exc:
            assert exc.error is not None
            link.out += error_frame(exc.frame.op, exc.frame.request_id, exc.error)[0].pack()
            self._flush(link)
            self._close(link)
            return
        except ProtocolError as exc:
            logger.info("framed connection dropped: %s", exc)
            self._flush(link)  # what it was answered before them, as its thread sends it
            self._close(link)
            return
        except Exception:  # a bug: drop this connection, keep serving the others
            logger.exception("framed connection failed")
            self._close(link)
            return
        del buf[:pos]
        if pliable != link.is_paced:  # its requests may wait now, or may not any more
            self._move(link)
        if not self._hold(link):
            return
        if not buf or link.is_waiting:  # (none while a call waits: a thread reads on after its answer)
            link.deadline = link.partial_at = 0.0
        else:
            size = head[0].payload_len if head is not None else 0
            if pos or not link.partial_at:  # a request's first bytes (after one served): from now
                link.partial_at = time.monotonic()
            lim = self._limits  # (its size counts once its header is whole)
            link.deadline = link.partial_at + lim.frame_timeout_s + size / lim.min_bytes_per_s
            whole_size = head[1] - pos + size if head is not None else 0  # (size 0 without a head)
            if size > READ_BYTES and not self._receive_whole(link, whole_size):
                return
        if link.out:
            self._flush(link)

    def _hold(self, link: _Link) -> bool:
        """Count a link's buffered bytes past one receive against the listener's budget (a
        large request arriving, or requests sent while an earlier one waits); False when that
        closed it."""
        return self._count(link, len(link.buf) if len(link.buf) > READ_BYTES else 0)

    def _count(self, link: _Link, size: int) -> bool:
        """The link holds `size` bytes of the listener's budget now (shared with its connection
        threads); False when there is not that much room, and the link closed."""
        more = size - link.held
        if more > 0:
            try:
                self._server.budget.take(more, "request")
            except CapacityExceeded as exc:
                logger.info("framed connection dropped: %s", exc)
                self._close(link)
                return False
        elif more < 0:
            self._server.budget.give(-more)
        self._held += more
        link.held = size
        return True

    def _due_method(self, now: float) -> str | None:
        """The method of the first batched call due by `now` (None: none is)."""
        for call in self._batch:
            if call.due <= now:
                return call.frame.text
        return None

    def _answer_batch(self, method: str) -> None:
        """Answer the waiting requests of one batched method together (held ones too), then
        serve what their links sent after them (which may wait for the next batch)."""
        calls = [c for c in self._batch if c.frame.text == method]
        self._batch = [c for c in self._batch if c.frame.text != method]
        try:
            replies = self._server.answer_batch([(c.frame, c.payload) for c in calls])
        except Exception:  # a bug: drop these connections, keep serving the others
            logger.exception("framed batch of %s failed", method)
            for c in calls:
                self._close(c.link)
            return
        self.num_batches += 1
        for c, reply in zip(calls, replies, strict=True):
            link, f, payload = c.link, c.frame, c.payload
            if link.sock.fileno() < 0:
                continue  # (closed meanwhile)
            if reply is None:  # it would wait here: from a thread (the link waits for it)
                self._offload(link, f, payload)
                continue
            link.out += reply
            link.is_waiting = False
            self._serve(link)

    def _flush(self, link: _Link) -> None:
        try:
            sent = link.sock.send(link.out)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            logger.info("framed connection dropped: %s", exc)
            self._close(link)
            return
        del link.out[:sent]
        if len(link.out) > MAX_UNSENT:
            logger.info("framed connection dropped: %d bytes of replies unread", len(link.out))
            self._close(link)
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if link.out else 0)
        if want != link.events and link.sock.fileno() >= 0:
            self._selector(link).modify(link.sock, want, link)
            link.events = want

    def _move(self, link: _Link) -> None:
        """The link from one selector to the other (paced or served as its bytes come)."""
        self._selector(link).unregister(link.sock)
        link.is_paced = not link.is_paced
        self._selector(link).register(link.sock, link.events, link)

    def _sweep(self, now: float) -> None:
        idle = self._limits.idle_timeout_s
        for link in list(self._links.values()):
            if link.deadline and now > link.deadline:
                logger.info("framed connection dropped: a request not all there within its deadline")
                self._close(link)
            elif now - link.last_seen > idle:
                self._close(link)

    def _close(self, link: _Link) -> None:
        fd = link.sock.fileno()
        if fd < 0:
            return
        if self._links.pop(fd, None) is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector(link).unregister(link.sock)
        self._server.budget.give(link.held)
        self._held -= link.held
        link.held = 0
        link.sock.close()
        self._release(link.key)


def is_pliable(f: Frame) -> bool:
    """Whether a request lets a paced link serve it up to PACE_S late (its `end`)."""
    return f.end >= PACE_US

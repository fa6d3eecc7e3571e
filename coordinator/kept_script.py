"""KeptScripts: the per-request Lua scripts sent on connections kept for them.

redis-py's `Script(...)` call goes through `Redis.execute_command`: a pool checkout
(a lock and a poll of the socket), a retry closure, the client's observability
hooks, then the pool release; on this host that was ~70 us of an open's ~150 us
script call when Redis itself ran the script in ~45 us. Here the same EVALSHA is
packed and sent on a redis-py connection taken from the client's pool once and
kept in a LIFO for the next caller: the connection still does the handshake (AUTH,
SELECT, HELLO), the timeouts and the error mapping, and the client's `Retry` still
applies (the one retry layer): a connection or timeout error disconnects it and the
call is sent again. A script Redis no longer has (NOSCRIPT, after a restart or a
SCRIPT FLUSH) is loaded again and the call sent once more, as redis-py's Script does.
run_many pipelines several calls the same way (one write, the replies read in order).

Errors are redis-py's own (`redis.ConnectionError`, `redis.ResponseError`, ...): the
store translates them as it does every other call.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import hiredis
import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError, ResponseError

MAX_IDLE = 16  # kept connections beyond this go back to the pool


def _pack(script: Script, args: list[Any]) -> bytes:
    """EVALSHA of `script` with no keys, in RESP: hiredis's packer in C, ~3 us for an open's
    arguments where redis-py's (an encoder call per argument, then the same packer) took ~11.
    str, bytes, int and float encode as redis-py's would (str as UTF-8); a bytearray as its bytes."""
    try:
        return hiredis.pack_command(("EVALSHA", script.sha, 0, *args))  # type: ignore[no-any-return]
    except TypeError:
        pass  # a bytearray (redis-py sends its bytes), or what redis takes nowhere
    if any(isinstance(a, bool) for a in args):
        raise redis.DataError("a script argument redis cannot take: a bool")
    flat: list[Any] = [bytes(a) if isinstance(a, bytearray) else a for a in args]
    try:
        return hiredis.pack_command(("EVALSHA", script.sha, 0, *flat))  # type: ignore[no-any-return]
    except TypeError as e:
        raise redis.DataError(f"a script argument redis cannot take: {e}") from e


class KeptScripts:
    """Runs registered scripts on kept connections of `client`'s pool; thread-safe."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._pool = client.connection_pool
        self._idle: list[Any] = []  # LIFO: the most recently used connection is the warmest
        self._lock = threading.Lock()
        self._is_closed = False
        self._pid = os.getpid()

    def run(self, script: Script, args: list[Any]) -> Any:
        """EVALSHA `script` with no keys and `args`; its reply as redis-py returns it."""
        return self._on_kept_connection(lambda conn: self._evalsha(conn, script, args))

    def run_many(self, calls: Sequence[tuple[Script, list[Any]]]) -> list[Any]:
        """EVALSHA each (script, args) with no keys, every call sent in one write and the replies
        read in order: one round trip. Redis runs them in order, others' commands possibly in
        between. A call answered NOSCRIPT ran nothing: its script is loaded and it is sent again
        after the rest; a connection error sends them all again (the client's Retry). So the
        calls must be safe to reorder so and to repeat (apply_event_runs's check their own
        order and are idempotent). A script error raises once every reply is read."""
        if not calls:
            return []
        return self._on_kept_connection(lambda conn: self._evalsha_many(conn, calls))

    def _on_kept_connection(self, send: Callable[[Any], Any]) -> Any:
        if self._pid != os.getpid():  # a forked child: the kept sockets are the parent's
            self._pid, self._idle = os.getpid(), []
        try:
            conn = self._idle.pop()  # atomic under the GIL
        except IndexError:
            conn = self._pool.get_connection()
        try:
            reply = conn.retry.call_with_retry(lambda: send(conn), lambda _error: conn.disconnect())
        except ResponseError:  # the reply was read whole: the connection is clean
            self._give_back(conn)
            raise
        except BaseException:  # anything else may leave a reply unread on it
            conn.disconnect()
            self._pool.release(conn)
            raise
        self._give_back(conn)
        return reply

    def _evalsha(self, conn: Any, script: Script, args: list[Any]) -> Any:
        conn.send_packed_command([_pack(script, args)], check_health=False)
        try:
            return conn.read_response()
        except NoScriptError:
            script.sha = self._client.script_load(script.script)
            conn.send_packed_command([_pack(script, args)], check_health=False)
            return conn.read_response()

    def _evalsha_many(self, conn: Any, calls: Sequence[tuple[Script, list[Any]]]) -> list[Any]:
        replies = self._send_many(conn, calls)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            for script in {id(calls[i][0]): calls[i][0] for i in missing}.values():
                script.sha = self._client.script_load(script.script)
            again = self._send_many(conn, [calls[i] for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        for reply in replies:
            if isinstance(reply, ResponseError):
                raise reply
        return replies

    @staticmethod
    def _send_many(conn: Any, calls: Sequence[tuple[Script, list[Any]]]) -> list[Any]:
        """The calls' replies in order, an error reply as its exception (every reply is read)."""
        packed = b"".join(_pack(script, args) for script, args in calls)
        conn.send_packed_command([packed], check_health=False)
        replies: list[Any] = []
        for _ in calls:
            try:
                replies.append(conn.read_response())
            except ResponseError as e:
                replies.append(e)
        return replies

    def _give_back(self, conn: Any) -> None:
        with self._lock:
            if not self._is_closed and len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        self._pool.release(conn)

    def close(self) -> None:
        """Hand every kept connection back to the pool (which the store then disconnects)."""
        with self._lock:
            self._is_closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            self._pool.release(conn)

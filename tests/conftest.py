"""Shared fixtures: a real redis-server on a free port, started and stopped by the tests.

Tests never depend on a server left running (DESIGN.md): `redis_server` starts
its own (no persistence) for the session, `redis_url` flushes it before each
test, and `redis_server.stop()` / `.start()` simulate an outage on the same port.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from pagedkv.process_env import freeze_at_exit

freeze_at_exit()  # the test process, torch loaded, exits in a second rather than several


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A redis-server subprocess on a fixed port; stop() and start() keep the port."""

    def __init__(self, binary: str, port: int) -> None:
        self.binary = binary
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> None:
        if self.is_running:
            return
        self._proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode} on port {self.port}")
            if self._ping():
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer PING on port {self.port} within {timeout_s}s")

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.send_signal(signal.SIGCONT)  # in case a test paused it
        self._proc.kill()
        self._proc.wait(timeout=10)
        self._proc = None

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open, nothing answers."""
        assert self._proc is not None, "server is not running"
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None, "server is not running"
        self._proc.send_signal(signal.SIGCONT)

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def flushall(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(b"FLUSHALL\r\n")
            assert s.recv(16).startswith(b"+OK")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not on the PATH (install redis to run the Redis-backed tests)")
    server = RedisServer(binary, free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server's URL, running (restarted if a test stopped it) and empty."""
    redis_server.start()
    redis_server.flushall()
    return redis_server.url

"""A real Redis Cluster on loopback for the contract suite: three masters, no replicas.

`redis_cluster` starts three `redis-server --cluster-enabled yes` on free ports, joins them
with `redis-cli --cluster create ... --cluster-replicas 0 --cluster-yes` and waits until each
says cluster_state:ok (about a second); `redis_cluster_url` empties every master before a
test and names the cluster as ClusterStore reads it (redis+cluster://host:port,...).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

MASTERS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _command(port: int, *words: str) -> bytes:
    """One inline command to 127.0.0.1:port; the raw reply (enough for +OK and bulk INFO)."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(" ".join(words).encode() + b"\r\n")
        reply = s.recv(65536)
        if reply.startswith(b"$"):  # a bulk string: read it whole
            size = int(reply[1 : reply.index(b"\r\n")])
            while len(reply) < reply.index(b"\r\n") + 2 + size:
                reply += s.recv(65536)
        return reply


class RedisCluster:
    """Three cluster-enabled redis-server processes, joined; stop() ends them."""

    def __init__(self, server: str, cli: str, workdir: Path) -> None:
        self.ports = [free_port() for _ in range(MASTERS)]
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)
        self._procs: list[subprocess.Popen[bytes]] = []
        for port in self.ports:
            args = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
            # The bus port is the port + 10,000 unless named: a free port above 55,535 has none.
            args += [
                "--cluster-port",
                str(free_port()),
                "--dir",
                str(workdir),
                "--cluster-node-timeout",
                "5000",
            ]
            self._procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self._wait(lambda p: _command(p, "PING").startswith(b"+PONG"), "answer PING")
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        created = subprocess.run(
            [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            timeout=60,
        )
        if created.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout[-500:]!r}")
        self._wait(lambda p: b"cluster_state:ok" in _command(p, "CLUSTER", "INFO"), "reach cluster_state:ok")

    def _wait(self, ready: object, what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        for port in self.ports:
            while True:
                try:
                    if ready(port):  # type: ignore[operator]
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis cluster node on port {port} did not {what} in {timeout_s}s")
                time.sleep(0.05)

    def flushall(self) -> None:
        for port in self.ports:
            assert _command(port, "FLUSHALL").startswith(b"+OK")

    def stop(self) -> None:
        for proc in self._procs:
            proc.send_signal(signal.SIGKILL)
        for proc in self._procs:
            proc.wait(timeout=10)
        self._procs = []


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        pytest.skip("redis-server and redis-cli must be on the PATH to start a Redis Cluster")
    with tempfile.TemporaryDirectory(prefix="pagedkv-cluster-") as workdir:
        cluster = RedisCluster(server, cli, Path(workdir))
        try:
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture
def redis_cluster_url(redis_cluster: RedisCluster) -> str:
    """The session cluster's URL, every master empty."""
    redis_cluster.flushall()
    return redis_cluster.url

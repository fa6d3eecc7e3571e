"""A Redis primary, a replica and three sentinels on loopback, as processes (redis-server
--sentinel): what ChaosCluster's store is for the failover experiment. Same surface as
harness.Redis (start, kill, url, client), where kill() takes everything down and
kill_primary() is the fault."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import redis
from harness import wait_pong
from redis.sentinel import Sentinel

from pagedkv.cluster import free_port

MASTER = "pkv"


class SentinelRedis:
    def __init__(self, workdir: Path) -> None:
        self.dir = workdir / "sentinel"
        self.dir.mkdir(parents=True)
        self.ports = {"primary": free_port(), "replica": free_port()}
        self.sentinel_ports = [free_port() for _ in range(3)]
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        self.url = f"redis+sentinel://{hosts}/{MASTER}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _spawn(self, name: str, args: list[str], port: int) -> None:
        log = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the process
        self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        wait_pong(port)

    def start(self) -> None:
        base = ["redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        primary, replica = self.ports["primary"], self.ports["replica"]
        self._spawn("primary", [*base, "--port", str(primary), "--dir", str(self.dir)], primary)
        replica_args = [*base, "--port", str(replica), "--dir", str(self.dir)]
        self._spawn("replica", [*replica_args, "--replicaof", "127.0.0.1", str(primary)], replica)
        for i, port in enumerate(self.sentinel_ports):
            conf = self.dir / f"sentinel-{i}.conf"  # a sentinel rewrites its own file
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.dir}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n"
                f"sentinel down-after-milliseconds {MASTER} 1000\n"
                f"sentinel failover-timeout {MASTER} 4000\n"
                f"sentinel parallel-syncs {MASTER} 1\n"
            )
            self._spawn(f"sentinel-{i}", ["redis-server", str(conf), "--sentinel"], port)
        self.wait_replicated()

    def wait_replicated(self, timeout_s: float = 10.0) -> None:
        """Until the replica is in sync with the primary and every sentinel knows it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            r = redis.Redis(port=self.ports["replica"])
            try:
                info = r.info("replication")
                known = all(self._sentinel(p).sentinel_slaves(MASTER) for p in self.sentinel_ports)
            except redis.RedisError:
                known, info = False, {}
            finally:
                r.close()
            if info.get("master_link_status") == "up" and known:
                return
            time.sleep(0.1)
        raise RuntimeError("the replica did not sync, or the sentinels do not see it")

    def _sentinel(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=1)

    def primary_port(self) -> int:
        host, port = Sentinel([("127.0.0.1", p) for p in self.sentinel_ports]).discover_master(MASTER)
        return int(port)

    def kill_primary(self) -> int:
        """SIGKILL the current primary; returns its port."""
        port = self.primary_port()
        name = next(n for n, p in self.ports.items() if p == port)
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(10)
        return port

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.primary_port())

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

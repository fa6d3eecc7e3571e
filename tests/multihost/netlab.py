"""A throwaway virtual network on one Linux machine: a bridge in the root
namespace and one network namespace per "host", each with a veth to the bridge
and an address in a private /24 that the lab picks itself (10.213.X.0/24, X
random and unused on this machine). The root namespace gets the bridge's own
address (.1), so the test process can talk to every host over the bridge.

Names carry the creating process id (namespaces `pkv-<pid>-<tag>-<role>`; links
`pkv<tag>...` with the alias `pkv-owner-<pid>`), so a new lab deletes what a
dead run left behind and never touches a live parallel run's network.

Everything here shells out to iproute2 (`ip`) and needs root.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

NS_PREFIX = "pkv-"
LINK_PREFIX = "pkv"
OWNER_ALIAS = "pkv-owner-"
SUBNET_PREFIX = "10.213"
# Never let a proxy from the environment capture gRPC / Redis traffic to the lab.
PROXY_VARS = (
    "http_proxy",
    "https_proxy",
    "grpc_proxy",
    "all_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "GRPC_PROXY",
    "ALL_PROXY",
)


def ip(*args: str, check: bool = True, timeout_s: float = 10.0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout_s)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def probe() -> str | None:
    """Why the lab cannot run here, or None when it can (tries a namespace and a veth)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root (ip netns, veth pairs, a bridge)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not on the PATH"
    if shutil.which("redis-server") is None:
        return "redis-server is not on the PATH"
    tag = secrets.token_hex(3)
    ns, veth = f"{NS_PREFIX}{os.getpid()}-{tag}-probe", f"{LINK_PREFIX}p{tag}"
    try:
        done = ip("netns", "add", ns, check=False)
        if done.returncode != 0:
            return f"`ip netns add` is not available: {done.stderr.strip()}"
        done = ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns, check=False)
        if done.returncode != 0:
            return f"cannot create a veth pair: {done.stderr.strip()}"
        done = ip("netns", "exec", ns, "ip", "link", "set", "lo", "up", check=False)
        if done.returncode != 0:
            return f"`ip netns exec` does not work here: {done.stderr.strip()}"
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`ip` failed: {exc}"
    finally:
        with contextlib.suppress(Exception):
            ip("link", "del", veth, check=False)
            ip("netns", "del", ns, check=False)


def _ns_pids(ns: str) -> list[int]:
    done = ip("netns", "pids", ns, check=False)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _delete_ns(ns: str) -> None:
    # Only processes inside our own namespace: nothing else can be there.
    for pid in _ns_pids(ns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    ip("netns", "del", ns, check=False)


def clean_leftovers() -> list[str]:
    """Delete namespaces and links of labs whose creating process is gone."""
    removed = []
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        owner = parts[1] if len(parts) >= 3 else ""
        if name.startswith(NS_PREFIX) and owner.isdigit() and not _alive(int(owner)):
            _delete_ns(name)
            removed.append(name)
    links = json.loads(ip("-j", "link", "show", check=False).stdout or "[]")
    for link in links:
        name, alias = link.get("ifname", ""), link.get("ifalias", "")
        if name.startswith(LINK_PREFIX) and alias.startswith(OWNER_ALIAS):
            owner = alias[len(OWNER_ALIAS) :]
            if owner.isdigit() and not _alive(int(owner)):
                ip("link", "del", name, check=False)
                removed.append(name)
    return removed


def _free_subnet() -> str:
    """A 10.213.X prefix that no address or route on this machine uses."""
    used = ip("-4", "addr", "show", check=False).stdout + ip("-4", "route", "show", check=False).stdout
    for _ in range(200):
        prefix = f"{SUBNET_PREFIX}.{secrets.randbelow(250) + 2}"
        if f"{prefix}." not in used:
            return prefix
    raise RuntimeError("no free 10.213.X.0/24 subnet")


@dataclass
class Host:
    role: str
    ns: str
    addr: str
    veth: str  # the root-namespace (bridge) end


@dataclass
class NetLab:
    roles: list[str]
    log_dir: Path
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    hosts: dict[str, Host] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    bridge: str = ""
    gateway: str = ""

    def up(self) -> NetLab:
        clean_leftovers()
        alias = f"{OWNER_ALIAS}{os.getpid()}"
        prefix = _free_subnet()
        self.bridge, self.gateway = f"{LINK_PREFIX}br{self.tag}", f"{prefix}.1"
        ip("link", "add", self.bridge, "type", "bridge")
        ip("link", "set", self.bridge, "alias", alias)
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, role in enumerate(self.roles):
            host = Host(
                role,
                f"{NS_PREFIX}{os.getpid()}-{self.tag}-{role}",
                f"{prefix}.{i + 2}",
                f"{LINK_PREFIX}{self.tag}v{i}",
            )
            self.hosts[role] = host
            ip("netns", "add", host.ns)
            ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
            ip("link", "set", host.veth, "alias", alias)
            ip("link", "set", host.veth, "master", self.bridge)
            ip("link", "set", host.veth, "up")
            ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            ip("-n", host.ns, "link", "set", "eth0", "up")
            ip("-n", host.ns, "link", "set", "lo", "up")
        return self

    def down(self) -> None:
        """Kill every process, delete namespaces (their veths go with them) and the bridge."""
        for name in list(self.procs):
            self.kill(name)
        for host in self.hosts.values():
            _delete_ns(host.ns)
            ip("link", "del", host.veth, check=False)  # gone already unless the ns move failed
        if self.bridge:
            ip("link", "del", self.bridge, check=False)

    # -- links ----------------------------------------------------------------

    def cut(self, role: str) -> None:
        """Pull the host's cable: its bridge port goes down (the host sees NO-CARRIER)."""
        ip("link", "set", self.hosts[role].veth, "down")

    def restore(self, role: str) -> None:
        ip("link", "set", self.hosts[role].veth, "up")

    # -- processes ------------------------------------------------------------

    @staticmethod
    def env() -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS}
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def exec_args(self, role: str, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[role].ns, *args]

    def spawn(self, name: str, role: str, args: list[str], pipes: bool = False) -> subprocess.Popen[bytes]:
        """A long-running process on a host (`ip netns exec` execs it: same pid), its output
        (stderr only, with pipes=True: then stdin and stdout are pipes) logged to name.log."""
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the process
        proc = subprocess.Popen(
            self.exec_args(role, args),
            env=self.env(),
            start_new_session=True,
            stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipes else log,
            stderr=log,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def run(self, role: str, args: list[str], timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """A short command on a host, waited for."""
        return subprocess.run(
            self.exec_args(role, args), capture_output=True, text=True, timeout=timeout_s, env=self.env()
        )

    def kill(self, name: str, sig: int = signal.SIGKILL, timeout_s: float = 10.0) -> None:
        proc = self.procs.get(name)
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def log_tail(self, name: str, n: int = 3000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""


def wait_tcp(addr: str, port: int, timeout_s: float, send: bytes = b"", expect: bytes = b"") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((addr, port), timeout=0.5) as s:
            if not send:
                return
            s.sendall(send)
            if s.recv(64).startswith(expect):
                return
        time.sleep(0.05)
    raise TimeoutError(f"{addr}:{port} did not answer within {timeout_s}s")

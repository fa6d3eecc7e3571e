"""pagedkv across real (virtual) hosts on one machine.

Each role runs in its own Linux network namespace -- Redis, the coordinator,
two cache nodes and two worker "hosts" -- with a veth to one bridge and an
address in a private test subnet (netlab.py). Nothing listens on 127.0.0.1:
every call crosses the virtual network, so advertised addresses, binds, a
pulled cable and a coordinator restart are exercised as on separate machines.

The test process stays in the root namespace and owns the bridge's address
(.1), so it makes its own client calls (stats, lookups, sequence handles)
over the bridge like any other host; worker processes run inside the worker
namespaces (`ip netns exec`): one long-lived process per worker host
(worker_loop.py) runs tests/cluster/worker.py's checks for each request.

Needs root and iproute2 (`ip netns`); the module skips otherwise. Leases are
3 s (heartbeat 1.5 s): a cut-off node must vanish from Stats within 2x the
lease plus a margin for a loaded 2-core machine.
"""

from __future__ import annotations

import importlib.util
import json
import select
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from netlab import PROXY_VARS, NetLab, probe, wait_tcp  # tests/multihost is on sys.path (rootdir import mode)

from pagedkv.client import CacheClient, FailedPrecondition, Unavailable
from pagedkv.health import check as health_check
from pagedkv.protos.errors import PagedKVError

_reason = probe()
if _reason is not None:
    pytest.skip(f"multi-host tests skipped: {_reason}", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "cluster" / "worker.py"
WORKER_LOOP = Path(__file__).resolve().parent / "worker_loop.py"
_spec = importlib.util.spec_from_file_location("pagedkv_cluster_worker", WORKER)
assert _spec is not None and _spec.loader is not None
_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_worker)
SPEC, expected_kv = _worker.SPEC, _worker.expected_kv

TOKEN = "token-alpha"
LEASE_TTL_S = 3.0
REDIS_PORT, COORD_PORT, NODE_PORT = 6379, 50050, 50051
ROLES = ["redis", "coord", "node0", "node1", "worker-a", "worker-b"]
NODE_ARGS = [
    "--num-layers=2",
    "--num-kv-heads=2",
    "--head-dim=32",
    "--dtype=float32",
    "--block-size=16",
    "--num-blocks=256",
    "--host-blocks=64",
]

SYSTEM = list(range(1000, 1000 + 96))  # six full blocks, one prompt per scenario
SYSTEM_RESTART = list(range(3000, 3000 + 64))
SYSTEM_CUT = list(range(5000, 5000 + 80))
OTHER = list(range(8000, 8000 + 40))


def wait_until(predicate, timeout_s: float, what: str) -> float:
    """Seconds until predicate() is true; fails the test after timeout_s."""
    start = time.monotonic()
    last_exc: Exception | None = None
    while time.monotonic() - start < timeout_s:
        try:
            if predicate():
                return time.monotonic() - start
        except PagedKVError as exc:  # a call the predicate makes may fail while things settle
            last_exc = exc
        time.sleep(0.1)
    raise AssertionError(f"{what} not within {timeout_s}s (last error: {last_exc})")


class MultiHostCluster:
    def __init__(self, lab: NetLab, tmp: Path) -> None:
        self.lab = lab
        self.tenants = tmp / "tenants.json"
        self.tenants.write_text(json.dumps({"tokens": {TOKEN: "alpha"}, "quotas": {}}))
        self.redis_addr = lab.hosts["redis"].addr
        self.coordinator = f"{lab.hosts['coord'].addr}:{COORD_PORT}"
        self.nodes = {f"node-{i}": f"{lab.hosts[f'node{i}'].addr}:{NODE_PORT}" for i in range(2)}

    def start(self) -> MultiHostCluster:
        redis = [
            "redis-server",
            "--bind",
            self.redis_addr,
            "--port",
            str(REDIS_PORT),
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
        ]
        self.lab.spawn("redis", "redis", redis)
        wait_tcp(self.redis_addr, REDIS_PORT, 15.0, b"PING\r\n", b"+PONG")
        # The root namespace talks to the hosts from the bridge's own address; host to host
        # traffic is bridged, which br_netfilter with an iptables FORWARD policy of DROP
        # (e.g. a Docker host) blocks: say so instead of timing out later.
        target = f"{self.redis_addr}:{REDIS_PORT}"
        if not _can_connect(self.lab, "worker-a", target)[target]:
            pytest.skip(
                "traffic between namespaces over the bridge is blocked on this machine "
                "(br_netfilter with an iptables FORWARD policy of DROP?)"
            )
        self.start_coordinator()
        for i in range(2):  # nodes and workers import torch at once; wait for them together
            self.spawn_node(i)
        self.spawn_workers()
        for name, address in self.nodes.items():
            self.wait_healthy(name, address)
        self.wait_nodes(2, 30.0)
        self.wait_workers()
        return self

    def start_coordinator(self) -> None:
        self.lab.spawn(
            "coordinator",
            "coord",
            [
                sys.executable,
                "-m",
                "pagedkv",
                "coordinator",
                "--listen",
                self.coordinator,
                "--redis",
                f"redis://{self.redis_addr}:{REDIS_PORT}/0",
                f"--lease-ttl-s={LEASE_TTL_S}",
                "--tenants",
                str(self.tenants),
            ],
        )
        self.wait_healthy("coordinator", self.coordinator)

    def spawn_node(self, i: int) -> None:
        address = self.nodes[f"node-{i}"]
        self.lab.spawn(
            f"node-{i}",
            f"node{i}",
            [
                sys.executable,
                "-m",
                "pagedkv",
                "node",
                "--listen",
                address,
                "--advertise",
                address,
                "--node-id",
                f"node-{i}",
                "--coordinator",
                self.coordinator,
                "--metrics-port",
                "-1",
                *NODE_ARGS,
            ],
        )

    def wait_healthy(self, name: str, address: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc = self.lab.procs[name]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.lab.log_tail(name)}")
            if health_check(address, timeout_s=1.0) == "SERVING":
                return
            time.sleep(0.1)
        raise TimeoutError(f"{name} at {address} not healthy within {timeout_s}s:\n{self.lab.log_tail(name)}")

    def client(self) -> CacheClient:
        return CacheClient(coordinator=self.coordinator, token=TOKEN, spec=SPEC)

    def live_nodes(self) -> dict[str, str]:
        with self.client() as c:
            return {n.node_id: n.address for n in c.cluster_stats(timeout_s=3).nodes}

    def wait_nodes(self, n: int, timeout_s: float) -> float:
        return wait_until(lambda: len(self.live_nodes()) == n, timeout_s, f"{n} live nodes in Stats")

    def spawn_workers(self) -> None:
        """One long-lived worker process per worker host (worker_loop.py): torch is imported
        once, while the nodes start, not once per scenario."""
        for role in ("worker-a", "worker-b"):
            self.lab.spawn(
                role, role, [sys.executable, str(WORKER_LOOP), self.coordinator, TOKEN], pipes=True
            )

    def _read_line(self, role: str, timeout_s: float) -> dict:
        proc = self.lab.procs[role]
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else b""
        if not line:
            why = f"exited with {proc.poll()}" if proc.poll() is not None else f"silent for {timeout_s}s"
            raise AssertionError(f"worker on {role} {why}:\n{self.lab.log_tail(role)}")
        return json.loads(line)

    def wait_workers(self, timeout_s: float = 90.0) -> None:
        for role in ("worker-a", "worker-b"):
            assert self._read_line(role, timeout_s) == {"ready": True}

    def worker(self, role: str, seq_id: str, prompt: list[int], keep: bool = False) -> dict:
        """tests/cluster/worker.py's scenario on a worker host: open, append, attend, check."""
        proc = self.lab.procs[role]
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"seq_id": seq_id, "prompt": prompt, "keep": keep}).encode() + b"\n")
        proc.stdin.flush()
        reply = self._read_line(role, 60.0)
        assert "error" not in reply, f"worker {seq_id} on {role} failed:\n{reply['error']}"
        return reply


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    net = NetLab(ROLES, tmp_path_factory.mktemp("multihost"))
    with pytest.MonkeyPatch.context() as mp:
        for var in PROXY_VARS:  # this process's gRPC calls to the lab must not go to a proxy
            mp.delenv(var, raising=False)
        try:
            net.up()
            yield net
        finally:
            net.down()


@pytest.fixture(scope="module")
def cluster(lab):
    c = MultiHostCluster(lab, lab.log_dir)
    # lab.down() kills every process even if start() fails half way.
    yield c.start()


@pytest.fixture
def healthy(cluster):
    """Every scenario starts from a full cluster (the previous one may have cut a link)."""
    cluster.wait_nodes(2, 40.0)
    return cluster


def _lost_error(c: CacheClient, seq_id: str, timeout_s: float) -> FailedPrecondition:
    """The FailedPrecondition that describing seq_id raises once the reaper removed its node."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = c.sequence(seq_id, timeout_s=3)
        except FailedPrecondition as exc:
            return exc
        except PagedKVError as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"{seq_id} not reported lost within {timeout_s}s (last: {last!r})")


def _established_peers(lab: NetLab, role: str, port: int) -> set[str]:
    done = lab.run(role, ["ss", "-Htn", "state", "established", f"( sport = :{port} )"], timeout_s=10)
    assert done.returncode == 0, done.stderr
    peers = (line.split()[-1].rsplit(":", 1)[0] for line in done.stdout.splitlines() if line.strip())
    return {p.strip("[]").removeprefix("::ffff:") for p in peers}  # gRPC listens dual-stack


_CONNECT = """
import json, socket, sys
out = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        out[target] = True
    except OSError:
        out[target] = False
print(json.dumps(out))
"""


def _can_connect(lab: NetLab, role: str, *targets: str) -> dict[str, bool]:
    done = lab.run(role, [sys.executable, "-c", _CONNECT, *targets], timeout_s=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_traffic_crosses_the_virtual_network(healthy):
    lab, c = healthy.lab, healthy
    # The coordinator knows the nodes by their namespace addresses, not loopback.
    assert healthy.live_nodes() == c.nodes
    assert all(not a.startswith("127.") for a in c.nodes.values())
    # Hosts are separate: nothing of another host is reachable over 127.0.0.1 ...
    loopback = [f"127.0.0.1:{COORD_PORT}", f"127.0.0.1:{REDIS_PORT}", f"127.0.0.1:{NODE_PORT}"]
    assert _can_connect(lab, "worker-a", *loopback, c.coordinator) == {
        **dict.fromkeys(loopback, False),
        c.coordinator: True,  # ... while the same service answers on its own address
    }
    assert _can_connect(lab, "node0", f"127.0.0.1:{COORD_PORT}", f"127.0.0.1:{REDIS_PORT}") == {
        f"127.0.0.1:{COORD_PORT}": False,
        f"127.0.0.1:{REDIS_PORT}": False,
    }
    # ... and the live connections are between namespace addresses.
    node_addrs = {lab.hosts["node0"].addr, lab.hosts["node1"].addr}
    assert node_addrs <= _established_peers(lab, "coord", COORD_PORT)
    assert lab.hosts["coord"].addr in _established_peers(lab, "redis", REDIS_PORT)


def test_workers_on_different_hosts_share_a_system_prompt(healthy):
    first = healthy.worker("worker-a", "mh-a", SYSTEM + [1, 2, 3])
    assert first["cached"] == 0 and first["max_rel_err"] < 1e-5, first
    with healthy.client() as c:  # the node reports new blocks within ~10 ms
        wait_until(lambda: c.lookup(SYSTEM + [5]) == len(SYSTEM), 10.0, "the prefix in the index")
    second = healthy.worker("worker-b", "mh-b", SYSTEM + [9, 9, 9, 9])
    assert second["cached"] == len(SYSTEM), second  # six whole blocks from worker A's KV
    assert second["node"] == first["node"]  # placement followed the prefix
    assert second["reused_ok"] and second["max_rel_err"] < 1e-5, second


def test_coordinator_host_restart_recovers_state_from_redis(healthy):
    lab = healthy.lab
    prompt = SYSTEM_RESTART + [3]
    first = healthy.worker("worker-a", "mh-long", prompt, keep=True)
    assert first["cached"] == 0
    with healthy.client() as c:
        wait_until(lambda: c.lookup(prompt) == len(SYSTEM_RESTART), 10.0, "the prefix in the index")
        lab.kill("coordinator", signal.SIGKILL)
        with pytest.raises(Unavailable):
            c.lookup(prompt, timeout_s=3)
        healthy.start_coordinator()  # same host, same address, same Redis
        # The leases lapsed while it was down: wait for both nodes to beat again (an open
        # racing that can fail with FAILED_PRECONDITION "node is not live", see the report).
        healthy.wait_nodes(2, 20.0)
        wait_until(lambda: c.lookup(prompt, timeout_s=3) == len(SYSTEM_RESTART), 20.0, "lookup after restart")
        seq = c.sequence("mh-long")  # found by id: the page table came back from Redis
        assert seq.route.node_id == first["node"]
        assert seq.route.address == healthy.nodes[first["node"]]
        k, v = expected_kv(prompt + [7])  # the worker's prompt and its decoded token
        got: list[torch.Tensor] = []

        def read() -> bool:
            got[:] = seq.read_kv()
            return True

        # The coordinator can record a node's beat a moment before the node reads the answer and
        # proves its lease again; until then its data calls say Unavailable (retry).
        wait_until(read, 20.0, "the node serving its K/V again")
        assert torch.equal(got[0], k) and torch.equal(got[1], v)
        hit = healthy.worker("worker-b", "mh-hit", SYSTEM_RESTART + [4])
        assert hit["cached"] == len(SYSTEM_RESTART) and hit["node"] == first["node"], hit
        assert hit["reused_ok"] and hit["max_rel_err"] < 1e-5, hit
        seq.close()


def test_cut_off_node_host_is_detected_and_rejoins_empty(healthy):
    lab = healthy.lab
    prompt = SYSTEM_CUT + [1]
    with healthy.client() as c:
        seq = c.open("mh-cut", prompt)
        seq.append(prompt, *expected_kv(prompt))
        victim = seq.route.node_id
        survivor = next(n for n in healthy.nodes if n != victim)
        role = f"node{victim[-1]}"
        wait_until(lambda: c.lookup(prompt) == len(SYSTEM_CUT), 10.0, "the prefix in the index")
        assert c.node_stats(seq.route.address).counters["used_blocks"] > 0

        reaped = _reaped(c)
        lab.cut(role)
        try:
            detected = wait_until(
                lambda: set(healthy.live_nodes()) == {survivor},
                2 * LEASE_TTL_S + 6,
                "the cut-off node leaving Stats",
            )
            assert detected <= 2 * LEASE_TTL_S + 6
            # Declared dead (liveness.py: a grace of half a lease, then a failed probe).
            wait_until(lambda: _reaped(c) > reaped, LEASE_TTL_S + 6, "the cut-off node declared dead")
            # Its sequences are lost, and the error names the node.
            lost = _lost_error(c, "mh-cut", 10.0)
            assert victim in str(lost) and "lost" in str(lost), lost
            # Data calls to the unreachable host fail within their deadline.
            with pytest.raises(PagedKVError):
                seq.attend(0, torch.zeros(4, SPEC.head_dim), timeout_s=2)
            # New opens go to the survivor, even for the prefix the victim held.
            same = c.open("mh-same-prefix", SYSTEM_CUT + [2])
            assert same.route.node_id == survivor and same.num_cached_tokens == 0
            same.close()  # nothing appended: no block of SYSTEM_CUT cached anywhere
            other = c.open("mh-during-cut", OTHER)  # and the survivor keeps serving data calls
            assert other.route.node_id == survivor
            other.append(OTHER, *expected_kv(OTHER))
            assert torch.equal(other.read_kv()[0], expected_kv(OTHER)[0])
            other.close()
        finally:
            lab.restore(role)

        rejoined = wait_until(
            lambda: set(healthy.live_nodes()) == set(healthy.nodes),
            40.0,
            "the node re-registering after the link came back",
        )
        print(f"cut detected in {detected:.1f}s, rejoined {rejoined:.1f}s after the link came back")
        assert "resetting and registering again" in lab.log_tail(
            victim, 100_000
        )  # it was declared dead and reset
        # It came back EMPTY: nothing cached anywhere for the prompt it held.
        assert c.lookup(prompt) == 0
        counters = c.node_stats(healthy.nodes[victim], timeout_s=10).counters
        empty = counters["used_blocks"] == counters["cached_blocks"] == counters["num_sequences"] == 0
        assert empty, counters
        with pytest.raises(FailedPrecondition, match="lost"):
            c.sequence("mh-cut")
        with pytest.raises(FailedPrecondition, match=f"'mh-cut' was lost: node {victim}"):
            seq.close()  # a lost sequence's close reports it (SequenceLost) and drops its page table
        c.node(healthy.nodes[victim]).control.check_integrity()
        fresh = c.open("mh-after-rejoin", SYSTEM_CUT + [3])  # the cluster serves opens again
        assert fresh.num_cached_tokens == 0
        fresh.close()


SYSTEM_PARTITION = list(range(6000, 6000 + 48))


def test_a_node_partitioned_from_the_control_plane_stops_serving(healthy):
    """Partition node <-> coordinator + Redis while the workers (this process) still reach the
    node: it fences itself (no split brain: it never serves a sequence the coordinator declared
    lost), is declared dead, and after the partition heals comes back empty; every held handle
    then answers SequenceLost naming it (issue 18)."""
    lab = healthy.lab
    with healthy.client() as c:
        held = []
        for i in range(40):
            prompt = SYSTEM_PARTITION + [i]
            seq = c.open(f"mh-part-{i}", prompt)
            if seq.route.node_id == "node-0":
                seq.append(prompt, *expected_kv(prompt))
                held.append(seq)
            else:
                seq.close()
            if len(held) == 2:
                break
        assert len(held) == 2, "no two sequences placed on node-0"
        ns = lab.hosts["node0"].ns
        blackholes = [f"{lab.hosts[r].addr}/32" for r in ("coord", "redis")]
        for target in blackholes:
            lab.run("node0", ["ip", "route", "add", "blackhole", target])
        try:
            reaped = _reaped(c)
            fenced = wait_until(lambda: _refused(held[0]), LEASE_TTL_S + 3, "node-0 fencing itself")
            # cut off, not declared dead yet: the close hears the node refuse (fenced), and
            # keeps the handle and the page table for the verdict
            with pytest.raises(Unavailable, match="cannot prove its lease"):
                held[0].close(timeout_s=2)
            assert not held[0].is_closed
            dead = wait_until(lambda: _reaped(c) > reaped, 1.75 * LEASE_TTL_S + 6, "node-0 declared dead")
            # declared dead and still cut off: it serves nothing, and the worker learns the loss
            with pytest.raises(FailedPrecondition, match=f"'{held[0].seq_id}' was lost: node node-0"):
                held[0].read_kv(0, 1, timeout_s=2)
            with pytest.raises(FailedPrecondition, match=f"'{held[0].seq_id}' was lost: node node-0"):
                held[0].close()  # retried, the close learns the loss
        finally:
            for target in blackholes:
                lab.run("node0", ["ip", "route", "del", "blackhole", target])
        healthy.wait_nodes(2, 40.0)
        with pytest.raises(FailedPrecondition, match="was lost") as info:
            held[1].read_kv(0, 1)  # healed: the node came back empty under a new epoch
        assert info.value.node_id == "node-0"
        with pytest.raises(FailedPrecondition, match="was lost"):
            held[1].close()
        print(f"partitioned node fenced after {fenced:.1f}s, declared dead {dead:.1f}s later ({ns})")


def _refused(seq) -> bool:
    try:
        seq.read_kv(0, 1, timeout_s=2)
    except Unavailable as exc:
        return "cannot prove its lease" in str(exc)
    return False


def _reaped(c: CacheClient) -> int:
    """Nodes the coordinator has declared dead so far."""
    return int(c.cluster_stats(timeout_s=3).counters.get("nodes_reaped", 0))

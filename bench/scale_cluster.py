"""bench.scale's cluster: a redis-server, real `pagedkv coordinator` processes, and fake nodes.

A fake node is a node id that really registers, beats and reports events over the
coordinator's gRPC port (the rpcs a CacheNode's CoordinatorLink sends); its data plane
is one stub CacheNode server in this process that accepts every Open and Free, which
is all a coordinator sends on an open and a close. Every fake node advertises that
stub's address, so 1,000 nodes cost one gRPC server, not 1,000.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import redis

from bench.scale_beats import BeatLinks
from pagedkv.cache_node.coordinator_link import LINK_WAIT_S
from pagedkv.cluster import free_port
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import pagedkv_pb2_grpc as pb_grpc
from pagedkv.protos.errors import NotFound, PagedKVError
from pagedkv.protos.framed_client import FramedPort

SPEC = pb.ModelSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_size=16)
NODE_BLOCKS = 1_000_000  # fake nodes never fill: the bench measures the control plane, not eviction


class StubNode(pb_grpc.CacheNodeServicer):
    """The data plane every fake node points at: Open and Free succeed, nothing is stored."""

    def __init__(self) -> None:
        self.num_opens = 0
        self.num_frees = 0

    def Open(self, request: pb.OpenRequest, context: grpc.ServicerContext) -> pb.OpenResponse:
        self.num_opens += 1
        return pb.OpenResponse(num_cached_tokens=request.expect_cached_tokens)

    def OpenSigned(self, request: pb.SignedOpen, context: grpc.ServicerContext) -> pb.OpenResponse:
        """The Open a worker carries (CoordOpenRequest.worker_opens): parsed, not checked."""
        return self.Open(pb.OpenRequest.FromString(request.order), context)

    def Free(self, request: pb.SeqRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.num_frees += 1
        return pb.Empty()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far, to the nanosecond: its CPU-time clock
    (Linux lets any process read another's), /proc/<pid>/stat's clock ticks where it cannot."""
    try:
        return time.clock_gettime((~pid << 3) | 2)  # CPUCLOCK_SCHED of the process, as clock_getcpuclockid
    except OSError:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of a process's threads so far, summed by role: the OS thread name
    without its pool index ("grpc-handler_3" -> "grpc-handler"); the coordinator names
    its threads (protos.serving.name_os_thread), gRPC's own are "event_engine", and
    "python" is what nobody named (the gRPC server's poll loop, the main thread).
    Read from each thread's schedstat (nanoseconds, the runtime cpu_s sums), so a thread's
    delta never exceeds the process's when this is read after cpu_s at the start and
    before it at the end; clock ticks where the kernel has no schedstat."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip().rstrip("0123456789").rstrip("_-")
            try:
                used = int((task / "schedstat").read_text().split()[0]) / 1e9
            except FileNotFoundError:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                used = (int(fields[11]) + int(fields[12])) / tick
        except OSError:  # the thread ended meanwhile
            continue
        out[name] = out.get(name, 0.0) + used
    return out


class ScaleCluster:
    """redis-server + `coordinators` coordinator processes + the stub node; `stop()` ends them all."""

    def __init__(
        self,
        workdir: Path,
        coordinators: int,
        lease_ttl_s: float,
        coordinator_args: Sequence[str] = (),
        coordinator_cpus: Sequence[int] = (),
    ) -> None:
        """`coordinator_cpus`: the CPUs the coordinators run on (all of their threads, from
        exec on: `taskset`); none: wherever the scheduler puts them."""
        self.workdir = workdir
        self.lease_ttl_s = lease_ttl_s
        self.procs: list[subprocess.Popen[bytes]] = []
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("bench.scale needs redis-server on PATH")
        for attempt in range(1, 6):  # a free port can be taken before redis binds it: try another
            port = free_port()
            self.redis_url = f"redis://127.0.0.1:{port}/0"
            self.redis_proc = self._spawn(
                "redis",
                [binary, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(workdir)],
            )
            self.redis = redis.Redis.from_url(self.redis_url)
            if self._redis_up() or attempt == 5:
                break
        if self.redis_proc.poll() is not None:
            raise RuntimeError(f"redis-server did not start: see {workdir / 'redis.log'}")
        self.stub = StubNode()
        self.stub_server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_CacheNodeServicer_to_server(self.stub, self.stub_server)
        self.stub_address = f"127.0.0.1:{self.stub_server.add_insecure_port('127.0.0.1:0')}"
        self.stub_server.start()
        self.stub_node = pb_grpc.CacheNodeStub(grpc.insecure_channel(self.stub_address))  # a worker's
        self.coordinators: list[tuple[subprocess.Popen[bytes], str]] = []
        for i in range(coordinators):
            address = f"127.0.0.1:{free_port()}"
            args = ["--listen", address, "--redis", self.redis_url, "--lease-ttl-s", str(lease_ttl_s)]
            args += coordinator_args
            pin = ["taskset", "-c", ",".join(map(str, coordinator_cpus))] if coordinator_cpus else []
            cmd = [*pin, sys.executable, "-m", "pagedkv", "coordinator", *args]
            proc = self._spawn(f"coordinator{i}", cmd)
            self.coordinators.append((proc, address))
        self.channels = [grpc.insecure_channel(a) for _, a in self.coordinators]
        self.stubs = [pb_grpc.CoordinatorStub(c) for c in self.channels]
        for channel in self.channels:
            grpc.channel_ready_future(channel).result(timeout=60)

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def _redis_up(self) -> bool:
        """Whether the redis-server just spawned answers (False: it exited, its port taken)."""
        deadline = time.monotonic() + 10
        while self.redis_proc.poll() is None:
            try:
                self.redis.ping()
                return True
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        return False

    def coordinator_pids(self) -> list[int]:
        return [p.pid for p, _ in self.coordinators]

    def redis_cpu_s(self) -> float:
        info = self.redis.info("cpu")
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])

    def counters(self, i: int = 0) -> dict[str, int]:
        return dict(self.stubs[i].Stats(pb.Empty(), timeout=30).counters)

    def stop(self) -> None:
        for channel in self.channels:
            channel.close()
        self.stub_server.stop(0)
        self.redis.close()
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class FakeNodes:
    """`num_nodes` node ids registered through the coordinators (round robin), beating at
    the interval the coordinator hands out until `stop()`: each node's lease is the one its last
    reply handed out (the coordinator lengthens it as the fleet grows) and a round's interval is
    the shortest of theirs, a quarter of it."""

    def __init__(self, cluster: ScaleCluster, num_nodes: int) -> None:
        self.cluster = cluster
        self.ids = [f"node{i:05}" for i in range(num_nodes)]
        self.leases = [0.0] * num_nodes  # each node's lease, from its last reply (0: not registered)
        self.late_beats = 0  # beats sent more than a tenth of the interval late
        self.unregistered = 0  # beats answered is_registered=False (the node was reaped)
        self.failed_beats = 0  # beats that failed (UNAVAILABLE, deadline)
        self.lapsed_reports = 0  # ReportEvents refused (lease lapsed): registered again
        self._stop = threading.Event()
        self.first_round = threading.Event()  # every node beat on one lease (its link connected)
        self._thread: threading.Thread | None = None
        self.frame_ports = [0] * len(cluster.stubs)
        self.epochs = [0] * num_nodes  # each node's registration
        self.sent = [0] * num_nodes  # the last event number each node reported
        self.beat_framed = True  # as real nodes beat (CoordinatorLink)
        self.beats_spread = True  # each node at its own moment of the interval, as real nodes

    def _stub(self, i: int) -> pb_grpc.CoordinatorStub:
        return self.cluster.stubs[i % len(self.cluster.stubs)]

    def register(self, beat: bool = False) -> float:
        """Register every node, 64 rpcs in flight at once; returns the seconds it took. `beat`:
        each node beats from its own registration on, as a real node does (on a slow host the
        first nodes' leases would lapse before the last one registered)."""
        start = time.perf_counter()
        pending: list[tuple[int, Any]] = []
        for i, node_id in enumerate(self.ids):
            pending.append((i, self._stub(i).Register.future(self._register_request(node_id), timeout=60)))
            if len(pending) >= 64:
                self._registered(*pending.pop(0))
            if i < len(self.frame_ports):  # each coordinator's framed port, from its first reply
                self.frame_ports[i] = pending[-1][1].result().frame_port
                if beat and i == len(self.frame_ports) - 1:
                    self.start_beating()
        for i, f in pending:
            self._registered(i, f)
        if beat and self._thread is None:  # (fewer nodes than coordinators)
            self.start_beating()
        return time.perf_counter() - start

    def _registered(self, i: int, future: Any) -> None:
        reply = future.result()
        self.epochs[i], self.sent[i] = reply.epoch, 0  # a registration numbers its events from 1
        self.leases[i] = reply.lease_ttl_s  # what a CoordinatorLink beats at (a quarter of it)

    @property
    def interval_s(self) -> float:
        """The beat interval now: a quarter of the shortest lease a registered node holds."""
        held = [lease for lease in self.leases if lease > 0]
        return min(held) / 4 if held else self.cluster.lease_ttl_s / 4

    def _register_request(self, node_id: str) -> pb.RegisterRequest:
        return pb.RegisterRequest(
            node_id=node_id,
            address=self.cluster.stub_address,
            spec=SPEC,
            num_blocks=NODE_BLOCKS,
            adapts_lease=True,
        )

    def start_beating(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="fake-beats", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        """Every node's beat each interval: on the coordinators' framed ports as real nodes
        beat (a connection per node, each waiting for its own reply: BeatLinks, one thread),
        a node whose link broke over gRPC; with `beat_framed` off, all over gRPC (in flight).
        Spread over the interval (`beats_spread`), as nodes beating on their own timers do;
        else all at its start (a burst: the coordinator saturated for its length)."""
        load = pb.NodeLoad(free_blocks=NODE_BLOCKS, num_blocks=NODE_BLOCKS)
        links = BeatLinks(len(self.ids), self.frame_ports) if self.beat_framed else None
        next_at = time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() - next_at > self.interval_s / 10:
                self.late_beats += 1
            requests = [
                pb.HeartbeatRequest(node_id=n, load=load, lease_ttl_s=lease)
                for n, lease in zip(self.ids, self.leases, strict=True)
            ]
            whole = all(self.epochs) and len(set(self.leases)) == 1  # every node registered, on one lease
            calls = []
            for i, r in enumerate(requests):
                if self.beats_spread:  # node i beats i/N of the interval in
                    self._wait(links, next_at + i * self.interval_s / len(requests))
                if not self.epochs[i]:  # not registered yet: it beats from its registration on
                    continue
                if links is None or not links.send(i, r):
                    calls.append((i, self._stub(i).Heartbeat.future(r, timeout=30)))
            for i, call in calls:
                try:
                    self._answered(i, call.result())
                except (grpc.RpcError, PagedKVError):  # UNAVAILABLE (Redis timed out under load): missed
                    self.failed_beats += 1
            deadline = time.monotonic() + 30
            while links is not None and links.num_pending and time.monotonic() < deadline:
                self._wait(links, time.monotonic() + 0.05)
            if whole:
                self.first_round.set()
            next_at += self.interval_s
            self._wait(links, next_at)
        if links is not None:
            links.close()

    def _wait(self, links: BeatLinks | None, until: float) -> None:
        """Until then (or stop), taking the framed beats' replies as they come."""
        while not self._stop.is_set() and (left := until - time.monotonic()) > 0:
            if links is None:
                self._stop.wait(left)
                continue
            for node, reply in links.poll(min(left, 0.1)):
                self._answered(node, reply)

    def _answered(self, node: int, reply: pb.HeartbeatResponse | None) -> None:
        if reply is None:  # an error reply (UNAVAILABLE), or a link that broke: missed
            self.failed_beats += 1
        elif not reply.is_registered:
            self.unregistered += 1
        elif reply.lease_ttl_s > 0:  # the lease this renewal granted, and from now on
            self.leases[node] = reply.lease_ttl_s

    def report(
        self, node: int, keys: list[bytes], batch: int, framed: bool = False, one_way: bool = False
    ) -> int:
        """ReportEvents: `keys` stored on node `node`, `batch` events an rpc, numbered as a
        CoordinatorLink numbers them, to the first coordinator (on its framed port when
        `framed`, as a node does once it knows it; one-way as well with `one_way`, as a
        node does where the coordinator takes them so); then, as a link does, empty reports
        until the store holds them all (one-way: its beat would ask). Returns the rpcs sent."""
        stub = self.cluster.stubs[0]
        port = FramedPort("127.0.0.1", None, None)
        port.learn(self.frame_ports[0] if framed or one_way else 0)

        def send(events: list[pb.BlockEvent], reply_wanted: bool = True) -> Any:
            request = pb.ReportEventsRequest(
                node_id=self.ids[node], events=events, epoch=self.epochs[node], first_seq=self.sent[node] + 1
            )
            if one_way and not reply_wanted:
                port.notify("ReportEvents", request, 60, may_wait_s=LINK_WAIT_S)
                return None
            if framed or one_way:
                return port.call("ReportEvents", request, pb.ReportEventsResponse, 60)
            return stub.ReportEvents(request, timeout=60)

        rpcs = 0
        reply = None
        for first in range(0, len(keys), batch):
            events = [pb.BlockEvent(kind=pb.BlockEvent.STORED, key=k) for k in keys[first : first + batch]]
            if one_way:  # (a lapsed lease shows as a gap below: the bench then fails)
                send(events, reply_wanted=False)
                rpcs += 1
                self.sent[node] += len(events)
                continue
            try:
                reply = send(events)
            except (grpc.RpcError, PagedKVError) as err:  # its lease lapsed (a loaded host): register again
                code = err.code() if isinstance(err, grpc.RpcError) else None
                if code != grpc.StatusCode.NOT_FOUND and not isinstance(err, NotFound):
                    raise
                self.lapsed_reports += 1
                again = stub.Register.future(self._register_request(self.ids[node]), timeout=60)
                self._registered(node, again)
                reply = send(events)
            rpcs += 1
            if reply.next_seq != self.sent[node] + len(events) + 1:
                raise RuntimeError(f"report of {self.ids[node]} not taken whole: {reply}")
            self.sent[node] += len(events)
        if one_way and keys:  # what a beat asks: how far they got (the first ask counts as a report)
            reply = send([])
            rpcs += 1
            if reply.next_seq != self.sent[node] + 1:
                raise RuntimeError(f"one-way reports of {self.ids[node]} not all taken: {reply}")
        while reply is not None and reply.applied_seq < self.sent[node]:  # applied in batches
            time.sleep(0.001)
            reply = send([])
            rpcs += 1
        port.close()
        return rpcs

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

"""Fault experiments on a real cluster (issue 18): redis-server (AOF on or off), a coordinator and
two nodes as processes, and a workload that checks every answer.

The workload's workers (threads of the test, each with its own client) open prompts under a
shared 256-token system prompt, append deterministic K/V for what was not cached, read the
whole sequence back byte by byte, run decode steps checked against a float64 dense reference,
and close. K/V is a pure function of (position, token), so a reused prefix is checked, not
trusted. Every answer is classified: correct, SequenceLost (the documented loss), Unavailable
(refused or timed out: the sequence is abandoned and closed, never retried blind, since a
timed-out append may have landed), or wrong (a corruption, or any other error: counted and
reported). After an experiment `converged` checks the cluster came back by itself: every
node's integrity check, no block held on any node, no page table left in Redis.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import torch

from pagedkv.client import (
    CacheClient,
    ClientConfig,
    NotFound,
    OpenFailed,
    PagedKVError,
    SequenceLost,
    Unavailable,
)
from pagedkv.cluster import LocalCluster, NodeOptions, free_port

# The cluster tests' worker: its model shape, K/V as a pure function of (position, token), and
# float64 dense attention (loaded by path: tests/cluster is not on this directory's sys.path).
_worker_spec = importlib.util.spec_from_file_location(
    "chaos_worker", Path(__file__).parents[1] / "cluster" / "worker.py"
)
assert _worker_spec is not None and _worker_spec.loader is not None
_worker = importlib.util.module_from_spec(_worker_spec)
_worker_spec.loader.exec_module(_worker)
SPEC, Q_HEADS, expected_kv, dense = _worker.SPEC, _worker.Q_HEADS, _worker.expected_kv, _worker.dense
SYSTEM = list(range(10_000, 10_256))  # the shared system prompt: 16 blocks
TOKEN = "token-chaos"
LEASE_S = 3.0
# liveness.py: lease + grace (lease/2) + a reaper tick (lease/4) + the probe (1 s), plus slack for
# a loaded machine (the reaper thread and the test share two CPUs with other work).
DETECTION_BOUND_S = LEASE_S * 1.75 + 1.0 + 2.0


def next_kv(pos: int, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """expected_kv's K and V of one position, [layers, 1, kv_heads, dim], without the prefix."""
    g = torch.Generator().manual_seed(pos * 1_000_003 + token)
    shape = (SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim)
    return torch.randn(shape, generator=g).unsqueeze(1), torch.randn(shape, generator=g).unsqueeze(1)


def wait_pong(port: int, timeout_s: float = 10.0) -> None:
    """Until the redis-server (or sentinel) on `port` answers PING."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing answered PING on port {port} within {timeout_s}s")


class Redis:
    """A redis-server process on a fixed port and data directory: kill() and start() keep both,
    so with AOF a restart reloads what was written."""

    def __init__(self, workdir: Path, aof: bool) -> None:
        self.port = free_port()
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True)
        self.aof = aof
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--dir", str(self.dir), "--appendonly", "yes" if self.aof else "no"]
        if self.aof:
            args += ["--appendfsync", "always"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_pong(self.port)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


@dataclass
class Tally:
    """What the workers saw."""

    counts: Counter = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)  # corruptions and undocumented errors
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, what: str, detail: str = "") -> None:
        with self.lock:
            self.counts[what] += 1
            if what == "wrong":
                self.wrong.append(detail)


class Workload:
    """`num_workers` threads running sequences until stop(); every answer checked."""

    def __init__(self, coordinator: str, num_workers: int = 6, seed: int = 0) -> None:
        self.coordinator = coordinator
        self.num_workers = num_workers
        self.seed = seed
        self.tally = Tally()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.held: list[tuple[CacheClient, object]] = []  # sequences kept open on purpose (hold())
        self.framed_calls = 0  # Open / Close the workers sent on the coordinator's framed port
        self._framed_lock = threading.Lock()

    def client(self) -> CacheClient:
        return CacheClient(
            coordinator=self.coordinator, token=TOKEN, spec=SPEC, config=ClientConfig(deadline_s=4.0)
        )

    def start(self) -> Workload:
        for i in range(self.num_workers):
            t = threading.Thread(target=self._worker, args=(i,), name=f"chaos-worker-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, timeout_s: float = 60.0) -> Tally:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
            if t.is_alive():  # say where it hangs: the call that outlived its deadline
                frame = sys._current_frames().get(t.ident or 0)
                where = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "?"
                raise AssertionError(f"{t.name} did not finish within {timeout_s}s; it is at:\n{where}")
        return self.tally

    def _worker(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        with self.client() as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                prompt = SYSTEM + [rng.randrange(20_000, 30_000) for _ in range(rng.randrange(8, 40))]
                try:
                    self.run_one(client, f"w{i}-{n}-{uuid.uuid4().hex[:6]}", prompt, rng)
                except Exception as exc:  # noqa: BLE001 - a bug in the workload is a failure too
                    self.tally.add("wrong", f"worker {i}: {type(exc).__name__}: {exc}")
                    return
                finally:
                    self._count_framed(client)

    def _count_framed(self, client: CacheClient) -> None:
        framed = getattr(client.routing, "framed", None)
        if framed is not None:
            with self._framed_lock:
                self.framed_calls += framed.num_calls
                framed.num_calls = 0

    def run_one(self, client: CacheClient, seq_id: str, prompt: list[int], rng: random.Random) -> None:
        """One sequence, start to close; every outcome counted in the tally."""
        tally = self.tally
        try:
            seq = client.open(seq_id, prompt)
        except Unavailable:
            tally.add("open_unavailable")
            self.close_unknown(client, seq_id)  # the open may have been written before the error
            return
        except PagedKVError as exc:
            tally.add("wrong", f"open {seq_id}: {type(exc).__name__}: {exc}")
            return
        try:
            self._use(seq, prompt, rng)
            tally.add("completed")
        except SequenceLost:
            tally.add("lost_reported")
        except (Unavailable, OpenFailed) as exc:
            tally.add("abandoned_" + type(exc).__name__)
        except PagedKVError as exc:
            tally.add("wrong", f"{seq_id}: {type(exc).__name__}: {exc}")
        except AssertionError as exc:
            tally.add("wrong", f"{seq_id}: corruption: {exc}")
        self.close(seq)

    def close_unknown(self, client: CacheClient, seq_id: str) -> None:
        """Close an id whose open answered Unavailable, as a careful worker does: the coordinator
        may have written its page table (and opened it on the node) before the failure."""
        deadline = time.monotonic() + 30
        while True:
            try:
                seq = client.sequence(seq_id)
            except NotFound:
                return  # never opened (or its record is gone): nothing to close
            except SequenceLost:
                break  # its close reports the loss and drops the record
            except Unavailable:
                if time.monotonic() > deadline:
                    self.tally.add("wrong", f"describe of {seq_id} unavailable for 30 s")
                    return
                time.sleep(0.2)
                continue
            # Its node may never have had it (the open failed before the worker's node Open):
            # the node answers SequenceLost for an id placed there that never arrived. No KV was
            # lost, as none was written: counted apart from the losses of sequences worked on.
            self.close(seq, lost="unknown_close_lost")
            return
        with contextlib.suppress(PagedKVError):
            client.routing.close(seq_id, None)

    def close(self, seq: object, lost: str = "close_lost_reported") -> None:
        """Close, retrying while the coordinator is unreachable (close is idempotent);
        SequenceLost is counted as `lost`."""
        deadline = time.monotonic() + 30
        while True:
            try:
                seq.close()  # type: ignore[attr-defined]
                self.tally.add("closed")
                return
            except SequenceLost:
                self.tally.add(lost)
                return
            except Unavailable:
                if time.monotonic() > deadline:
                    self.tally.add("wrong", f"close of {seq.seq_id} unavailable for 30 s")  # type: ignore[attr-defined]
                    return
                time.sleep(0.2)
            except PagedKVError as exc:
                self.tally.add("wrong", f"close {seq.seq_id}: {type(exc).__name__}: {exc}")  # type: ignore[attr-defined]
                return

    def _use(self, seq: object, prompt: list[int], rng: random.Random) -> None:
        cached = seq.num_cached_tokens  # type: ignore[attr-defined]
        k, v = expected_kv(prompt)
        seq.append(prompt[cached:], k[:, cached:], v[:, cached:])  # type: ignore[attr-defined]
        got_k, got_v = seq.read_kv(0, len(prompt))  # type: ignore[attr-defined]
        assert torch.equal(got_k, k) and torch.equal(got_v, v), "read_kv differs from what was written"
        tokens = list(prompt)
        for _ in range(rng.randrange(2, 6)):
            tokens.append(rng.randrange(20_000, 30_000))
            nk, nv = next_kv(len(tokens) - 1, tokens[-1])
            k, v = torch.cat((k, nk), 1), torch.cat((v, nv), 1)
            for layer in range(SPEC.num_layers):
                q = torch.randn(Q_HEADS, SPEC.head_dim, generator=torch.Generator().manual_seed(len(tokens)))
                tok = tokens[-1] if layer == 0 else None
                out = seq.attend(layer, q, nk[layer, 0], nv[layer, 0], tok)  # type: ignore[attr-defined]
                ref = dense(q, k[layer], v[layer])
                err = float((out.out.double() - ref).abs().max() / ref.abs().max())
                assert err < 1e-4, f"attend layer {layer} at {len(tokens)} tokens: relative error {err:.2e}"


class ChaosCluster:
    """redis-server (own process: killable, AOF optional), a coordinator and two nodes."""

    def __init__(
        self,
        workdir: Path,
        *,
        aof: bool = False,
        lease_s: float = LEASE_S,
        redis: Redis | None = None,
        secure: bool = True,
    ) -> None:
        """redis: the store's processes (default: one redis-server, AOF as `aof` says);
        secure=False: no cluster secret, so no tickets (nodes learn nothing of a sequence
        before its Open)."""
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not on the PATH")
        self.redis = redis or Redis(workdir, aof)
        tenants = workdir / "tenants.json"
        tenants.write_text(json.dumps({"tokens": {TOKEN: "chaos"}}))
        node = NodeOptions.for_spec(SPEC, num_blocks=256, host_blocks=32)
        self.cluster = LocalCluster(
            2,
            node,
            redis_url=self.redis.url,
            lease_ttl_s=lease_s,
            log_dir=str(workdir),
            tenants_file=str(tenants),
            secure=secure,
        )

    def __enter__(self) -> ChaosCluster:
        self.redis.start()
        try:
            self.cluster.start()
        except BaseException:
            self.redis.kill()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.cluster.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)  # a stopped process cannot stop
        self.cluster.stop()
        self.redis.kill()

    @property
    def coordinator(self) -> str:
        return self.cluster.coordinator_address

    def live_nodes(self) -> set[str]:
        try:
            return {n.node_id for n in self.cluster.stats().nodes}
        except Exception:  # noqa: BLE001 - the coordinator may be down mid-experiment
            return set()

    def signal(self, name: str, sig: int) -> None:
        self.cluster.procs[name].send_signal(sig)

    def converged(self, client: CacheClient, timeout_s: float) -> float:
        """Wait until every node is clean (integrity, nothing held) and Redis holds no page
        table and no node link to one; returns how long it took. Raises AssertionError."""
        start = time.monotonic()
        last = ""
        while time.monotonic() - start < timeout_s:
            last = self._dirt(client)
            if not last:
                return time.monotonic() - start
            time.sleep(0.25)
        raise AssertionError(f"not converged within {timeout_s}s: {last}")

    def _dirt(self, client: CacheClient) -> str:
        r = self.redis.client()
        try:
            # A lost page table whose worker never learned of it (its open answered Unavailable
            # after the store wrote it) is garbage-collected: it must carry an expiry.
            seqs = sorted(
                k.decode()
                for k in r.scan_iter("pkv:seq:*")
                if not (r.hget(k, "state") == b"lost" and r.pttl(k) > 0)
            )
            links = {k.decode(): r.smembers(k) for k in r.scan_iter("pkv:nseqs:*")}
        finally:
            r.close()
        if seqs:
            return f"{len(seqs)} page tables left in Redis (e.g. {seqs[:3]})"
        for key, members in links.items():  # (a lost record leaves its node's set at once)
            if members:
                return f"{key} still lists {len(members)} sequences (e.g. {sorted(members)[:3]})"
        for address in self.cluster.node_addresses:
            node = client.node(address)
            try:
                node.control.check_integrity()
                counters = node.control.stats().counters
            except PagedKVError as exc:
                return f"node {address}: {exc}"
            if counters["used_blocks"] or counters["num_sequences"]:
                held = f"{counters['num_sequences']} sequences, {counters['used_blocks']} blocks"
                return f"node {address} holds {held}"
        return ""


def hold_on(work: Workload, node_id: str | None, count: int) -> list:
    """`count` sequences opened (prompt appended) and kept on `node_id` (None: any node)."""
    client = work.client()
    held = []
    for i in range(200):
        prompt = SYSTEM + [30_000 + i]
        seq = client.open(f"held-{node_id}-{i}", prompt)
        if node_id is not None and seq.route.node_id != node_id:
            seq.close()
            continue
        k, v = expected_kv(prompt)
        try:
            seq.append(
                prompt[seq.num_cached_tokens :], k[:, seq.num_cached_tokens :], v[:, seq.num_cached_tokens :]
            )
        except (SequenceLost, OpenFailed, Unavailable):  # its node Open failed (a loaded machine)
            with contextlib.suppress(PagedKVError):
                seq.close()
            continue
        held.append(seq)
        if len(held) == count:
            return held
    raise AssertionError(f"no {count} sequences placed on {node_id} in 200 opens")


def read_back(seq) -> bool:
    """The held sequence still reads back exactly what was written."""
    prompt = SYSTEM + [int(seq.seq_id.rsplit("-", 1)[1]) + 30_000]
    k, v = expected_kv(prompt)
    got_k, got_v = seq.read_kv(0, len(prompt))
    return torch.equal(got_k, k) and torch.equal(got_v, v)


def reads_back(seq) -> bool:
    """read_back, False while the node refuses (fenced until it renews its lease)."""
    try:
        return read_back(seq)
    except Unavailable:
        return False


def assert_lost_everywhere(held: list, node_id: str) -> None:
    """Each held sequence answers SequenceLost naming the node on a data call and on close
    (the page table says so, or the node itself: its close frees on the node first, and a
    node that came back empty remembers what it lost, even when the store forgot it); a
    second close succeeds (the handle is closed, the record gone)."""
    for seq in held:
        deadline = time.monotonic() + 2 * LEASE_S
        while True:
            try:
                seq.read_kv(0, 1)
                raise AssertionError(f"{seq.seq_id} still reads after its node lost it")
            except SequenceLost as exc:
                assert exc.node_id == node_id and node_id in str(exc), exc
                break
            except Unavailable:  # fenced, not yet re-registered
                assert time.monotonic() < deadline, f"{seq.seq_id}: Unavailable for {2 * LEASE_S}s"
                time.sleep(0.2)
        with pytest.raises(SequenceLost, match=node_id):
            seq.close()
        seq.close()  # the record is gone with the report: a second close succeeds


PROMPT_TOKENS = 2 * SPEC.block_size  # whole blocks: a sharded sequence's extent seals there


def seeded_kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of n tokens, from `seed` (a placed sequence's are seeded by its index)."""
    g = torch.Generator().manual_seed(seed)
    shape = (SPEC.num_layers, n, SPEC.num_kv_heads, SPEC.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def placed(client: CacheClient, node_id: str, name: str, base: int = 40_000):
    """A sequence opened on `node_id` with PROMPT_TOKENS appended (other placements closed);
    its id ends in the index that seeded its KV (seeded_kv)."""
    for i in range(100):
        prompt = [base + 100 * i + j for j in range(PROMPT_TOKENS)]
        seq = client.open(f"{name}-{i}", prompt)
        if seq.route.node_id != node_id:
            seq.close()
            continue
        seq.append(prompt, *seeded_kv(PROMPT_TOKENS, i))
        return seq
    raise AssertionError(f"no sequence placed on {node_id} in 100 opens")


def wait_for(predicate, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout_s}s")

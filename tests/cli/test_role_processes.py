"""How the role processes behave once running: one port one server, `--metrics-port` the same
on both roles and bound to the --listen host, one log format (text or JSON), retry warnings
rate-limited, `pagedkv status` without torch."""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from pagedkv.coordinator.core import Coordinator
from pagedkv.coordinator.service import create_server
from pagedkv.coordinator.store import open_store
from pagedkv.logs import RepeatFilter
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import pagedkv_pb2_grpc as pb_grpc

PAGEDKV = [sys.executable, "-m", "pagedkv"]
SMALL_NODE = [
    "node",
    "--num-layers",
    "2",
    "--num-kv-heads",
    "2",
    "--head-dim",
    "8",
    "--dtype",
    "float32",
    "--num-blocks",
    "8",
    "--bulk-port",
    "off",
]


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*PAGEDKV, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL
    )


def read_until(proc: subprocess.Popen[str], pattern: str, timeout_s: float = 90) -> re.Match[str]:
    assert proc.stdout is not None
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if m := re.search(pattern, line):
            return m
    raise AssertionError(f"no {pattern!r} in {seen}; stderr: {proc.stderr.read() if proc.stderr else ''}")


def stop(proc: subprocess.Popen[str]) -> str:
    """SIGTERM, wait, and return what it logged on stderr."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err


def test_a_second_coordinator_cannot_share_the_port() -> None:
    # SO_REUSEPORT off (as on the node): without it the second bind succeeds and the kernel
    # splits new connections between two coordinators.
    first = Coordinator(open_store("memory://"))
    server, port = create_server(first, "127.0.0.1:0")
    try:
        with pytest.raises((RuntimeError, OSError)):
            create_server(Coordinator(open_store("memory://")), f"127.0.0.1:{port}")
    finally:
        server.stop(0)


@pytest.mark.parametrize("role", ["coordinator", "node"])
def test_metrics_port_0_is_any_free_port_on_the_listen_host(role: str) -> None:
    args = [role, "--listen", "127.0.0.1:0", "--metrics-port", "0"]
    proc = start(args if role == "coordinator" else [*SMALL_NODE, *args[1:]])
    try:
        m = read_until(proc, r"metrics on http://127\.0\.0\.1:(\d+)/metrics")
        port = int(m.group(1))
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "pagedkv_" in body
        with pytest.raises(OSError), socket.create_connection(("127.0.0.2", port), timeout=2):
            pass  # bound to the --listen address, not 0.0.0.0
    finally:
        stop(proc)


def test_node_without_coordinator_logs_json_and_warns_once() -> None:
    proc = start(
        [
            *SMALL_NODE,
            "--listen",
            "127.0.0.1:0",
            "--metrics-port",
            "off",
            "--log-format",
            "json",
            "--coordinator",
            f"127.0.0.1:{dead_port()}",
        ]
    )
    try:
        read_until(proc, r"joining coordinator")
        time.sleep(6)  # the link retries every 0.1-2 s meanwhile
    finally:
        err = stop(proc)
    entries = [json.loads(line) for line in err.splitlines() if line.strip()]  # every line is JSON
    assert entries and all({"ts", "level", "logger", "msg"} <= set(e) for e in entries)
    unreachable = [e for e in entries if "coordinator unreachable" in e["msg"]]
    assert len(unreachable) == 1, unreachable
    assert unreachable[0]["level"] == "WARNING" and unreachable[0]["logger"] == "pagedkv.node.link"


def test_a_node_of_a_cluster_serves_no_data_call_before_it_registers() -> None:
    """Fenced from its first call (before the process prints that it listens), not from when
    its coordinator link starts: a restarted node never answers NOT_FOUND for a sequence its
    registration would have reported lost."""
    proc = start(
        [
            *SMALL_NODE,
            "--listen",
            "127.0.0.1:0",
            "--metrics-port",
            "off",
            "--coordinator",
            f"127.0.0.1:{dead_port()}",
        ]
    )
    try:
        address = read_until(proc, r"listening on (\S+) ").group(1)
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.CacheNodeStub(channel)
            assert stub.Stats(pb.Empty(), timeout=10).is_fenced  # at once
            with pytest.raises(grpc.RpcError) as info:
                list(stub.ReadKV(pb.ReadKVRequest(seq_id="s", start=0, end=0), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        assert "cannot prove its lease is live" in (info.value.details() or "")
    finally:
        stop(proc)


def test_coordinator_without_redis_warns_at_start_and_then_rarely() -> None:
    proc = start(
        [
            "coordinator",
            "--listen",
            "127.0.0.1:0",
            "--lease-ttl-s",
            "0.5",
            "--redis",
            f"redis://127.0.0.1:{dead_port()}/0",
        ]
    )
    try:
        read_until(proc, r"listening on")
        time.sleep(5)  # the reaper ticks every lease/4 meanwhile
    finally:
        err = stop(proc)
    lines = err.splitlines()
    assert any("does not answer" in ln and "serving UNAVAILABLE" in ln for ln in lines), err
    assert len([ln for ln in lines if "reaper:" in ln]) <= 1, err
    assert all(re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z [A-Z]+ pagedkv\.", ln) for ln in lines), err


def test_repeat_filter_passes_the_first_then_one_per_interval_with_a_count() -> None:
    f = RepeatFilter(interval_s=0.3)

    def record(msg: str, level: int = logging.WARNING) -> logging.LogRecord:
        return logging.LogRecord("pagedkv.x", level, __file__, 1, msg, (), None)

    assert f.filter(record("down: %s"))
    assert not f.filter(record("down: %s")) and not f.filter(record("down: %s"))
    assert f.filter(record("other"))  # another template is its own series
    assert f.filter(record("down: %s", logging.INFO))  # below WARNING: never held back
    time.sleep(0.35)
    passed = record("down: %s")
    assert f.filter(passed) and "(2 more like this" in str(passed.msg)


def test_status_imports_no_torch() -> None:
    code = (
        "import sys\nfrom pagedkv.cli import main\n"
        f"try:\n    main(['status', '--coordinator', '127.0.0.1:{dead_port()}', '--timeout-s', '1'])\n"
        "except SystemExit as e:\n    print(e)\nprint('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    out = done.stdout.strip().splitlines()
    assert out[-1] == "False", done.stdout + done.stderr
    assert out[0].startswith("pagedkv status: coordinator 127.0.0.1:") and "UNAVAILABLE" in out[0]


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_the_services_on_v1_and_v1alpha(version: str) -> None:
    import grpc
    from grpc_reflection.v1alpha import reflection_pb2

    server, port = create_server(Coordinator(open_store("memory://")), "127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream(
                f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            requests = [
                reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="pagedkv.v1.Coordinator"),
            ]
            listed, described = list(call(iter(requests), timeout=10))
    finally:
        server.stop(0)
    assert described.file_descriptor_response.file_descriptor_proto  # `grpcurl describe` works too
    names = {s.name for s in listed.list_services_response.service}
    assert {
        "pagedkv.v1.Coordinator",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names

"""Every mistake a user can make on the command line is one line on stderr naming what is
wrong and how to fix it, exit code 2, no traceback -- checked on real `pagedkv` processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PAGEDKV = [sys.executable, "-m", "pagedkv"]
NODE = [
    "node",
    "--listen",
    "127.0.0.1:0",
    "--metrics-port",
    "off",
    "--bulk-port",
    "off",
    "--num-layers",
    "2",
    "--num-kv-heads",
    "2",
    "--head-dim",
    "8",
    "--dtype",
    "float32",
]
COORDINATOR = ["coordinator", "--listen", "127.0.0.1:0"]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port some other process is listening on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def usage_error(args: list[str], *, env: dict[str, str] | None = None, timeout_s: float = 120) -> str:
    """Run a command that must fail as a usage error; its one stderr line."""
    done = subprocess.run(
        [*PAGEDKV, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr
    errors = [ln for ln in done.stderr.splitlines() if ": error: " in ln]
    assert len(errors) == 1, done.stderr
    assert errors[0] == done.stderr.strip().splitlines()[-1]  # the error is the last thing said
    return errors[0]


# -- the node --------------------------------------------------------------------------------


def test_node_grpc_port_in_use(taken_port: int) -> None:
    line = usage_error([*NODE, "--listen", f"127.0.0.1:{taken_port}", "--num-blocks", "4"])
    assert f"gRPC port {taken_port} on 127.0.0.1 is already in use (--listen)" in line
    assert "choose another port" in line


def test_node_metrics_port_in_use(taken_port: int) -> None:
    line = usage_error([*NODE, "--metrics-port", str(taken_port), "--num-blocks", "4"])
    assert f"metrics port {taken_port} on 127.0.0.1 is already in use (--metrics-port)" in line


def test_node_bulk_port_in_use(taken_port: int) -> None:
    line = usage_error([*NODE, "--bulk-port", str(taken_port), "--num-blocks", "4"])
    assert f"bulk KV port {taken_port} on 127.0.0.1 is already in use (--bulk-port)" in line


def test_node_pool_larger_than_memory_in_blocks() -> None:
    line = usage_error([*NODE, "--num-blocks", "100000000000"])
    assert "the pool needs" in line and "this machine has" in line and "lower --num-blocks" in line


def test_node_pool_larger_than_memory_in_bytes() -> None:
    line = usage_error([*NODE, "--pool-bytes", "5TiB"])
    assert "the pool needs 5.0 TiB" in line and "lower --num-blocks / --pool-bytes" in line


def test_node_host_tier_counts_against_memory() -> None:
    line = usage_error([*NODE, "--num-blocks", "4", "--host-bytes", "5TiB"])
    assert "the pool needs 5.0 TiB" in line and "--host-bytes" in line


def test_node_cuda_without_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = usage_error([*NODE, "--num-blocks", "4", "--device", "cuda"])
    assert "--device cuda: this machine has no CUDA device" in line and "--device cpu" in line


def test_node_unknown_device() -> None:
    line = usage_error([*NODE, "--num-blocks", "4", "--device", "tpu9"])
    assert "--device 'tpu9' is not a torch device" in line


def test_node_bad_log_level() -> None:
    line = usage_error([*NODE, "--log-level", "LOUD"])
    assert "--log-level 'LOUD': choose one of DEBUG, INFO, WARNING, ERROR, CRITICAL" in line


def test_node_bad_environment_default() -> None:
    line = usage_error(NODE, env={"PAGEDKV_NUM_BLOCKS": "lots"})
    assert "--num-blocks 'lots' is not a whole number" in line


def test_node_bad_listen_address() -> None:
    line = usage_error([*NODE, "--listen", "localhost"])
    assert "--listen 'localhost' is not host:port" in line


# -- the coordinator -------------------------------------------------------------------------


def test_coordinator_grpc_port_in_use(taken_port: int) -> None:
    line = usage_error(["coordinator", "--listen", f"127.0.0.1:{taken_port}"])
    assert f"gRPC port {taken_port} on 127.0.0.1 is already in use (--listen)" in line


def test_coordinator_metrics_port_in_use(taken_port: int) -> None:
    line = usage_error([*COORDINATOR, "--metrics-port", str(taken_port)])
    assert f"metrics port {taken_port} on 127.0.0.1 is already in use (--metrics-port)" in line


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://cache:6379", "unknown store URL 'http://cache:6379'"),
        ("redis://localhost:port/0", "bad redis URL 'redis://localhost:port/0'"),
    ],
)
def test_coordinator_bad_redis_url(url: str, says: str) -> None:
    line = usage_error([*COORDINATOR, "--redis", url])
    assert says in line and "e.g. redis://127.0.0.1:6379/0" in line


def test_coordinator_missing_tenants_file(tmp_path: Path) -> None:
    line = usage_error([*COORDINATOR, "--tenants", str(tmp_path / "nope.json")])
    assert "nope.json" in line and "No such file" in line and "tenants.example.json" in line


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{not json", "Expecting property name"),
        ('{"tokens": {"t": ""}}', "'tokens' must map token strings to tenant names"),
        ('{"quotas": {"a": -1}}', "'quotas' must map tenants to block counts >= 0"),
    ],
)
def test_coordinator_invalid_tenants_file(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "tenants.json"
    path.write_text(text)
    assert says in usage_error([*COORDINATOR, "--tenants", str(path)])


def test_coordinator_negative_lease() -> None:
    line = usage_error([*COORDINATOR, "--lease-ttl-s", "-1"])
    assert "--lease-ttl-s -1 must be greater than 0" in line


def test_coordinator_bad_log_level() -> None:
    assert "--log-level 'LOUD'" in usage_error([*COORDINATOR, "--log-level", "LOUD"])


# -- up, and the command itself --------------------------------------------------------------


def test_up_checks_all_nodes_against_memory() -> None:
    line = usage_error(["up", "--embedded", "--nodes", "4", "--pool-bytes", "2TiB"])
    assert "4 nodes of" in line and "lower --num-blocks / --pool-bytes" in line


def test_up_missing_model_config(tmp_path: Path) -> None:
    line = usage_error(["up", "--embedded", "--model", str(tmp_path)])
    assert "--model" in line and "config.json" in line


def test_unknown_command() -> None:
    assert "unknown command 'serve'; choose one of up, demo" in usage_error(["serve"])


def test_version() -> None:
    from pagedkv import __version__

    done = subprocess.run([*PAGEDKV, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"pagedkv {__version__}"


# -- security flags (one set on every command) ------------------------------------------------


@pytest.mark.parametrize("role", [NODE, COORDINATOR])
def test_a_certificate_without_its_key(role: list[str], tmp_path: Path) -> None:
    cert = tmp_path / "tls.crt"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    line = usage_error(
        [*role, "--num-blocks", "4", "--tls-cert", str(cert)]
        if role is NODE
        else [*role, "--tls-cert", str(cert)]
    )
    assert "TLS needs both a certificate and its key (--tls-cert and --tls-key)" in line


@pytest.mark.parametrize("role", [NODE, COORDINATOR])
def test_a_missing_tls_file(role: list[str], tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    extra = ["--num-blocks", "4"] if role is NODE else []
    line = usage_error([*role, *extra, "--tls-cert", missing, "--tls-key", missing])
    assert f"TLS certificate {missing}: No such file or directory" in line


def test_mutual_tls_without_a_ca() -> None:
    line = usage_error([*COORDINATOR, "--tls-client-auth", "require"])
    assert "mutual TLS (--tls-client-auth require) needs --tls-ca" in line


def test_a_short_cluster_secret(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("short\n")
    line = usage_error([*COORDINATOR, "--cluster-secret-file", str(secret)])
    assert "is too short (at least 32" in line and "openssl rand -hex 32" in line
    line = usage_error([*COORDINATOR], env={"PAGEDKV_CLUSTER_SECRET": "short"})
    assert "$PAGEDKV_CLUSTER_SECRET" in line and "too short" in line


def test_a_missing_cluster_secret_file(tmp_path: Path) -> None:
    line = usage_error(
        [
            *NODE,
            "--num-blocks",
            "4",
            "--coordinator",
            "127.0.0.1:9",
            "--cluster-secret-file",
            str(tmp_path / "x"),
        ]
    )
    assert "cluster secret file" in line and "No such file" in line


def test_a_node_token_in_a_cluster(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    line = usage_error(
        [*NODE, "--num-blocks", "4", "--coordinator", "127.0.0.1:9", "--token-file", str(token)]
    )
    assert "--token-file is for a standalone node" in line

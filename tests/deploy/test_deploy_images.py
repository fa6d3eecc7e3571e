"""Static checks of the images and compose files in deploy/ (Dockerfiles, .dockerignore, the
torch pin, docker compose and its GPU and TLS overrides, tenants files); `docker-compose config`
when installed."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from deploy_helpers import (
    COORDINATOR_ENV,
    DEPLOY,
    IMAGE_ENV,
    K8S,
    NODE_ENV,
    ROOT,
    TLS_ENV,
    TORCH_PIN,
    find_tool,
    run_tool,
    yaml,
)

# ------------------------------------------------------------------------------------------------
# Dockerfiles and .dockerignore


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile(name: str) -> None:
    text = (DEPLOY / name).read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert TORCH_PIN in text, f"{name} must pin {TORCH_PIN}"
    assert not re.search(r"torch(?!==2\.13\.0)[=<>~!]=?\s*\d", text), f"{name}: another torch version"
    # the last USER of the final stage is a non-root one
    users = [ln.split()[1] for ln in lines if ln.upper().startswith("USER ")]
    assert users, f"{name} has no USER"
    assert users[-1].split(":")[0] not in ("root", "0"), f"{name} runs as root"
    health = [ln for ln in lines if ln.upper().startswith("HEALTHCHECK")]
    assert health, f"{name} has no HEALTHCHECK"
    assert "pagedkv health" in text
    assert 'ENTRYPOINT ["pagedkv"]' in text
    exposed = {int(p) for ln in lines if ln.upper().startswith("EXPOSE ") for p in ln.split()[1:]}
    assert {50051, 9400} <= exposed
    if name == "Dockerfile":
        assert {50049, 50050, 9401} <= exposed
        assert re.search(r"^FROM python:3\.11-slim|ARG PYTHON_IMAGE=python:3\.11-slim", text, re.M)
        assert "https://download.pytorch.org/whl/cpu" in text
    else:
        assert re.search(r"nvidia/cuda:[\w.\-]*runtime", text)
    # every file the image COPYs exists, and .dockerignore does not exclude it
    for ln in lines:
        if ln.upper().startswith("COPY ") and "--from" not in ln:
            for src in ln.split()[1:-1]:
                assert (ROOT / src).exists(), f"{name} copies {src}, which does not exist"


def test_constraints_pin_the_same_torch() -> None:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pins = [ln.strip() for ln in lines if ln.startswith("torch")]
    assert pins == [TORCH_PIN]
    assert "torch==" not in (ROOT / "pyproject.toml").read_text()  # the package itself declares a range


def test_dockerignore() -> None:
    entries = {
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    }
    for needed in (".venv", ".git", "bench/results", "tests", ".pytest_cache", "**/__pycache__"):
        assert needed in entries, f".dockerignore should exclude {needed}"
    for kept in ("pagedkv", "protos", "cache_node", "client", "coordinator", "pyproject.toml", "README.md"):
        assert kept not in entries, f".dockerignore excludes {kept}, which the image needs"


# ------------------------------------------------------------------------------------------------
# docker compose


def _compose_config(*files: str) -> dict:
    exe = find_tool("docker-compose", "docker-compose")
    args = [exe]
    for f in files:
        args += ["-f", str(DEPLOY / f)]
    return yaml.safe_load(run_tool([*args, "config"]).stdout)


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _published(service: dict) -> set[tuple[int, int]]:
    out = set()
    for port in service.get("ports", []):
        if isinstance(port, dict):
            out.add((int(port["published"]), int(port["target"])))
        else:
            *_, published, target = str(port).split("/")[0].split(":")
            out.add((int(published), int(target)))
    return out


def test_compose_config() -> None:
    cfg = _compose_config("compose.yaml")
    services = cfg["services"]
    assert set(services) >= {"redis", "coordinator", "node-0", "node-1", "prometheus", "grafana"}

    redis = services["redis"]
    cmd = " ".join(redis["command"]) if isinstance(redis["command"], list) else redis["command"]
    assert "--appendonly yes" in cmd, "Redis AOF persistence must be on"
    assert any(str(v).endswith(":/data") or ":/data:" in str(v) for v in redis["volumes"]), redis["volumes"]

    coord = services["coordinator"]
    assert coord["command"] == ["coordinator"]
    assert _env(coord).keys() >= COORDINATOR_ENV
    assert set(_env(coord)) <= COORDINATOR_ENV | IMAGE_ENV
    assert _env(coord)["PAGEDKV_REDIS_URL"] == "redis://redis:6379/0"
    assert _env(coord)["PAGEDKV_LISTEN"].endswith(":50050")
    assert _env(coord)["PAGEDKV_METRICS_PORT"] == "9401"
    assert (50050, 50050) in _published(coord)
    assert _env(coord)["PAGEDKV_FRAME_PORT"] == "50049" and (50049, 50049) in _published(coord)
    assert coord["depends_on"]["redis"]["condition"] == "service_healthy"
    assert coord["healthcheck"]["test"][:3] == ["CMD", "pagedkv", "health"]
    assert coord["healthcheck"]["test"][3].endswith(":50050")
    tenants = [v for v in coord["volumes"] if "/etc/pagedkv/tenants.json" in str(v)]
    assert tenants and str(tenants[0]).endswith(":ro")
    secret_path = "/run/secrets/pagedkv-cluster-secret"
    assert "pagedkv-cluster-secret" in cfg["secrets"], "the cluster secret is a compose secret"
    assert Path(DEPLOY / "cluster-secret.example").exists()

    for i, name in enumerate(["node-0", "node-1"]):
        node = services[name]
        env = _env(node)
        assert node["command"] == ["node"]
        assert env.keys() == NODE_ENV, sorted(set(env) ^ NODE_ENV)
        assert env["PAGEDKV_ADVERTISE"] == f"{name}:50051", "each node advertises its own service name"
        assert env["PAGEDKV_COORDINATOR"] == "coordinator:50050"
        assert env["PAGEDKV_METRICS_PORT"] == "9400"
        assert env["PAGEDKV_POLICY"] in {"lru", "lfu", "score"}
        assert env["PAGEDKV_CLUSTER_SECRET_FILE"] == secret_path
        assert (50051 + i, 50051) in _published(node)
        assert node["depends_on"]["coordinator"]["condition"] == "service_healthy"
        assert node["healthcheck"]["test"] == ["CMD", "pagedkv", "health", "127.0.0.1:50051"]
        assert node["image"] == coord["image"], "one image for node and coordinator"
        assert node["build"]["dockerfile"] == "deploy/Dockerfile"

    assert _env(coord)["PAGEDKV_CLUSTER_SECRET_FILE"] == secret_path
    for name in ("coordinator", "node-0", "node-1"):  # the same secret for all three
        assert [s if isinstance(s, str) else s["source"] for s in services[name]["secrets"]] == [
            "pagedkv-cluster-secret"
        ]
    for name, svc in services.items():
        assert svc.get("restart") in {"unless-stopped", "always"}, f"{name} has no restart policy"
        assert "healthcheck" in svc, f"{name} has no healthcheck"
    assert (9090, 9090) in _published(services["prometheus"])
    assert (3000, 3000) in _published(services["grafana"])
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    mounts = " ".join(map(str, services["grafana"]["volumes"]))
    assert "grafana/provisioning:/etc/grafana/provisioning" in mounts
    assert "grafana/dashboards:/var/lib/grafana/dashboards" in mounts
    assert "prometheus/prometheus.yml:/etc/prometheus/prometheus.yml" in " ".join(
        map(str, services["prometheus"]["volumes"])
    )
    # bind-mounted files exist
    for svc in services.values():
        for vol in svc.get("volumes", []):
            src = str(vol).split(":")[0]
            if src.startswith("/"):
                assert Path(src).exists(), f"bind mount source {src} is missing"


def test_compose_gpu_override() -> None:
    services = _compose_config("compose.yaml", "compose.gpu.yaml")["services"]
    for name in ("node-0", "node-1"):
        node = services[name]
        assert node["build"]["dockerfile"] == "deploy/Dockerfile.cuda"
        assert _env(node)["PAGEDKV_DEVICE"] == "cuda"
        devices = node["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
    ids = [
        services[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for n in ("node-0", "node-1")
    ]
    assert ids[0] != ids[1], "one GPU per node"
    assert services["coordinator"]["build"]["dockerfile"] == "deploy/Dockerfile"


def test_compose_tls_override() -> None:
    """deploy/compose.tls.yaml puts every pagedkv service on TLS, with the same files."""
    override = yaml.safe_load((DEPLOY / "compose.tls.yaml").read_text())
    for name in ("coordinator", "node-0", "node-1"):
        svc = override["services"][name]
        assert set(svc["environment"]) == TLS_ENV, name
        assert svc["environment"]["PAGEDKV_TLS_CA"].startswith("/etc/pagedkv/tls/")
        assert any(str(v).endswith(":/etc/pagedkv/tls:ro") for v in svc["volumes"]), name
    script = (DEPLOY / "tls" / "make-certs.sh").read_text()
    for name in ("coordinator", "node-0", "node-1", "127.0.0.1"):  # the names the services are dialled by
        assert name in script
    if shutil.which("docker-compose") or shutil.which("docker"):
        services = _compose_config("compose.yaml", "compose.tls.yaml")["services"]
        env = set(_env(services["node-0"]))
        assert env >= TLS_ENV and env >= NODE_ENV


def test_tenants_files() -> None:
    for path in (DEPLOY / "tenants.example.json", K8S / "tenants.json"):
        data = json.loads(path.read_text())
        assert set(data) == {"tokens", "quotas"}, path
        assert data["tokens"] and all(
            isinstance(k, str) and isinstance(v, str) for k, v in data["tokens"].items()
        )
        assert set(data["tokens"].values()) <= set(data["quotas"]), f"{path}: a tenant without a quota"
        assert all(isinstance(q, int) and q > 0 for q in data["quotas"].values())

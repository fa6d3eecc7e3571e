"""Static checks of deploy/: what CI can validate without a container engine or a cluster.

Fast and offline. Tools are used when installed and skipped with the reason otherwise:
docker-compose (`docker-compose config`), promtool (Debian package `prometheus`) and kubectl
(`kubectl kustomize`).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is in the dev extra: pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"

# The metric names the runtime exports (DESIGN.md "Contracts"; the deploy brief's list).
METRICS = {
    "pagedkv_kv_usage_ratio",
    "pagedkv_blocks",
    "pagedkv_prefix_cache_queries_tokens_total",
    "pagedkv_prefix_cache_hits_tokens_total",
    "pagedkv_evictions_total",
    "pagedkv_swaps_total",
    "pagedkv_sequences",
    "pagedkv_rpc_latency_seconds",
    "pagedkv_rpc_errors_total",
    "pagedkv_coordinator_nodes_live",
    "pagedkv_coordinator_open_total",
    "pagedkv_coordinator_cached_tokens_total",
    # tests/deploy/test_observability.py checks each of these against a running process
    "pagedkv_prefix_cache_host_hits_tokens_total",
    "pagedkv_swap_bytes_total",
    "pagedkv_node_info",
    "pagedkv_coordinator_info",
    "pagedkv_coordinator_nodes_suspect",
    "pagedkv_coordinator_tenant_open_total",
    "pagedkv_coordinator_tenant_prompt_tokens_total",
    "pagedkv_coordinator_tenant_cached_tokens_total",
    "pagedkv_coordinator_tenant_used_blocks",
    "pagedkv_coordinator_tenant_quota_blocks",
    "pagedkv_coordinator_redis_latency_seconds",
    "pagedkv_coordinator_redis_errors_total",
}
HISTOGRAMS = {"pagedkv_rpc_latency_seconds", "pagedkv_coordinator_redis_latency_seconds"}
# A histogram is queried through its series; a bare histogram name is not a series.
SERIES = (METRICS - HISTOGRAMS) | {f"{h}{s}" for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}

COORDINATOR_ENV = {
    "PAGEDKV_LISTEN",
    "PAGEDKV_REDIS_URL",
    "PAGEDKV_METRICS_PORT",
    "PAGEDKV_TENANTS_FILE",
    "PAGEDKV_LEASE_TTL_S",
    "PAGEDKV_CLUSTER_SECRET_FILE",
}
NODE_ENV = {
    "PAGEDKV_LISTEN",
    "PAGEDKV_ADVERTISE",
    "PAGEDKV_COORDINATOR",
    "PAGEDKV_METRICS_PORT",
    "PAGEDKV_NUM_LAYERS",
    "PAGEDKV_NUM_KV_HEADS",
    "PAGEDKV_HEAD_DIM",
    "PAGEDKV_DTYPE",
    "PAGEDKV_BLOCK_SIZE",
    "PAGEDKV_POOL_BYTES",
    "PAGEDKV_HOST_BYTES",
    "PAGEDKV_POLICY",
    "PAGEDKV_DEVICE",
    "PAGEDKV_CLUSTER_SECRET_FILE",
}
TLS_ENV = {"PAGEDKV_TLS_CERT", "PAGEDKV_TLS_KEY", "PAGEDKV_TLS_CA", "PAGEDKV_TLS_CLIENT_AUTH"}
IMAGE_ENV = {"PAGEDKV_KERNEL_DIR", "PAGEDKV_ATTENTION_BACKEND", "PAGEDKV_HEALTH_ADDR"}
METRIC_RE = re.compile(r"\bpagedkv_\w+")
TORCH_PIN = "torch==2.13.0"


def _run(cmd: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (Debian: apt-get install -y {package})")
    return path


def _check_metric_names(expr: str, where: str) -> None:
    names = set(METRIC_RE.findall(expr))
    unknown = names - SERIES
    assert not unknown, f"{where}: unknown metric names {sorted(unknown)} in {expr!r}"


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
        assert {50050, 9401} <= exposed
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
    exe = _tool("docker-compose", "docker-compose")
    args = [exe]
    for f in files:
        args += ["-f", str(DEPLOY / f)]
    return yaml.safe_load(_run([*args, "config"]).stdout)


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


# ------------------------------------------------------------------------------------------------
# Prometheus


def test_prometheus_config_promtool() -> None:
    promtool = _tool("promtool", "prometheus")
    _run([promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")])
    _run([promtool, "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")])


def test_prometheus_scrapes_every_metrics_endpoint() -> None:
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {
        t for job in cfg["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]
    }
    assert {"coordinator:9401", "node-0:9400", "node-1:9400"} <= targets
    k8s = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-k8s.yml").read_text())
    job = k8s["scrape_configs"][0]
    assert job["kubernetes_sd_configs"][0]["role"] == "pod"
    sources = {tuple(r.get("source_labels", [])) for r in job["relabel_configs"]}
    assert ("__meta_kubernetes_pod_annotation_prometheus_io_scrape",) in sources


def test_alert_rules_use_known_metrics() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            _check_metric_names(rule["expr"], f"alert {rule['alert']}")


# ------------------------------------------------------------------------------------------------
# Grafana


def _dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "dashboards" / "pagedkv.json").read_text())


def _exprs(dash: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def test_dashboard_uses_only_known_metrics() -> None:
    dash = _dashboard()
    exprs = _exprs(dash)
    assert exprs
    for title, expr in exprs:
        assert METRIC_RE.search(expr), f"panel {title!r} queries no pagedkv metric"
        _check_metric_names(expr, f"panel {title!r}")
    for var in dash["templating"]["list"]:
        _check_metric_names(json.dumps(var.get("query", "")), f"variable {var['name']}")
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_dashboard_has_the_required_panels() -> None:
    text = "\n".join(expr for _, expr in _exprs(_dashboard()))
    assert "pagedkv_kv_usage_ratio" in text
    assert re.search(
        r"rate\(pagedkv_prefix_cache_hits_tokens_total[^/]*\)\)\s*/\s*sum[^(]*\(rate\(pagedkv_prefix_cache_queries_tokens_total",
        text,
    ), "hit rate = rate(hits) / rate(queries)"
    assert re.search(r"by \(policy, tier\) \(rate\(pagedkv_evictions_total", text)
    assert re.search(r"rate\(pagedkv_swaps_total", text)
    for q in ("0.5", "0.99"):
        assert re.search(
            rf"histogram_quantile\({q}, sum by \(le, method\) \(rate\(pagedkv_rpc_latency_seconds_bucket",
            text,
        )
    assert "pagedkv_coordinator_nodes_live" in text


def test_dashboard_promql_parses(tmp_path: Path) -> None:
    """Every panel query, with Grafana's variables substituted, is valid PromQL for promtool."""
    promtool = _tool("promtool", "prometheus")
    rules = []
    for i, (_, expr) in enumerate(_exprs(_dashboard())):
        expr = expr.replace("$__rate_interval", "1m").replace("$instance", ".*")
        rules.append({"record": f"pagedkv:panel_{i}", "expr": expr})
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    _run([promtool, "check", "rules", str(path)])


def test_grafana_provisioning() -> None:
    prov = DEPLOY / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((prov / "dashboards" / "pagedkv.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    uids = {json.dumps(p.get("datasource")) for p in _dashboard()["panels"]}
    assert uids == {json.dumps({"type": "prometheus", "uid": ds["uid"]})}, (
        "panels use the provisioned datasource"
    )


# ------------------------------------------------------------------------------------------------
# Kubernetes


def _k8s_docs() -> dict[tuple[str, str], dict]:
    docs: dict[tuple[str, str], dict] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None:
                continue
            if path.name == "kustomization.yaml":
                continue
            assert {"apiVersion", "kind", "metadata"} <= set(doc), f"{path.name}: incomplete object"
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def _container(doc: dict) -> dict:
    containers = doc["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _env_names(c: dict) -> set[str]:
    return {e["name"] for e in c.get("env", [])}


def _assert_grpc_probes(c: dict, port: int) -> None:
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["grpc"]["port"] == port, f"{c['name']}: {probe} must be a gRPC probe on {port}"


def _assert_hardened(doc: dict) -> None:
    pod = doc["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    c = pod["containers"][0]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["resources"]["limits"]["memory"]


def test_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files
    assert kust["namespace"] == "pagedkv"
    gens = {g["name"]: g for g in kust["secretGenerator"]}
    assert gens["pagedkv-tenants"]["files"] == ["tenants.json"]
    assert (K8S / "tenants.json").exists()
    assert "pagedkv-redis" in gens
    assert gens["pagedkv-cluster"]["literals"][0].startswith("secret="), "the cluster secret is a Secret"


def test_k8s_redis() -> None:
    docs = _k8s_docs()
    sts = docs[("StatefulSet", "pagedkv-redis")]
    c = _container(sts)
    assert c["image"].startswith("redis:")
    assert "--appendonly" in c["args"] and c["args"][c["args"].index("--appendonly") + 1] == "yes"
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
    assert any(m["mountPath"] == "/data" for m in c["volumeMounts"])
    assert {p["containerPort"] for p in c["ports"]} == {6379}
    assert c["readinessProbe"] and c["livenessProbe"]
    assert docs[("Service", "pagedkv-redis")]["spec"]["ports"][0]["port"] == 6379
    _assert_hardened(sts)


def test_k8s_coordinator() -> None:
    docs = _k8s_docs()
    dep = docs[("Deployment", "pagedkv-coordinator")]
    c = _container(dep)
    assert c["image"].split(":")[0] == "pagedkv", "the coordinator runs from the CPU image"
    assert c["args"] == ["coordinator"]
    assert _env_names(c) - {"REDIS_PASSWORD"} == COORDINATOR_ENV
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["PAGEDKV_REDIS_URL"].endswith("@pagedkv-redis:6379/0")
    assert "$(REDIS_PASSWORD)" in env["PAGEDKV_REDIS_URL"]
    names = [e["name"] for e in c["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("PAGEDKV_REDIS_URL"), "$(VAR) needs VAR defined first"
    assert {p["containerPort"] for p in c["ports"]} == {50050, 9401}
    _assert_grpc_probes(c, 50050)
    _assert_hardened(dep)
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9401"
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/pagedkv")
    assert vols[mount["name"]]["secret"]["secretName"] == "pagedkv-tenants", "tenants come from a Secret"
    assert env["PAGEDKV_TENANTS_FILE"] == "/etc/pagedkv/tenants.json"
    _assert_cluster_secret(dep, c)
    svc = docs[("Service", "pagedkv-coordinator")]
    assert {p["port"] for p in svc["spec"]["ports"]} == {50050, 9401}


def test_k8s_nodes() -> None:
    docs = _k8s_docs()
    sts = docs[("StatefulSet", "pagedkv-node")]
    svc = docs[("Service", "pagedkv-node")]
    assert svc["spec"]["clusterIP"] == "None", "nodes need a headless Service for stable DNS names"
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    c = _container(sts)
    assert c["image"].startswith("pagedkv-cuda:")
    assert c["args"] == ["node"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1, "one GPU per node"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["cpu"]
    _assert_grpc_probes(c, 50051)
    _assert_hardened(sts)
    assert {p["containerPort"] for p in c["ports"]} == {50051, 9400}

    env = {e["name"]: e for e in c["env"]}
    config = docs[("ConfigMap", "pagedkv-node-config")]["data"]
    assert c["envFrom"][0]["configMapRef"]["name"] == "pagedkv-node-config"
    all_env = (set(env) - {"POD_NAME", "POD_NAMESPACE"}) | set(config)
    assert all_env == NODE_ENV, sorted(all_env ^ NODE_ENV)
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    advertise = env["PAGEDKV_ADVERTISE"]["value"]
    assert advertise.startswith("$(POD_NAME).pagedkv-node.") and advertise.endswith(":50051")
    assert env["PAGEDKV_COORDINATOR"]["value"] == "pagedkv-coordinator:50050"
    assert config["PAGEDKV_POLICY"] in {"lru", "lfu", "score"}
    ann = sts["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9400"
    _assert_cluster_secret(sts, c)


def _assert_cluster_secret(doc: dict, c: dict) -> None:
    env = {e["name"]: e.get("value") for e in c["env"]}
    path = env["PAGEDKV_CLUSTER_SECRET_FILE"]
    mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    vols = {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}
    assert vols[mount["name"]]["secret"]["secretName"] == "pagedkv-cluster"
    assert path.rsplit("/", 1)[1] == "secret", "the generator's literal key is the file name"


def test_k8s_tls_component() -> None:
    """deploy/k8s/tls: TLS env, the certificate Secret mounted, exec probes (native gRPC probes
    cannot speak TLS) on the right ports, a certificate for every name dialled."""
    comp = K8S / "tls"
    kust = yaml.safe_load((comp / "kustomization.yaml").read_text())
    assert kust["kind"] == "Component"
    for patch in kust["patches"]:
        ops = yaml.safe_load((comp / patch["path"]).read_text())
        port = 50050 if patch["target"]["kind"] == "Deployment" else 50051
        env = {op["value"]["name"] for op in ops if op["path"].endswith("/env/-")}
        assert env == TLS_ENV - {"PAGEDKV_TLS_CLIENT_AUTH"}, patch["path"]
        probes = [op for op in ops if op["path"].endswith("Probe")]
        assert len(probes) == 3
        for op in probes:
            assert op["value"]["exec"]["command"][:2] == ["pagedkv", "health"]
            assert op["value"]["exec"]["command"][-1] == f"127.0.0.1:{port}"
        vols = [op["value"] for op in ops if op["path"].endswith("/volumes/-")]
        assert vols == [{"name": "tls", "secret": {"secretName": "pagedkv-tls", "defaultMode": 0o440}}]
    certs = {d["metadata"]["name"]: d for d in yaml.safe_load_all((comp / "certificates.yaml").read_text())}
    tls = certs["pagedkv-tls"]["spec"]
    assert tls["secretName"] == "pagedkv-tls" and "127.0.0.1" in tls["ipAddresses"]
    assert {"pagedkv-coordinator", "*.pagedkv-node.pagedkv.svc"} <= set(tls["dnsNames"])
    for path in comp.glob("*.yaml"):
        for name in re.findall(r"\b(PAGEDKV_[A-Z0-9_]+)\b", path.read_text()):
            assert name in COORDINATOR_ENV | NODE_ENV | TLS_ENV | IMAGE_ENV, f"{path.name}: unknown {name}"


def test_k8s_env_names_are_known() -> None:
    """No manifest sets a PAGEDKV_* variable the runtime does not read (a typo would be silent)."""
    known = COORDINATOR_ENV | NODE_ENV | IMAGE_ENV | TLS_ENV
    for path in K8S.glob("*.yaml"):
        for name in re.findall(r"\b(PAGEDKV_[A-Z0-9_]+)\b", path.read_text()):
            assert name in known, f"{path.name}: unknown variable {name}"
    for path in (DEPLOY / "compose.yaml", DEPLOY / "compose.gpu.yaml", DEPLOY / "compose.tls.yaml"):
        text = path.read_text()
        for name in re.findall(r"^\s+(PAGEDKV_[A-Z0-9_]+):", text, re.M):
            assert name in known, f"{path.name}: unknown variable {name}"


def test_kubectl_kustomize_renders() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (optional: the other k8s tests parse the manifests directly)")
    rendered = list(yaml.safe_load_all(_run([kubectl, "kustomize", str(K8S)]).stdout))
    kinds = {
        (
            d["kind"],
            d["metadata"]["name"].rsplit("-", 1)[0] if d["kind"] == "Secret" else d["metadata"]["name"],
        )
        for d in rendered
    }
    assert ("Secret", "pagedkv-tenants") in kinds and ("StatefulSet", "pagedkv-node") in kinds
    assert all(d["metadata"].get("namespace") == "pagedkv" for d in rendered if d["kind"] != "Namespace")
    secret = next(
        d for d in rendered if d["kind"] == "Secret" and d["metadata"]["name"].startswith("pagedkv-tenants")
    )
    dep = next(d for d in rendered if d["kind"] == "Deployment")
    vols = dep["spec"]["template"]["spec"]["volumes"]
    assert any(v.get("secret", {}).get("secretName") == secret["metadata"]["name"] for v in vols), (
        "the generated (hashed) Secret name is wired into the coordinator"
    )


# ------------------------------------------------------------------------------------------------
# README sizing arithmetic


def test_readme_sizing_examples() -> None:
    text = (DEPLOY / "README.md").read_text()

    def bytes_per_block(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, block: int) -> int:
        return 2 * layers * kv_heads * head_dim * dtype_bytes * block

    b8 = bytes_per_block(32, 8, 128, 2, 16)
    b70 = bytes_per_block(80, 8, 128, 2, 16)
    assert b8 == 2 * 2**20 and 2**30 // b8 == 512
    assert b70 == 5 * 2**20 and 2**30 // b70 == 204
    for number in (
        f"{b8:,}",
        "**2 MiB**",
        "**512**",
        f"{b70:,}",
        "**5 MiB**",
        "**204**",
        f"{70 * 2**30 // b8:,}",
        f"{70 * 2**30 // b70:,}",
    ):
        assert number in text, f"deploy/README.md should state {number}"
    for var in COORDINATOR_ENV | NODE_ENV:
        assert f"`{var}`" in text, f"deploy/README.md does not document {var}"


def test_kubectl_kustomize_renders_with_tls(tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (optional: test_k8s_tls_component parses the patches)")
    shutil.copytree(K8S, tmp_path / "k8s")
    with open(tmp_path / "k8s" / "kustomization.yaml", "a") as f:
        f.write("\ncomponents:\n  - tls\n")
    rendered = list(yaml.safe_load_all(_run([kubectl, "kustomize", str(tmp_path / "k8s")]).stdout))
    for kind, port in (("Deployment", 50050), ("StatefulSet", 50051)):
        doc = next(d for d in rendered if d["kind"] == kind and d["metadata"]["name"].startswith("pagedkv-"))
        if kind == "StatefulSet" and doc["metadata"]["name"] == "pagedkv-redis":
            doc = next(d for d in rendered if d["kind"] == kind and d["metadata"]["name"] == "pagedkv-node")
        c = _container(doc)
        assert TLS_ENV - {"PAGEDKV_TLS_CLIENT_AUTH"} <= _env_names(c)
        assert c["readinessProbe"]["exec"]["command"][-1] == f"127.0.0.1:{port}"
    assert any(d["kind"] == "Certificate" and d["spec"]["secretName"] == "pagedkv-tls" for d in rendered)

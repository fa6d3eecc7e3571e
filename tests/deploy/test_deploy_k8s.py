"""Static checks of deploy/k8s (every manifest listed, probes, hardening, env names, the TLS
component; `kubectl kustomize` when installed) and of deploy/README's sizing arithmetic."""

from __future__ import annotations

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
    TLS_ENV,
    run_tool,
    yaml,
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
    assert {p["containerPort"] for p in c["ports"]} == {50049, 50050, 9401}
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
    assert {p["port"] for p in svc["spec"]["ports"]} == {50049, 50050, 9401}


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
    rendered = list(yaml.safe_load_all(run_tool([kubectl, "kustomize", str(K8S)]).stdout))
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
    rendered = list(yaml.safe_load_all(run_tool([kubectl, "kustomize", str(tmp_path / "k8s")]).stdout))
    for kind, port in (("Deployment", 50050), ("StatefulSet", 50051)):
        doc = next(d for d in rendered if d["kind"] == kind and d["metadata"]["name"].startswith("pagedkv-"))
        if kind == "StatefulSet" and doc["metadata"]["name"] == "pagedkv-redis":
            doc = next(d for d in rendered if d["kind"] == kind and d["metadata"]["name"] == "pagedkv-node")
        c = _container(doc)
        assert TLS_ENV - {"PAGEDKV_TLS_CLIENT_AUTH"} <= _env_names(c)
        assert c["readinessProbe"]["exec"]["command"][-1] == f"127.0.0.1:{port}"
    assert any(d["kind"] == "Certificate" and d["spec"]["secretName"] == "pagedkv-tls" for d in rendered)

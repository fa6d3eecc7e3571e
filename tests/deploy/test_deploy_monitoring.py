"""Static checks of deploy/'s Prometheus and Grafana files: every metric name they use is one the
runtime exports, every endpoint is scraped, the dashboard has its panels; promtool when installed."""

from __future__ import annotations

import json
import re
from pathlib import Path

from deploy_helpers import (
    DEPLOY,
    METRIC_RE,
    check_metric_names,
    find_tool,
    run_tool,
    yaml,
)

# ------------------------------------------------------------------------------------------------
# Prometheus


def test_prometheus_config_promtool() -> None:
    promtool = find_tool("promtool", "prometheus")
    run_tool([promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")])
    run_tool([promtool, "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")])


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
            check_metric_names(rule["expr"], f"alert {rule['alert']}")


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
        check_metric_names(expr, f"panel {title!r}")
    for var in dash["templating"]["list"]:
        check_metric_names(json.dumps(var.get("query", "")), f"variable {var['name']}")
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
    promtool = find_tool("promtool", "prometheus")
    rules = []
    for i, (_, expr) in enumerate(_exprs(_dashboard())):
        expr = expr.replace("$__rate_interval", "1m").replace("$instance", ".*")
        rules.append({"record": f"pagedkv:panel_{i}", "expr": expr})
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    run_tool([promtool, "check", "rules", str(path)])


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

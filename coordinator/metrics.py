"""Prometheus metrics of the coordinator (`pagedkv_coordinator_*`), in a private
registry. Counters are read from the Coordinator at scrape time (kept once);
RPC latency and errors are recorded as they happen."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .core import Coordinator

LATENCY_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)


class CoordinatorCollector(Collector):
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def collect(self) -> Iterator[Metric]:
        c = self.coordinator.counters
        live = GaugeMetricFamily("pagedkv_coordinator_nodes_live", "Cache nodes with a live lease.")
        live.add_metric([], self.coordinator.num_live_nodes())
        yield live
        opens = CounterMetricFamily("pagedkv_coordinator_open", "Sequences opened through the coordinator.")
        opens.add_metric([], c["opens"])
        yield opens
        prompt = CounterMetricFamily(
            "pagedkv_coordinator_prompt_tokens", "Prompt tokens of opened sequences."
        )
        prompt.add_metric([], c["prompt_tokens"])
        yield prompt
        cached = CounterMetricFamily(
            "pagedkv_coordinator_cached_tokens", "Prompt tokens served from a node's prefix cache at open."
        )
        cached.add_metric([], c["cached_tokens"])
        yield cached
        misses = CounterMetricFamily(
            "pagedkv_coordinator_open_misses",
            "Opens whose prompt missed the prefix cache, by why its first uncached block missed.",
            labels=["reason"],
        )
        for reason in ("in_flight", "other_node", "evicted", "not_cached"):
            misses.add_metric([reason], c["misses_" + reason])
        yield misses
        reaped = CounterMetricFamily(
            "pagedkv_coordinator_nodes_reaped", "Nodes declared dead (lease lapsed)."
        )
        reaped.add_metric([], c["nodes_reaped"])
        yield reaped


class CoordinatorMetrics:
    def __init__(self, coordinator: Coordinator, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.registry.register(CoordinatorCollector(coordinator))
        self.rpc_latency = Histogram(
            "pagedkv_coordinator_rpc_latency_seconds",
            "Coordinator RPC latency by method.",
            ["method"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.rpc_errors = Counter(
            "pagedkv_coordinator_rpc_errors", "Failed coordinator RPCs by method and status code.",
            ["method", "code"], registry=self.registry,
        )  # fmt: skip

    def observe(self, method: str, seconds: float, code: str) -> None:
        self.rpc_latency.labels(method).observe(seconds)
        if code != "OK":
            self.rpc_errors.labels(method, code).inc()

"""Prometheus metrics of one cache node, in vLLM/SGLang style (`pagedkv_*`).

Everything lives in a dedicated CollectorRegistry that is passed in (never the
global one), so several nodes in one process (tests) never collide. Block
counts and cache counters are read from `engine.stats()` at scrape time by a
custom collector: the engine keeps its numbers once and the metrics never
drift from them. Only what the engine cannot know -- RPC latency and errors --
is recorded here as it happens. `describe()` adds what the process is (version, model spec,
device, policy) as `pagedkv_node_info`, as vLLM's cache_config_info does, and the block size
in bytes that turns block counters into byte counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

# Latency buckets from 50 us (Ping on loopback) to 10 s (a large Append).
LATENCY_BUCKETS_S = (
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

_BLOCK_STATES = {
    "free": "free_blocks",
    "cached": "cached_blocks",
    "used": "used_blocks",
    "host_free": "host_free_blocks",
    "host_cached": "host_cached_blocks",
    "host_used": "host_used_blocks",
}


class EngineCollector(Collector):
    """Gauges and counters derived from a stats() snapshot at scrape time."""

    def __init__(
        self, stats: Callable[[], dict[str, int]], policy: str, bytes_per_block: Callable[[], int] = lambda: 0
    ) -> None:
        self._stats = stats
        self._policy = policy
        self._bytes_per_block = bytes_per_block

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        usage = GaugeMetricFamily(
            "pagedkv_kv_usage_ratio", "Fraction of device KV blocks referenced by live sequences (0-1)."
        )
        usage.add_metric([], s["used_blocks"] / s["num_blocks"] if s["num_blocks"] else 0.0)
        yield usage
        blocks = GaugeMetricFamily("pagedkv_blocks", "KV blocks by state and tier.", labels=["state"])
        for state, key in _BLOCK_STATES.items():
            blocks.add_metric([state], s[key])
        yield blocks
        capacity = GaugeMetricFamily("pagedkv_capacity_blocks", "KV blocks preallocated.", labels=["tier"])
        capacity.add_metric(["device"], s["num_blocks"])
        capacity.add_metric(["host"], s["host_blocks"])
        yield capacity
        seqs = GaugeMetricFamily("pagedkv_sequences", "Sequences open on this node.")
        seqs.add_metric([], s["num_sequences"])
        yield seqs
        swapped = GaugeMetricFamily("pagedkv_sequences_swapped", "Sequences swapped out to host memory.")
        swapped.add_metric([], s["num_swapped"])
        yield swapped
        yield _counter(
            "pagedkv_prefix_cache_queries_tokens",
            "Prompt tokens looked up in the prefix cache.",
            s["prefix_query_tokens"],
        )
        yield _counter(
            "pagedkv_prefix_cache_hits_tokens",
            "Prompt tokens served from the prefix cache.",
            s["prefix_hit_tokens"],
        )
        yield _counter(
            "pagedkv_prefix_cache_host_hits_tokens",
            "Prompt tokens of prefix hits copied back from the host tier (a subset of the hits).",
            s["prefix_host_hit_tokens"],
        )
        evictions = CounterMetricFamily(
            "pagedkv_evictions", "Cached blocks evicted, by policy and tier.", labels=["policy", "tier"]
        )
        evictions.add_metric([self._policy, "device_to_host"], s["evicted_to_host"])
        evictions.add_metric([self._policy, "device_dropped"], s["evicted_device_dropped"])
        evictions.add_metric(["lru", "host_dropped"], s["evicted_host_dropped"])  # the host tier is LRU
        yield evictions
        swaps = CounterMetricFamily("pagedkv_swaps", "Blocks copied by sequence swaps.", labels=["direction"])
        swaps.add_metric(["in"], s["swap_in_blocks"])
        swaps.add_metric(["out"], s["swap_out_blocks"])
        yield swaps
        if block_bytes := self._bytes_per_block():
            swap_bytes = CounterMetricFamily(
                "pagedkv_swap_bytes", "KV bytes copied by sequence swaps.", labels=["direction"]
            )
            swap_bytes.add_metric(["in"], s["swap_in_blocks"] * block_bytes)
            swap_bytes.add_metric(["out"], s["swap_out_blocks"] * block_bytes)
            yield swap_bytes
        yield _counter("pagedkv_cow_copies", "Shared partial blocks copied on write.", s["cow_copies"])
        yield _counter(
            "pagedkv_budget_dropped_blocks",
            "Blocks dropped by lossy token budgets.",
            s["budget_dropped_blocks"],
        )
        yield _counter(
            "pagedkv_window_released_blocks",
            "Blocks released because they fell outside every layer's sliding window or chunk.",
            s["window_released_blocks"],
        )


class Info(Collector):
    """One constant info metric (`pagedkv_node_info{...} 1`)."""

    def __init__(
        self, labels: dict[str, str], name: str = "pagedkv_node", doc: str = "What this node serves."
    ) -> None:
        self.labels, self.name, self.doc = labels, name, doc

    def collect(self) -> Iterator[Metric]:
        info = InfoMetricFamily(self.name, self.doc)
        info.add_metric([], self.labels)
        yield info


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc)
    c.add_metric([], value)
    return c


class NodeMetrics:
    """A node's metrics in their own registry; the server records RPCs here."""

    def __init__(
        self,
        stats: Callable[[], dict[str, int]] | None = None,
        *,
        policy: str = "",
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.rpc_latency = Histogram(
            "pagedkv_rpc_latency_seconds",
            "Server-side RPC latency, by method.",
            ["method"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.rpc_errors = Counter(
            "pagedkv_rpc_errors",
            "RPCs that failed, by method and status code.",
            ["method", "code"],
            registry=self.registry,
        )
        self._engine_attached = False
        self.bytes_per_block = 0  # set by describe(); 0: no byte counters
        self._info: Info | None = None
        if stats is not None:
            self.attach_engine(stats, policy)

    def attach_engine(self, stats: Callable[[], dict[str, int]], policy: str) -> None:
        """Derive the block/cache metrics from `stats()` at scrape time (once per registry)."""
        if not self._engine_attached:
            self.registry.register(EngineCollector(stats, policy, lambda: self.bytes_per_block))
            self._engine_attached = True

    def describe(
        self, *, version: str, spec: dict[str, Any], bytes_per_block: int, device: str, policy: str
    ) -> None:
        """Export `pagedkv_node_info` (value 1, the labels say what this node is) and enable the
        byte counters. Once per registry."""
        self.bytes_per_block = bytes_per_block
        if self._info is None:
            self._info = Info(
                labels={
                    "version": version,
                    "device": device,
                    "policy": policy,
                    **{k: str(v) for k, v in spec.items()},
                }
            )
            self.registry.register(self._info)

    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Serve /metrics over HTTP on its own port; returns (http server, thread)."""
        return start_http_server(port, addr=addr, registry=self.registry)

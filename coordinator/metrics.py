"""Prometheus metrics of the coordinator (`pagedkv_coordinator_*`), in a private
registry. Counters are read from the Coordinator at scrape time (kept once);
RPC latency and errors, Redis call latency and errors, and per-tenant opens and
hits are recorded as they happen. At scrape time the store also answers the
suspect-node count and each known tenant's block use (one round trip each; a
store that is down leaves those out of the scrape and counts as a Redis error)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from ..protos.errors import PagedKVError
from .core import Coordinator
from .extents import EXTENDS_TO
from .misses import REASONS

LATENCY_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)


class CoordinatorCollector(Collector):
    def __init__(
        self,
        coordinator: Coordinator,
        tenants: Iterable[str] = (),
        quotas: Mapping[str, int] | None = None,
        info: Mapping[str, str] | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.tenants = sorted(set(tenants) | set(quotas or {}))
        self.quotas = dict(quotas or {})
        self.info = dict(info or {})

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
        host = CounterMetricFamily(
            "pagedkv_coordinator_host_hit_tokens",
            "Of the cached prompt tokens, those on the chosen node's host tier (copied back at open).",
        )
        host.add_metric([], c["host_hit_tokens"])
        yield host
        scans = CounterMetricFamily(
            "pagedkv_coordinator_scan_opens",
            "Opens placed as scans: long runs of a size the workload does not continue (placement.py).",
        )
        scans.add_metric([], c["scan_opens"])
        yield scans
        refs = CounterMetricFamily(
            "pagedkv_coordinator_ref_opens",
            "Opens that named their prompt's start by an earlier prompt's ref instead of sending it "
            '(coordinator/prompt_refs.py); outcome="unknown": refs not held, the open sent whole again.',
            labels=["outcome"],
        )
        refs.add_metric(["named"], c["ref_opens"])
        refs.add_metric(["unknown"], c["ref_unknown"])
        yield refs
        ref_tokens = CounterMetricFamily(
            "pagedkv_coordinator_ref_tokens", "Prompt tokens named by a ref instead of sent."
        )
        ref_tokens.add_metric([], c["ref_tokens"])
        yield ref_tokens
        misses = CounterMetricFamily(
            "pagedkv_coordinator_open_misses",
            "Opens whose prompt the chosen node's device did not serve whole, by why its first such "
            "block missed (coordinator/misses.py).",
            labels=["reason"],
        )
        for reason in REASONS[1:]:
            misses.add_metric([reason], c["misses_" + reason])
        yield misses
        spills = CounterMetricFamily(
            "pagedkv_coordinator_spills",
            "Extents added to sequences on another node (their node full, or their max extent size "
            "reached; coordinator/extents.py).",
        )
        spills.add_metric([], c["spills"])
        yield spills
        extends = CounterMetricFamily(
            "pagedkv_coordinator_extends",
            'Extends by the extent count they gave the sequence: extents="2" counts the sequences '
            'that spilled at all, extents="n" those that reached n extents.',
            labels=["extents"],
        )
        for key, value in sorted(c.items()):
            if key.startswith(EXTENDS_TO):
                extends.add_metric([key.removeprefix(EXTENDS_TO)], value)
        yield extends
        reaped = CounterMetricFamily(
            "pagedkv_coordinator_nodes_reaped", "Nodes declared dead (lease lapsed)."
        )
        reaped.add_metric([], c["nodes_reaped"])
        yield reaped
        reconciled = CounterMetricFamily(
            "pagedkv_coordinator_reconciled",
            "What reconciliation settled after a crash (coordinator/reconcile.py): orphans_freed, "
            "held by a node unknown to the store; ghosts_lost, in the store and held by no node.",
            labels=["action"],
        )
        for action in ("orphans_freed", "ghosts_lost"):
            reconciled.add_metric([action], self.coordinator.reconciler.counters[action])
        yield reconciled
        if self.info:
            info = InfoMetricFamily("pagedkv_coordinator", "What this coordinator runs (version, store).")
            info.add_metric([], self.info)
            yield info
        yield from self._from_store()

    def _from_store(self) -> Iterator[Metric]:
        store = self.coordinator.store
        try:
            suspects = len(store.expired_nodes())
            used = {t: store.tenant_usage(t) for t in self.tenants}
        except PagedKVError:
            return  # the store is down: its gauges are absent, not zero
        suspect = GaugeMetricFamily(
            "pagedkv_coordinator_nodes_suspect",
            "Registered nodes whose lease lapsed, not yet reaped (invisible to placement).",
        )
        suspect.add_metric([], suspects)
        yield suspect
        if not used:
            return
        used_blocks = GaugeMetricFamily(
            "pagedkv_coordinator_tenant_used_blocks",
            "KV blocks held by each tenant's sequences.",
            labels=["tenant"],
        )
        quota = GaugeMetricFamily(
            "pagedkv_coordinator_tenant_quota_blocks",
            "Each tenant's block quota (absent: unlimited).",
            labels=["tenant"],
        )
        for tenant, n in used.items():
            used_blocks.add_metric([tenant], n)
            if tenant in self.quotas:
                quota.add_metric([tenant], self.quotas[tenant])
        yield used_blocks
        yield quota


class CoordinatorMetrics:
    def __init__(
        self,
        coordinator: Coordinator,
        registry: CollectorRegistry | None = None,
        *,
        tenants: Iterable[str] = (),
        quotas: Mapping[str, int] | None = None,
        info: Mapping[str, str] | None = None,
    ) -> None:
        """`tenants` / `quotas`: the tenants whose block use is exported (the tenants file's);
        `info`: the labels of pagedkv_coordinator_info (version, store)."""
        self.registry = registry or CollectorRegistry()
        self.registry.register(CoordinatorCollector(coordinator, tenants, quotas, info))
        self.rpc_latency = Histogram(
            "pagedkv_coordinator_rpc_latency_seconds",
            "Coordinator RPC latency by method.",
            ["method"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.rpc_errors = Counter(
            "pagedkv_coordinator_rpc_errors",
            "Failed coordinator RPCs by method and status code.",
            ["method", "code"],
            registry=self.registry,
        )

        # the children of the two per-call histograms, by label (both label sets are bounded)
        self._rpc_children: dict[str, Any] = {}
        self._redis_children: dict[str, Any] = {}
        self._tenant_children: dict[str, tuple[Any, Any, Any]] = {}  # (tenants are configured: bounded)
        self.redis_latency = Histogram(
            "pagedkv_coordinator_redis_latency_seconds",
            "Coordinator Redis call latency by operation.",
            ["op"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.redis_errors = Counter(
            "pagedkv_coordinator_redis_errors",
            "Redis calls that failed (after retries) by operation.",
            ["op"],
            registry=self.registry,
        )
        self.tenant_opens = Counter(
            "pagedkv_coordinator_tenant_open",
            "Sequences opened, by tenant.",
            ["tenant"],
            registry=self.registry,
        )
        self.tenant_prompt_tokens = Counter(
            "pagedkv_coordinator_tenant_prompt_tokens",
            "Prompt tokens of opened sequences, by tenant.",
            ["tenant"],
            registry=self.registry,
        )
        self.tenant_cached_tokens = Counter(
            "pagedkv_coordinator_tenant_cached_tokens",
            "Prompt tokens cached at open, by tenant.",
            ["tenant"],
            registry=self.registry,
        )

    def observe(self, method: str, seconds: float, code: str) -> None:
        child = self._rpc_children.get(method)
        if child is None:  # labels() builds a tuple and takes a lock: ~2 us a call, per rpc
            child = self._rpc_children[method] = self.rpc_latency.labels(method)
        child.observe(seconds)
        if code != "OK":
            self.rpc_errors.labels(method, code).inc()

    def observe_redis(self, op: str, seconds: float, ok: bool) -> None:
        """RedisStore.observer: one Redis call (op is the store method's name: bounded)."""
        child = self._redis_children.get(op)
        if child is None:
            child = self._redis_children[op] = self.redis_latency.labels(op)
        child.observe(seconds)
        if not ok:
            self.redis_errors.labels(op).inc()

    def observe_open(self, tenant: str, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        children = self._tenant_children.get(tenant)
        if children is None:  # three labels() an open otherwise
            children = self._tenant_children[tenant] = (
                self.tenant_opens.labels(tenant),
                self.tenant_prompt_tokens.labels(tenant),
                self.tenant_cached_tokens.labels(tenant),
            )
        opens, prompt, cached = children
        opens.inc()
        prompt.inc(num_prompt_tokens)
        cached.inc(num_cached_tokens)

"""Prometheus metrics of a worker's client (`pagedkv_client_*`): its sequences sharded
across nodes. Read from the client's counters at scrape time. prometheus-client is not a
dependency of the slim client install: import this module where the worker exports
metrics (it registers the collector in its own registry)::

    registry.register(ClientCollector(client))
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

# counter key -> (metric name, help)
COUNTERS = {
    "spills": (
        "pagedkv_client_spills",
        "Extents this client added to its sequences on another node (a full node, or max_extent_tokens).",
    ),
    "sharded_steps": (
        "pagedkv_client_sharded_steps",
        "Attend calls (one layer, decode or prefill) over sequences that span several nodes.",
    ),
    "sharded_attends": (
        "pagedkv_client_sharded_attends",
        "Node calls those steps made (one per node spanned, in parallel; merged by LSE).",
    ),
    "window_skipped_attends": (
        "pagedkv_client_window_skipped_attends",
        "Extents those steps did not attend: wholly outside the query's window or chunk.",
    ),
    "budget_dropped_blocks": (
        "pagedkv_client_budget_dropped_blocks",
        "Blocks dropped by token budgets this client keeps over sequences spanning several nodes.",
    ),
}


class ClientCollector(Collector):
    """The counters of a CacheClient (or an AsyncCacheClient's sync client)."""

    def __init__(self, client: Any) -> None:
        self.client = getattr(client, "sync", client)

    def collect(self) -> Iterator[Metric]:
        counters = self.client.counters
        for key, (name, text) in COUNTERS.items():
            family = CounterMetricFamily(name, text)
            family.add_metric([], counters[key])
            yield family

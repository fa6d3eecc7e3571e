"""Fixtures for the integration tests: real node servers on port 0, real channels."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvref import SPEC

from pagedkv.cache_node.coordinator_link import CoordinatorLink
from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.metrics import NodeMetrics
from pagedkv.cache_node.server import NodeServer, create_server
from pagedkv.coordinator.auth import Tenants
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.redis_store import RedisStore
from pagedkv.coordinator.service import create_server as create_coordinator_server
from pagedkv.protos.spec import ModelSpec


@dataclass
class Node:
    address: str
    engine: CacheEngine
    server: NodeServer
    metrics: NodeMetrics

    def health(self) -> str:
        with grpc.insecure_channel(self.address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


@pytest.fixture
def make_node() -> Iterator[Callable[..., Node]]:
    started: list[Node] = []

    def make(
        num_blocks: int = 64, num_host_blocks: int = 32, policy: str = "lru", spec: ModelSpec = SPEC
    ) -> Node:
        engine = CacheEngine(EngineConfig(spec, num_blocks, num_host_blocks, policy=policy, device="cpu"))
        metrics = NodeMetrics()
        server, port = create_server(engine, "127.0.0.1:0", metrics=metrics)
        node = Node(f"127.0.0.1:{port}", engine, server.start(), metrics)
        started.append(node)
        return node

    yield make
    for node in started:
        node.server.stop(0)


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    return make_node()


@dataclass
class Linked:
    engine: CacheEngine
    coordinator: Coordinator
    address: str  # the coordinator's gRPC address
    link: CoordinatorLink


@pytest.fixture
def link_node(redis_url: str) -> Iterator[Callable[[CacheEngine], Linked]]:
    """`link_node(engine)`: the engine served over gRPC with its CoordinatorLink (it registers
    as n1 and reports its block events as a node process does), linked to a coordinator on the
    test's redis-server, served over gRPC (lease 30 s)."""
    stops: list[Callable[[], object]] = []

    def link(engine: CacheEngine) -> Linked:
        node_server, node_port = create_server(engine, "127.0.0.1:0")
        node_server.start()
        stops.append(lambda: node_server.stop(0))
        coordinator = Coordinator(RedisStore(redis_url), CoordinatorConfig(lease_ttl_s=30))
        stops.append(coordinator.stop)
        server, port = create_coordinator_server(coordinator, "127.0.0.1:0", tenants=Tenants())
        server.start()
        stops.append(lambda: server.stop(0))
        address = f"127.0.0.1:{port}"
        node_link = CoordinatorLink(engine, address, "n1", f"127.0.0.1:{node_port}").start()
        stops.append(node_link.stop)
        assert node_link.is_registered.wait(5)
        return Linked(engine, coordinator, address, node_link)

    yield link
    for stop in reversed(stops):
        stop()

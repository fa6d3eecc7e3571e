"""Fixtures for the integration tests: real node servers on port 0, real channels."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvref import SPEC

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.metrics import NodeMetrics
from pagedkv.cache_node.server import NodeServer, create_server
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

"""Errors keep their class and their ids across the wire, over every transport: a
client catches `SequenceNotFound` and reads `exc.seq_id`, as the node raised it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import test_bulk_attend
from test_bulk_attend import GRPC, Q_HEADS, Node

from pagedkv.client import (
    CacheClient,
    ClientConfig,
    NodeLost,
    NodeNotLive,
    PagedKVError,
    PermissionDenied,
    ProtocolError,
    QuotaExceeded,
    RegionRefused,
    SequenceExists,
    SequenceNotFound,
    SpecMismatch,
    TransportUnavailable,
    Unauthenticated,
)
from pagedkv.protos.errors import CapacityExceeded, PrefixEvicted
from pagedkv.protos.status import error_from_status, error_ids, status_for

make, node = test_bulk_attend.make, test_bulk_attend.node  # the same node fixtures
TCP = ClientConfig(transports=("tcp", "grpc"))


def test_every_public_error_is_a_pagedkv_error() -> None:
    for cls in (
        NodeLost,
        NodeNotLive,
        PermissionDenied,
        ProtocolError,
        QuotaExceeded,
        RegionRefused,
        SequenceExists,
        SequenceNotFound,
        SpecMismatch,
        TransportUnavailable,
        Unauthenticated,
    ):
        assert issubclass(cls, PagedKVError), cls


@pytest.mark.parametrize(
    "exc",
    [
        SequenceNotFound("s-1"),
        SequenceExists("s-2"),
        NodeLost("s-3", "its node died"),
        NodeNotLive("n1", "heartbeat"),
        CapacityExceeded("append 9 tokens", 3, 1),
        QuotaExceeded("t", 5, 10, 8),
        PrefixEvicted("s-4", 2, 8),
    ],
)
def test_ids_round_trip_through_the_status_mapping(exc: PagedKVError) -> None:
    code, details, cls = status_for(exc)
    got = error_from_status(code.name, details, cls, "node n9", error_ids(exc))
    assert type(got) is type(exc)
    assert str(got) == f"node n9: {exc}"
    for name, value in vars(exc).items():
        assert getattr(got, name) == value, name


@pytest.mark.parametrize("config", [GRPC, TCP, ClientConfig()], ids=["grpc", "tcp", "default"])
def test_the_node_errors_ids_reach_the_client(make: Callable[..., Node], config: ClientConfig) -> None:
    node = make()
    node.fill("a", 2, seed=1)
    with CacheClient(node.address, config) as client:
        with pytest.raises(SequenceNotFound) as info:
            client.data.attend(["a", "nope"], 1, node.rand(2, Q_HEADS, 8, seed=2))
        assert info.value.seq_id == "nope"
        with pytest.raises(SequenceNotFound) as info:
            client.data.read_kv("gone")
        assert info.value.seq_id == "gone"

"""The client's open and lookup requests to the coordinator: token ids from a list go
into the message as they are (the message checks them, in C), arrays and tensors
through token_list; a bad id is InvalidArgument before anything is sent. Real
parts: a coordinator gRPC server on port 0 with the embedded store and one
in-process cache node."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.server import create_server as create_node_server
from pagedkv.client import CacheClient, codec
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.memory_store import MemoryStore
from pagedkv.coordinator.service import create_server as create_coordinator_server
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos.errors import InvalidArgument, SequenceNotFound
from pagedkv.protos.spec import ModelSpec

SPEC = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
BAD_IDS = {
    "float": [1, 1.5, 2],
    "bool": [1, True],
    "string": ["1", 2],
    "above int64": [2**63],
    "below int64": [-(2**63) - 1],
}


@pytest.mark.parametrize(
    "ids",
    [
        list(range(10)),
        tuple(range(10)),
        np.arange(10),
        np.arange(10, dtype=np.uint16).reshape(2, 5),
        torch.arange(10),
        [np.int64(i) for i in range(10)],
    ],
    ids=["list", "tuple", "int64 array", "uint16 2-d array", "tensor", "numpy ints in a list"],
)
def test_every_form_of_token_ids_gives_the_same_message(ids):
    req = codec.with_token_ids(pb.CoordOpenRequest, ids, seq_id="s")
    assert (req.seq_id, list(req.token_ids)) == ("s", list(range(10)))


@pytest.mark.parametrize("ids", BAD_IDS.values(), ids=BAD_IDS.keys())
def test_a_bad_token_id_is_invalid_argument(ids):
    for message in (pb.CoordOpenRequest, pb.CoordLookupRequest, pb.OpenRequest, pb.LookupRequest):
        with pytest.raises(InvalidArgument, match="token ids must be ints in the int64 range"):
            codec.with_token_ids(message, ids)


@pytest.fixture
def stack():
    engine = CacheEngine(EngineConfig(SPEC, 32, device="cpu"))
    node_server, node_port = create_node_server(engine, "127.0.0.1:0")
    node_server.start()
    coordinator = Coordinator(MemoryStore(), CoordinatorConfig(lease_ttl_s=30))
    coordinator.register("n1", f"127.0.0.1:{node_port}", SPEC.to_dict(), 32)
    server, port = create_coordinator_server(coordinator, "127.0.0.1:0")
    server.start()
    client = CacheClient(coordinator=f"127.0.0.1:{port}", spec=SPEC)
    yield engine, coordinator, client
    client.close()
    server.stop(0)
    coordinator.stop()
    node_server.stop(0)


def test_over_the_wire_a_bad_id_changes_nothing_and_good_ids_open(stack):
    engine, coordinator, client = stack
    for ids in BAD_IDS.values():
        with pytest.raises(InvalidArgument, match="token ids must be ints"):
            client.open("bad", ids)
        with pytest.raises(InvalidArgument, match="token ids must be ints"):
            client.lookup(ids)
    with pytest.raises(SequenceNotFound):
        coordinator.store.get_sequence("bad")
    assert coordinator.counters["opens"] == 0
    prompt = list(range(9))
    seq = client.open("good", np.array(prompt))
    k = torch.randn(SPEC.num_layers, 9, SPEC.num_kv_heads, SPEC.head_dim)
    assert seq.append(prompt, k, k) == 9
    assert coordinator.store.get_sequence("good").num_tokens == 9
    seq.close()
    coordinator.wait_idle()
    engine.check_integrity()
    assert engine.stats()["num_sequences"] == 0


def test_requests_carry_the_spec_built_once_and_follow_a_new_spec() -> None:
    """The spec message is built once per spec and copied into each request: a request
    changed afterwards leaves the next one alone, and a new routing.spec is picked up."""
    from pagedkv.client.config import ClientConfig
    from pagedkv.client.routing import CoordinatorRouting

    routing = CoordinatorRouting(None, ClientConfig(), None, SPEC)  # type: ignore[arg-type]
    first = routing._open_request("s1", [1, 2, 3], None)
    assert first.spec == pb.ModelSpec(**SPEC.to_dict())
    first.spec.block_size = 99
    second = routing._open_request("s2", [1, 2, 3], 2)
    assert second.spec.block_size == SPEC.block_size and second.max_cached_tokens == 2
    other = ModelSpec(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", block_size=8)
    routing.spec = other
    assert routing._open_request("s3", [1], None).spec == pb.ModelSpec(**other.to_dict())
    assert routing._pin_request([1, 2]).spec == pb.ModelSpec(**other.to_dict())
    routing.spec = None
    assert not routing._open_request("s4", [1], None).HasField("spec")

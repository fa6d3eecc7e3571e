"""Two models of one shape (a base model and its fine-tune) compute different K/V for the same
tokens: a node that names its model serves no other, and placement never sends a request for
one model to a node of the other, even where that node holds the prompt's prefix."""

from __future__ import annotations

import pytest
import torch

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.server import create_server
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.memory_store import MemoryStore
from pagedkv.protos.errors import InvalidArgument, SpecMismatch, Unavailable
from pagedkv.protos.spec import ModelSpec

SHAPE = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32", "block_size": 4}
BASE = ModelSpec(**SHAPE, model="org/base@1")
TUNED = ModelSpec(**SHAPE, model="org/tuned@1")


@pytest.mark.parametrize("bad", [7, "x" * 257, "org/base\n", "tab\there"])
def test_a_model_id_is_short_printable_text(bad) -> None:
    with pytest.raises(InvalidArgument, match="ModelSpec.model must be printable text"):
        ModelSpec(**SHAPE, model=bad)


def test_a_mismatch_names_the_models() -> None:
    with pytest.raises(SpecMismatch, match="model: 'org/tuned@1' != 'org/base@1'"):
        BASE.check_same(TUNED)
    ModelSpec(**SHAPE).check_same(ModelSpec(**SHAPE, model=""))  # unnamed on both sides


@pytest.fixture
def two_models():
    """A coordinator with one in-process node per model, both of the same shape."""
    coordinator = Coordinator(MemoryStore(), CoordinatorConfig(lease_ttl_s=30))
    engines, servers = {}, []
    for name, spec in (("base-node", BASE), ("tuned-node", TUNED)):
        engine = CacheEngine(EngineConfig(spec, 64, device="cpu"))
        server, port = create_server(engine, "127.0.0.1:0")
        server.start()
        servers.append(server)
        engines[name] = engine
        coordinator.register(name, f"127.0.0.1:{port}", spec.to_dict(), 64)
        coordinator.heartbeat(name, {"free_blocks": 64, "used_blocks": 0})
    yield coordinator, engines
    coordinator.stop()
    for server in servers:
        server.stop(0)


def test_a_cached_prefix_of_another_model_is_never_used(two_models) -> None:
    coordinator, engines = two_models
    prompt = list(range(40))
    tuned = coordinator.open("t", prompt, seq_id="tuned-1", spec=TUNED.to_dict(), wait=True)
    assert tuned.node_id == "tuned-node"
    kv = torch.randn(1, 40, 1, 8)
    engines["tuned-node"].append("tuned-1", prompt, kv, kv)
    events = engines["tuned-node"].take_events()
    coordinator.report_events("tuned-node", [(1 if e.kind == "stored" else 2, e.key) for e in events])
    again = coordinator.open("t", prompt + [99], seq_id="tuned-2", spec=TUNED.to_dict(), wait=True)
    assert (again.node_id, again.num_cached_tokens) == ("tuned-node", 40)  # the index holds it

    for i in range(4):  # every base-model open: its own node, nothing reused from the fine-tune
        base = coordinator.open("t", prompt + [99], seq_id=f"base-{i}", spec=BASE.to_dict(), wait=True)
        assert (base.node_id, base.num_cached_tokens) == ("base-node", 0 if i == 0 else 40)
        kv = torch.randn(1, 41 - base.num_cached_tokens, 1, 8)
        engines["base-node"].append(f"base-{i}", (prompt + [99])[base.num_cached_tokens :], kv, kv)
        events = engines["base-node"].take_events()
        coordinator.report_events("base-node", [(1 if e.kind == "stored" else 2, e.key) for e in events])
    for seq_id in ["tuned-1", "tuned-2"] + [f"base-{i}" for i in range(4)]:
        coordinator.close("t", seq_id)


def test_an_unnamed_request_is_told_which_models_are_served(two_models) -> None:
    coordinator, _ = two_models
    with pytest.raises(Unavailable) as caught:
        coordinator.open("t", list(range(8)), seq_id="s", spec=SHAPE)
    message = str(caught.value)
    assert "'model': 'org/base@1'" in message and "'model': 'org/tuned@1'" in message

"""The whole family table through one real cluster (redis-server or the embedded store, a
coordinator and one cache node process per model shape the table needs, gRPC): every exact row
identical to eager attention (greedy on a left-padded batch), sampling and beams for one family
per feature, every refused row refused before anything is opened. The attention spec travels
with each open through the coordinator to the node. A model whose every layer slides (Mistral)
decodes far past its window on a real node with the blocks it holds flat at about the window."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from hf_families import VOCAB, Family, build
from hf_helpers import LOGIT_TOL
from test_transformers_families import (
    BLOCK_SIZE,
    EXACT,
    PER_FEATURE,
    REFUSED,
    check_generation,
    check_refused,
    models,
)
from transformers import DynamicCache

from pagedkv.client import CacheClient, LayerAttention
from pagedkv.client.transformers import GrpcBackend, PagedKVCache, node_spec, prefill_with_prefix_cache
from pagedkv.cluster import LocalCluster, NodeOptions
from pagedkv.protos.attention import to_messages
from pagedkv.protos.errors import InvalidArgument
from pagedkv.protos.spec import ModelSpec


def spec_of(name: str) -> ModelSpec:
    return node_spec(models(name)[0].config, BLOCK_SIZE)


class Cluster:
    """One coordinator, one node per distinct model shape of the exact rows."""

    def __init__(self, tmp_path) -> None:
        self.specs = list(dict.fromkeys(spec_of(f.name) for f in EXACT))
        self.local = LocalCluster(0, log_dir=str(tmp_path)).start()
        self.backends: dict[ModelSpec, GrpcBackend] = {}
        try:
            for i, spec in enumerate(self.specs):
                self.local.node = NodeOptions(
                    spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.block_size, 256, 0
                )
                self.local.start_node(i)
            self.local.wait_registered(len(self.specs))
        except BaseException:
            self.local.stop()
            raise

    def backend(self, spec: ModelSpec) -> GrpcBackend:
        if spec not in self.backends:
            self.backends[spec] = GrpcBackend(coordinator=self.local.coordinator_address, spec=spec)
        return self.backends[spec]

    def node_counters(self, spec: ModelSpec) -> dict[str, int]:
        client = self.backend(spec).client
        address = next(n.address for n in client.cluster_stats().nodes if n.spec == spec)
        return client.node_stats(address).counters

    def await_idle(self, spec: ModelSpec) -> dict[str, int]:
        """A close answers before the coordinator's node Free lands: await it, bounded."""
        deadline = time.monotonic() + 5.0
        while (counters := self.node_counters(spec))["num_sequences"] and time.monotonic() < deadline:
            time.sleep(0.05)
        return counters

    def close(self) -> None:
        try:
            for spec in self.specs:  # the refused rows' backends reached no node
                backend = self.backend(spec)
                counters = self.await_idle(spec)
                assert counters["num_sequences"] == 0 and counters["used_blocks"] == 0, (spec, counters)
                backend.check_integrity()
        finally:
            for backend in self.backends.values():
                backend.close()
            self.local.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("families-cluster"))
    yield c
    c.close()  # every node left clean: no sequence, no used block, integrity


@pytest.mark.parametrize("family", EXACT, ids=lambda f: f.name)
def test_exact_family_through_the_cluster(cluster: Cluster, family: Family):
    check_generation(family.name, cluster.backend(spec_of(family.name)))


@pytest.mark.parametrize("mode", ["sampling", "beams"])
@pytest.mark.parametrize("name", PER_FEATURE)
def test_sampling_and_beams_through_the_cluster(cluster: Cluster, name: str, mode: str):
    check_generation(name, cluster.backend(spec_of(name)), mode)


@pytest.mark.parametrize("family", REFUSED, ids=lambda f: f.name)
def test_refused_family_through_the_cluster(cluster: Cluster, family: Family):
    # The shape the model needs (a node may not serve it: nothing must reach one).
    spec = node_spec(build(family, "pagedkv").config, BLOCK_SIZE)
    check_refused(family, cluster.backend(spec))


def test_the_coordinator_refuses_a_spec_that_does_not_fit_at_open(cluster: Cluster):
    spec = cluster.specs[0]
    with CacheClient(coordinator=cluster.local.coordinator_address, spec=spec) as client:
        with pytest.raises(InvalidArgument, match="attention lists 3 layers; the model has 2"):
            client.open("too-deep", [1, 2, 3], attention=[LayerAttention(window=8)] * 3)
        with pytest.raises(InvalidArgument, match="layer 1: attention: window must be an int >= 0"):
            bad = [LayerAttention(window=8), LayerAttention(window=8)]
            client.routing.open("negative", [1, 2, 3], None, None, _messages(bad, -5))
    assert cluster.await_idle(spec)["num_sequences"] == 0


def _messages(layers: list[LayerAttention], window: int) -> list:
    """The wire form with layer 1's window set to a value LayerAttention itself refuses (what a
    client of another language could send)."""
    msgs = to_messages(layers)
    msgs[1].window = window
    return msgs


def test_a_sliding_window_model_decodes_past_it_with_memory_flat(cluster: Cluster):
    """Mistral, window 16, blocks of 4: 24 prompt tokens, then 100 decoded greedily, each step's
    logits against eager attention with DynamicCache. The node releases the blocks behind the
    window as it goes: the sequence holds at most 5 blocks (the window spans 16 positions, 5
    blocks when unaligned) while it grows to 31."""
    name = "mistral-sliding"
    spec = spec_of(name)
    model, ref = models(name)
    backend = cluster.backend(spec)
    cluster.await_idle(spec)
    prompt = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(11))
    held, worst = [], 0.0
    with PagedKVCache(model, backend, reuse_prefix=False) as cache, torch.no_grad():
        logits = prefill_with_prefix_cache(model, cache, prompt).logits[:, -1]
        ref_cache = DynamicCache(config=ref.config)
        want = ref(input_ids=prompt, cache=ref_cache, use_cache=True).logits[:, -1]
        for _ in range(100):
            worst = max(worst, float((logits - want).abs().max()))
            token = want.argmax(-1, keepdim=True)
            logits = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
            want = ref(input_ids=token, cache=ref_cache, use_cache=True).logits[:, -1]
            held.append(cluster.node_counters(spec)["used_blocks"])
        assert cache.num_stored_tokens == [124]
    assert worst < LOGIT_TOL, worst
    assert max(held) <= 5, held
    assert held[-1] < -(-124 // BLOCK_SIZE)  # 31 blocks without releasing
    assert cluster.node_counters(spec)["window_released_blocks"] >= 124 // BLOCK_SIZE - 5

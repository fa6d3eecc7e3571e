"""The family table's two outcomes through a real cluster (redis-server or the embedded store, a
coordinator and a cache node as processes, gRPC): gpt-oss with attention sinks (the LSE comes
back over the wire) is identical to eager attention; a sliding-window model with the same
shape is refused before anything is opened."""

from __future__ import annotations

import time

import pytest
import torch
from hf_families import BY_NAME, VOCAB, build
from hf_helpers import assert_same_generation, left_pad
from transformers import DynamicCache

from pagedkv.client.transformers import GrpcBackend, PagedKVCache, UnsupportedModel, node_spec
from pagedkv.cluster import LocalCluster, NodeOptions

NEW_TOKENS = 8


def test_exact_and_refused_families_through_a_cluster(tmp_path):
    exact, refused = BY_NAME["gpt-oss-full"], BY_NAME["mistral-sliding"]
    model = build(exact, "pagedkv")
    ref = build(exact, "eager")
    ref.load_state_dict(model.state_dict())
    spec = node_spec(model.config, 4)
    other = build(refused, "pagedkv")
    assert node_spec(other.config, 4) == spec  # the refusal is about the window, not the shape
    g = torch.Generator().manual_seed(3)
    ids, mask = left_pad([torch.randint(3, VOCAB, (n,), generator=g) for n in (9, 14)])
    kw = {
        "max_new_tokens": NEW_TOKENS,
        "min_new_tokens": NEW_TOKENS,
        "do_sample": False,
        "output_logits": True,
        "return_dict_in_generate": True,
    }
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=mask, cache=DynamicCache(config=ref.config), **kw)

    options = NodeOptions(
        spec.num_layers,
        spec.num_kv_heads,
        spec.head_dim,
        spec.dtype,
        spec.block_size,
        num_blocks=128,
        host_blocks=0,
    )
    with (
        LocalCluster(1, options, log_dir=str(tmp_path)) as cluster,
        GrpcBackend(coordinator=cluster.coordinator_address) as backend,
    ):
        with pytest.raises(UnsupportedModel, match="MistralForCausalLM layer 0: a sliding window of 16"):
            PagedKVCache(other, backend)
        with PagedKVCache(model, backend) as cache, torch.no_grad():
            got = model.generate(ids, attention_mask=mask, cache=cache, **kw)
        assert_same_generation(got, want)
        backend.check_integrity()
        # A close answers before the coordinator's node Free lands: await it, bounded.
        deadline = time.monotonic() + 5.0
        while backend.stats()["num_sequences"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backend.stats()["num_sequences"] == 0 and backend.stats()["used_blocks"] == 0

"""generate() through pagedkv matches transformers' DynamicCache: greedy, sampling, left-padded
batches, beam search; node attention and gathered-KV; in process and over gRPC; a model saved
with save_pretrained and loaded back."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import LOGIT_TOL, assert_same_generation, left_pad, prompt_ids
from transformers import DynamicCache

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.server import create_server
from pagedkv.client.transformers import (
    EngineBackend,
    GrpcBackend,
    PagedKVCache,
    demo_config,
    load_model,
    node_spec,
)
from pagedkv.protos.errors import InvalidArgument

NEW_TOKENS = 40


def run(model, ids, mask, cache, **kw):
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            cache=cache,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return left_pad([prompt_ids(1, 13), prompt_ids(2, 21)])


@pytest.mark.parametrize(("block_size", "mode"), [(1, "node"), (16, "node"), (16, "gather")])
def test_greedy_left_padded_batch_matches_dynamic_cache(model, ref_model, make_backend, block_size, mode):
    ids, mask = padded_batch()
    ref = run(ref_model, ids, mask, DynamicCache(config=ref_model.config), do_sample=False)
    with PagedKVCache(model, make_backend(block_size), mode=mode) as cache:
        out = run(model, ids, mask, cache, do_sample=False)
        # Pads are never stored; every real prompt token and every fed generated token is.
        assert cache.num_stored_tokens == [13 + NEW_TOKENS - 1, 21 + NEW_TOKENS - 1]
        assert cache.fed_lengths == [21] + [1] * (NEW_TOKENS - 1)
        assert cache.get_seq_length() == 21 + NEW_TOKENS - 1
    assert_same_generation(out, ref)


@pytest.mark.parametrize("block_size", [1, 16])
def test_beam_search_forks_and_matches(model, ref_model, make_backend, block_size):
    ids, mask = padded_batch()
    kw = {"num_beams": 3, "do_sample": False, "early_stopping": False, "output_scores": True}
    ref = run(ref_model, ids, mask, DynamicCache(config=ref_model.config), **kw)
    backend = make_backend(block_size)
    with PagedKVCache(model, backend, mode="node") as cache:
        out = run(model, ids, mask, cache, **kw)
        assert len(cache.seq_ids) == 6  # 2 prompts x 3 beams, one node sequence each
        assert backend.stats()["num_sequences"] == 6  # dropped beams were freed
        backend.check_integrity()
    assert_same_generation(out, ref)
    assert torch.allclose(out.sequences_scores, ref.sequences_scores, atol=LOGIT_TOL)


def test_sampling_matches_with_the_same_seed(model, ref_model, make_backend):
    ids, mask = padded_batch()
    kw = {"do_sample": True, "top_k": 50, "temperature": 0.8}
    torch.manual_seed(123)
    ref = run(ref_model, ids, mask, DynamicCache(config=ref_model.config), **kw)
    torch.manual_seed(123)
    with PagedKVCache(model, make_backend(4)) as cache:
        out = run(model, ids, mask, cache, **kw)
    assert_same_generation(out, ref)


def test_reorder_forks_chosen_parents_and_frees_dropped(model, make_backend):
    backend = make_backend(4)
    ids = torch.stack([prompt_ids(3, 6)] * 3)
    with PagedKVCache(model, backend) as cache, torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
        old = cache.seq_ids
        cache.reorder_cache(torch.tensor([2, 2, 0]))
        new = cache.seq_ids
        assert new[0] == old[2] and new[2] == old[0]  # first child takes over its parent
        assert new[1] not in old  # a fork
        assert backend.stats()["num_sequences"] == 3  # old[1] freed
        assert backend.engine.block_table(new[1]) == backend.engine.block_table(old[2])  # shared
        backend.check_integrity()


def test_grpc_node_greedy_matches(model, ref_model):
    engine = CacheEngine(EngineConfig(node_spec(model.config, 16), 256, device="cpu"))
    server, port = create_server(engine, "127.0.0.1:0")
    server.start()
    try:
        ids, mask = padded_batch()
        ref = run(ref_model, ids, mask, DynamicCache(config=ref_model.config), do_sample=False)
        with GrpcBackend(f"127.0.0.1:{port}") as backend:
            with PagedKVCache(model, backend) as cache:
                out = run(model, ids, mask, cache, do_sample=False)
            assert backend.stats()["used_blocks"] == 0
            backend.check_integrity()
        assert_same_generation(out, ref)
    finally:
        server.stop(0)


def test_save_pretrained_and_load_back(model, ref_model, make_backend, tmp_path):
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.config._attn_implementation == "pagedkv"
    ids = prompt_ids(4, 17)[None]
    ref = run(ref_model, ids, None, DynamicCache(config=ref_model.config), do_sample=False)
    with PagedKVCache(loaded, make_backend(16)) as cache:
        out = run(loaded, ids, None, cache, do_sample=False)
    assert_same_generation(out, ref)


def test_a_node_for_another_model_shape_is_refused(model):
    other = node_spec(demo_config(num_layers=3), 16)
    engine = CacheEngine(EngineConfig(other, 16, device="cpu"))
    with pytest.raises(InvalidArgument, match="layers"):
        PagedKVCache(model, EngineBackend(engine))

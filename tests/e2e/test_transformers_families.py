"""Every family of hf_families.FAMILIES, through node attention in an in-process engine, against
the same weights on eager attention with DynamicCache: identical (greedy on a left-padded
batch, logits within 1e-4) or refused before the first token, naming the model and the
feature. Sampling with a seed and beam search run for one family per feature. The checks are
written once (`check_generation`, `check_refused`): test_transformers_families_cluster.py runs
the same ones through a real cluster."""

from __future__ import annotations

import functools
import zlib
from typing import Any

import pytest
import torch
from hf_families import BY_NAME, FAMILIES, VOCAB, Family, build
from hf_helpers import assert_same_generation, left_pad
from transformers import DynamicCache

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.client.transformers import EngineBackend, PagedKVCache, UnsupportedModel, load_model, node_spec

NEW_TOKENS = 12
BLOCK_SIZE = 4  # small blocks: a window of 16 spans several, and releasing them shows
# One family per feature: plain, a custom scale and sinks (the client), a window, chunks and a
# soft-cap (the node).
PER_FEATURE = ["llama-gqa", "granite", "gpt-oss-full", "mistral-sliding", "llama4-chunked", "gemma2-softcap"]
MODES: dict[str, dict[str, Any]] = {
    "greedy": {"do_sample": False},
    "sampling": {"do_sample": True, "top_k": 20, "temperature": 0.9},
    "beams": {"num_beams": 3, "do_sample": False, "early_stopping": False, "output_scores": True},
}
EXACT = [f for f in FAMILIES if f.is_exact]
REFUSED = [f for f in FAMILIES if not f.is_exact]


def prompts(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two left-padded prompts of 11 and 19 tokens, the family's own: a node serving several
    families of one shape (the cluster test) must never find one family's K/V under another's
    prompt (block keys chain token ids, not models), while one family's runs share theirs."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return left_pad([torch.randint(3, VOCAB, (n,), generator=g) for n in (11, 19)])


@functools.cache
def models(name: str) -> tuple[Any, Any]:
    """The family's model on pagedkv attention and its eager twin (same weights), built once
    per session: the node-mode and cluster tests compare against the same reference."""
    model = build(BY_NAME[name], "pagedkv")
    ref = build(BY_NAME[name], "eager")
    ref.load_state_dict(model.state_dict())
    return model, ref


def generate(name: str, model, cache, mode: str):
    ids, mask = prompts(name)
    if mode == "sampling":
        torch.manual_seed(5)
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            cache=cache,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            output_logits=True,
            return_dict_in_generate=True,
            **MODES[mode],
        )


@functools.cache
def reference(name: str, mode: str):
    _, ref = models(name)
    return generate(name, ref, DynamicCache(config=ref.config), mode)


def check_generation(name: str, backend, mode: str = "greedy") -> None:
    """generate() on a PagedKVCache over `backend` equals the eager reference."""
    model, _ = models(name)
    with PagedKVCache(model, backend) as cache:
        got = generate(name, model, cache, mode)
        if mode == "beams":
            assert len(cache.seq_ids) == 6  # 2 prompts x 3 beams
        else:
            assert cache.num_stored_tokens == [11 + NEW_TOKENS - 1, 19 + NEW_TOKENS - 1]
    want = reference(name, mode)
    assert_same_generation(got, want)
    if mode == "beams":
        assert torch.allclose(got.sequences_scores, want.sequences_scores, atol=1e-4)


def check_refused(family: Family, backend) -> None:
    """PagedKVCache refuses the model before anything reaches the node, naming the model."""
    model = build(family, "pagedkv")
    with pytest.raises(UnsupportedModel, match=family.outcome) as refused:
        PagedKVCache(model, backend)
    assert type(model).__name__ in str(refused.value)
    assert refused.value.model == type(model).__name__


def engine_for(model) -> CacheEngine:
    return CacheEngine(EngineConfig(node_spec(model.config, BLOCK_SIZE), 256, device="cpu"))


def assert_clean(engine: CacheEngine) -> None:
    engine.check_integrity()
    stats = engine.stats()
    assert stats["used_blocks"] == 0 and stats["num_sequences"] == 0, stats


@pytest.mark.parametrize("family", EXACT, ids=lambda f: f.name)
def test_exact_family_greedy_left_padded_batch(family: Family):
    engine = engine_for(models(family.name)[0])
    check_generation(family.name, EngineBackend(engine))
    assert_clean(engine)


@pytest.mark.parametrize("family", REFUSED, ids=lambda f: f.name)
def test_refused_family_is_refused_before_the_first_token(family: Family):
    engine = engine_for(build(family, "pagedkv"))
    check_refused(family, EngineBackend(engine))
    assert_clean(engine)  # nothing was opened


@pytest.mark.parametrize("mode", ["sampling", "beams"])
@pytest.mark.parametrize("name", PER_FEATURE)
def test_sampling_and_beams_match_per_feature(name: str, mode: str):
    engine = engine_for(models(name)[0])
    check_generation(name, EngineBackend(engine), mode)
    assert_clean(engine)


def test_load_model_refuses_a_model_whose_attention_bypasses_the_interface(tmp_path):
    build(BY_NAME["bloom"], "eager").save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match="BloomForCausalLM.*attention interface"):
        load_model(str(tmp_path))

"""Every family of hf_families.FAMILIES, through node attention in an in-process engine, against
the same weights on eager attention with DynamicCache: identical (greedy on a left-padded
batch, logits within 1e-4) or refused before the first token, naming the model and the
feature. Sampling with a seed and beam search run for one family per feature."""

from __future__ import annotations

import re

import pytest
import torch
from hf_families import BY_NAME, FAMILIES, VOCAB, Family, build
from hf_helpers import assert_same_generation, left_pad
from transformers import DynamicCache

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.client.transformers import EngineBackend, PagedKVCache, UnsupportedModel, load_model, node_spec
from pagedkv.protos.errors import InvalidArgument

NEW_TOKENS = 12
# One family per feature the client makes exact: plain, custom scale, sinks, a bounded window.
PER_FEATURE = ["llama-gqa", "granite", "gpt-oss-full", "mistral-within-window"]


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return left_pad([torch.randint(3, VOCAB, (n,), generator=g) for n in (11, 19)])


def models(family: Family):
    model = build(family, "pagedkv")
    ref = build(family, "eager")
    ref.load_state_dict(model.state_dict())
    return model, ref


def engine_for(model) -> CacheEngine:
    return CacheEngine(EngineConfig(node_spec(model.config, 4), 256, device="cpu"))


def generate(model, cache, ids, mask, **kw):
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


def assert_clean(engine: CacheEngine) -> None:
    engine.check_integrity()
    stats = engine.stats()
    assert stats["used_blocks"] == 0 and stats["num_sequences"] == 0, stats


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.is_exact], ids=lambda f: f.name)
def test_exact_family_greedy_left_padded_batch(family: Family):
    model, ref = models(family)
    ids, mask = prompts()
    want = generate(ref, DynamicCache(config=ref.config), ids, mask, do_sample=False)
    engine = engine_for(model)
    with PagedKVCache(model, EngineBackend(engine), max_tokens=family.max_tokens) as cache:
        got = generate(model, cache, ids, mask, do_sample=False)
        assert cache.num_stored_tokens == [11 + NEW_TOKENS - 1, 19 + NEW_TOKENS - 1]
    assert_same_generation(got, want)
    assert_clean(engine)


@pytest.mark.parametrize("family", [f for f in FAMILIES if not f.is_exact], ids=lambda f: f.name)
def test_refused_family_is_refused_before_the_first_token(family: Family):
    model = build(family, "pagedkv")
    engine = engine_for(model)
    with pytest.raises(UnsupportedModel, match=family.outcome) as refused:
        PagedKVCache(model, EngineBackend(engine), max_tokens=family.max_tokens)
    assert type(model).__name__ in str(refused.value)
    assert refused.value.model == type(model).__name__
    assert_clean(engine)  # nothing was opened


@pytest.mark.parametrize("name", PER_FEATURE)
def test_sampling_with_a_seed_matches(name: str):
    model, ref = models(BY_NAME[name])
    ids, mask = prompts()
    kw = {"do_sample": True, "top_k": 20, "temperature": 0.9}
    torch.manual_seed(5)
    want = generate(ref, DynamicCache(config=ref.config), ids, mask, **kw)
    torch.manual_seed(5)
    engine = engine_for(model)
    with PagedKVCache(model, EngineBackend(engine), max_tokens=BY_NAME[name].max_tokens) as cache:
        got = generate(model, cache, ids, mask, **kw)
    assert_same_generation(got, want)
    assert_clean(engine)


@pytest.mark.parametrize("name", PER_FEATURE)
def test_beam_search_matches(name: str):
    model, ref = models(BY_NAME[name])
    ids, mask = prompts()
    kw = {"num_beams": 3, "do_sample": False, "early_stopping": False, "output_scores": True}
    want = generate(ref, DynamicCache(config=ref.config), ids, mask, **kw)
    engine = engine_for(model)
    with PagedKVCache(model, EngineBackend(engine), max_tokens=BY_NAME[name].max_tokens) as cache:
        got = generate(model, cache, ids, mask, **kw)
        assert len(cache.seq_ids) == 6  # 2 prompts x 3 beams
    assert_same_generation(got, want)
    assert torch.allclose(got.sequences_scores, want.sequences_scores, atol=1e-4)
    assert_clean(engine)


def test_a_window_model_past_its_bound_is_refused_before_any_token():
    family = BY_NAME["mistral-within-window"]  # sliding window 64, max_tokens 64
    model = build(family, "pagedkv")
    engine = engine_for(model)
    ids = torch.randint(3, VOCAB, (1, 60))
    with PagedKVCache(model, EngineBackend(engine), max_tokens=64) as cache:
        too_long = re.escape("72 tokens long (prompt + max_new_tokens), beyond")
        with pytest.raises(InvalidArgument, match=too_long):
            generate(model, cache, ids, None, do_sample=False)
        assert cache.seq_ids == []  # refused before the prompt was opened
        with torch.no_grad(), pytest.raises(InvalidArgument, match="would hold 70 tokens, beyond"):
            model(input_ids=torch.randint(3, VOCAB, (1, 70)), cache=cache, use_cache=True)
    assert_clean(engine)


def test_a_window_larger_than_the_bound_is_refused():
    model = build(BY_NAME["mistral-within-window"], "pagedkv")
    with pytest.raises(UnsupportedModel, match="layer 0: a sliding window of 64 tokens.*max_tokens=65"):
        PagedKVCache(model, EngineBackend(engine_for(model)), max_tokens=65)


def test_load_model_refuses_a_model_whose_attention_bypasses_the_interface(tmp_path):
    build(BY_NAME["bloom"], "eager").save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match="BloomForCausalLM.*attention interface"):
        load_model(str(tmp_path))

"""generate() with a PagedKVCache: prefix reuse by default, beams expanded for the caller, and
the refusals a user can hit (wrong attention, a feature switched on after the check, unknown
attention arguments), each naming its cause and leaving nothing behind on the node."""

from __future__ import annotations

import pytest
import torch
from hf_families import BY_NAME, VOCAB, build
from hf_helpers import assert_same_generation, left_pad, prompt_ids
from transformers import DynamicCache

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.client.hf_support import AttentionPlan, check_call
from pagedkv.client.transformers import EngineBackend, PagedKVCache, UnsupportedModel, node_spec
from pagedkv.protos.errors import FailedPrecondition, InvalidArgument

SYSTEM = prompt_ids(10, 40)  # 2 full blocks of 16 + 8 tokens
NEW_TOKENS = 8
KW = {
    "max_new_tokens": NEW_TOKENS,
    "min_new_tokens": NEW_TOKENS,
    "do_sample": False,
    "output_logits": True,
    "return_dict_in_generate": True,
}


def reference(ref_model, ids, mask=None, **kw):
    with torch.no_grad():
        return ref_model.generate(
            ids, attention_mask=mask, cache=DynamicCache(config=ref_model.config), **KW, **kw
        )


def test_plain_generate_reuses_the_cached_prefix(model, ref_model, make_backend):
    backend = make_backend(16)
    with PagedKVCache(model, backend) as cache, torch.no_grad():
        model.generate(torch.cat([SYSTEM, prompt_ids(11, 9)])[None], cache=cache, **KW)
    second = torch.cat([SYSTEM, prompt_ids(12, 7)])[None]  # 47 tokens, the same 40-token system prompt
    with PagedKVCache(model, backend) as cache, torch.no_grad():
        out = model.generate(second, cache=cache, **KW)
        assert cache.last_hit is not None and cache.last_hit.num_cached_tokens == [32]
        assert cache.fed_lengths[0] == 47 - 32  # the model computed only the suffix
    assert_same_generation(out, reference(ref_model, second))
    with PagedKVCache(model, backend, reuse_prefix=False) as cache, torch.no_grad():
        out = model.generate(second, cache=cache, **KW)
        assert cache.last_hit is None and cache.fed_lengths[0] == 47  # explicit: every position computed
    assert_same_generation(out, reference(ref_model, second))


def test_beams_on_a_prompt_the_caller_opened_are_expanded_by_forking(model, ref_model, make_backend):
    backend = make_backend(4)
    ids, mask = left_pad([prompt_ids(1, 13), prompt_ids(2, 21)])
    with PagedKVCache(model, backend) as cache, torch.no_grad():
        hit = cache.open_prompt(ids, mask)  # 2 rows; generate runs 2 x 3 beams
        assert len(cache.seq_ids) == 2 and hit.num_cached_tokens == [0, 0]
        out = model.generate(ids, attention_mask=mask, cache=cache, num_beams=3, early_stopping=False, **KW)
        assert len(cache.seq_ids) == 6
        backend.check_integrity()
    assert_same_generation(out, reference(ref_model, ids, mask, num_beams=3, early_stopping=False))


def test_a_model_without_the_pagedkv_attention_is_refused_naming_the_cause(ref_model, make_backend):
    with pytest.raises(UnsupportedModel, match="attn_implementation='sdpa'.*attn_implementation='pagedkv'"):
        PagedKVCache(ref_model, make_backend(16))


def test_attention_switched_away_after_the_check_names_the_cause(model, make_backend):
    with PagedKVCache(model, make_backend(16)) as cache, torch.no_grad():
        model.config._attn_implementation = "sdpa"
        try:
            with pytest.raises(FailedPrecondition, match="ran 0 of 2 layers.*attn_implementation='pagedkv'"):
                model(input_ids=prompt_ids(3, 5)[None], cache=cache, use_cache=True)
        finally:
            model.config._attn_implementation = "pagedkv"


def test_a_window_switched_on_after_the_check_is_refused_at_its_first_layer():
    model = build(BY_NAME["mistral-within-window"], "pagedkv")
    engine = CacheEngine(EngineConfig(node_spec(model.config, 4), 64, device="cpu"))
    model.config.sliding_window = None
    ids = torch.randint(3, VOCAB, (1, 5))
    with PagedKVCache(model, EngineBackend(engine)) as cache, torch.no_grad():
        model.config.sliding_window = 8
        with pytest.raises(
            UnsupportedModel, match="layer 0: .*sliding_window_overlay \\+ causal_mask_function"
        ):
            model(input_ids=ids, cache=cache, use_cache=True)
        model.config.sliding_window = None
        model(input_ids=ids, cache=cache, use_cache=True)  # refused before any node call: still usable
        assert cache.num_stored_tokens == [5]
    engine.check_integrity()
    assert engine.stats()["num_sequences"] == 0


@pytest.mark.parametrize(
    ("kwargs", "feature"),
    [
        ({"a_new_feature": 3}, "the attention argument 'a_new_feature'"),
        ({"sliding_window": 4096}, "a sliding window of 4096"),
        ({"softcap": 30.0}, "soft-capping"),
        ({"output_attentions": True}, "output_attentions=True"),
        ({"is_causal": False}, "bidirectional"),
    ],
)
def test_an_attention_argument_the_node_cannot_honour_is_refused(kwargs, feature):
    plan = AttentionPlan("SomeForCausalLM", 2, None, ())
    with pytest.raises(UnsupportedModel, match=f"SomeForCausalLM layer 1: {feature}") as refused:
        check_call(plan, 1, 16, None, 0.0, None, kwargs, {})
    assert isinstance(refused.value, InvalidArgument) and refused.value.layer == 1


def test_harmless_arguments_and_scales_pass():
    plan = AttentionPlan("SomeForCausalLM", 2, None, ())
    call = check_call(
        plan, 0, 16, None, 0.0, 0.3, {"position_ids": torch.arange(3), "sliding_window": None}, {}
    )
    assert call.q_scale == pytest.approx(0.3 * 4) and call.sinks is None
    assert check_call(plan, 0, 16, None, 0.0, 0.25, {}, {}).q_scale is None  # the node's own 1/sqrt(16)


def test_sinks_outside_node_mode_are_refused_not_dropped():
    model = build(BY_NAME["gpt-oss-full"], "pagedkv")
    with torch.no_grad(), pytest.raises(InvalidArgument, match="sinks.*node mode"):
        model(input_ids=torch.randint(3, VOCAB, (1, 4)), cache=DynamicCache(config=model.config))


def test_gather_mode_runs_a_windowed_model_on_its_own_attention():
    family = BY_NAME["mistral-sliding"]  # window 16, refused in node mode
    model = build(family, "eager")
    ids, mask = left_pad(
        [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (11, 30)]
    )
    engine = CacheEngine(EngineConfig(node_spec(model.config, 4), 256, device="cpu"))
    with PagedKVCache(model, EngineBackend(engine), mode="gather") as cache, torch.no_grad():
        out = model.generate(ids, attention_mask=mask, cache=cache, **KW)
    assert_same_generation(out, reference(model, ids, mask))
    engine.check_integrity()

"""generate() with a PagedKVCache: prefix reuse by default, beams expanded for the caller, and
the refusals a user can hit (wrong attention, a feature switched on after the check, unknown
attention arguments), each naming its cause and leaving nothing behind on the node."""

from __future__ import annotations

import pytest
import torch
from hf_families import BY_NAME, VOCAB, build
from hf_helpers import assert_same_generation, left_pad, prompt_ids
from transformers import DynamicCache
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    chunked_causal_mask_function,
    or_masks,
    sliding_window_causal_mask_function,
    sliding_window_overlay,
)

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.client.hf_masks import recognise
from pagedkv.client.hf_support import AttentionPlan, check_call
from pagedkv.client.transformers import EngineBackend, PagedKVCache, UnsupportedModel, node_spec
from pagedkv.protos.attention import LayerAttention
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
    model = build(BY_NAME["mistral-sliding"], "pagedkv")
    engine = CacheEngine(EngineConfig(node_spec(model.config, 4), 64, device="cpu"))
    model.config.sliding_window = None
    ids = torch.randint(3, VOCAB, (1, 5))
    with PagedKVCache(model, EngineBackend(engine)) as cache, torch.no_grad():
        model.config.sliding_window = 8
        with pytest.raises(
            UnsupportedModel,
            match="layer 0: .*sliding_window_overlay \\+ causal_mask_function selects other keys .*(none)",
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
    plan = AttentionPlan("SomeForCausalLM", 2, None)
    with pytest.raises(UnsupportedModel, match=f"SomeForCausalLM layer 1: {feature}") as refused:
        check_call(plan, 1, 16, None, 0.0, None, kwargs, {})
    assert isinstance(refused.value, InvalidArgument) and refused.value.layer == 1


def test_harmless_arguments_and_scales_pass():
    plan = AttentionPlan("SomeForCausalLM", 2, None)
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
    family = BY_NAME["mistral-sliding"]  # window 16
    model = build(family, "eager")
    ids, mask = left_pad(
        [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (11, 30)]
    )
    engine = CacheEngine(EngineConfig(node_spec(model.config, 4), 256, device="cpu"))
    with PagedKVCache(model, EngineBackend(engine), mode="gather") as cache, torch.no_grad():
        out = model.generate(ids, attention_mask=mask, cache=cache, **KW)
    assert_same_generation(out, reference(model, ids, mask))
    engine.check_integrity()


WINDOWED = AttentionPlan(
    "SomeForCausalLM", 2, None, (LayerAttention(window=16, softcap=30.0), LayerAttention(softcap=30.0))
)


@pytest.mark.parametrize(
    ("layer", "mask_kind", "kwargs", "feature"),
    [
        (0, None, {}, "a plain causal mask .* declares a sliding window of 16 tokens"),
        (1, ("window", 16), {}, "a mask of a sliding window of 16 tokens .* declares plain causal attention"),
        (0, ("window", 16), {"sliding_window": 8}, "a sliding window of 8 tokens"),
        (0, ("window", 16), {"softcap": 20.0}, "soft-capping \\(softcap=20.0\\) .* softcap=30.0"),
        (0, ("chunk", 16), {}, "a mask of chunked attention of 16 tokens"),
        (0, "the reason", {}, "its attention mask .*the reason"),
    ],
)
def test_a_mask_or_argument_unlike_the_layer_spec_is_refused(layer, mask_kind, kwargs, feature):
    mask = None if mask_kind is None else torch.zeros(0)
    masks = {} if mask is None else {id(mask): (mask, mask_kind)}
    with pytest.raises(UnsupportedModel, match=f"SomeForCausalLM layer {layer}: {feature}"):
        check_call(WINDOWED, layer, 16, mask, 0.0, None, kwargs, masks)


def test_a_mask_and_arguments_that_match_the_layer_spec_pass():
    mask = torch.zeros(0)
    masks = {id(mask): (mask, ("window", 16))}
    call = check_call(WINDOWED, 0, 16, mask, 0.0, None, {"sliding_window": 16, "softcap": 30.0}, masks)
    assert call.q_scale is None and call.sinks is None
    check_call(WINDOWED, 1, 16, None, 0.0, None, {"sliding_window": None, "softcap": 30.0}, {})


def test_masks_are_recognised_by_structure_and_probed_at_their_edges():
    ids = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]).bool()
    assert recognise(causal_mask_function, [16], [], ids) is None
    assert recognise(sliding_window_causal_mask_function(16), [8, 16], [], ids) == ("window", 16)
    assert "(8)" in str(recognise(sliding_window_causal_mask_function(16), [8], [], ids))
    chunked = chunked_causal_mask_function(4, torch.tensor([2, 0]))  # counts from row 0's 2 pads
    assert recognise(chunked, [], [4], ids) == ("chunk", 4)
    assert isinstance(recognise(chunked_causal_mask_function(4, torch.tensor([0, 0])), [], [4], ids), str)
    widened = or_masks(sliding_window_causal_mask_function(16), causal_mask_function)
    assert "not one the node applies" in str(recognise(widened, [16], [], ids))
    swapped = and_masks(sliding_window_overlay(16), sliding_window_overlay(8))
    assert "not one the node applies" in str(recognise(swapped, [8, 16], [], ids))


def test_a_windowed_model_refuses_a_pad_after_a_real_token_before_any_node_call():
    model = build(BY_NAME["mistral-sliding"], "pagedkv")
    engine = CacheEngine(EngineConfig(node_spec(model.config, 4), 64, device="cpu"))
    ids = torch.randint(3, VOCAB, (2, 6))
    right_padded = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])
    with PagedKVCache(model, EngineBackend(engine)) as cache, torch.no_grad():
        with pytest.raises(InvalidArgument, match="row 0 has a pad after a real token"):
            model(input_ids=ids, attention_mask=right_padded, cache=cache, use_cache=True)
        assert cache.seq_ids == []
        model(input_ids=ids, attention_mask=right_padded.flip(1), cache=cache, use_cache=True)  # left: fine
    engine.check_integrity()
    assert engine.stats()["num_sequences"] == 0


def test_max_tokens_bounds_every_row_before_any_token(model, make_backend):
    ids = prompt_ids(20, 60)[None]
    with PagedKVCache(model, make_backend(16), max_tokens=64) as cache:
        with pytest.raises(InvalidArgument, match="68 tokens long \\(prompt \\+ max_new_tokens\\), beyond"):
            model.generate(ids, cache=cache, **KW)
        assert cache.seq_ids == []  # refused before the prompt was opened
        with (
            torch.no_grad(),
            pytest.raises(InvalidArgument, match="would hold 70 tokens, beyond max_tokens=64"),
        ):
            model(input_ids=prompt_ids(21, 70)[None], cache=cache, use_cache=True)

"""Prefix reuse: a request whose prompt starts with cached blocks prefills only the suffix and
matches full recompute."""

from __future__ import annotations

import torch
from hf_helpers import LOGIT_TOL, assert_same_generation, left_pad, prompt_ids
from transformers import DynamicCache

from pagedkv.client.hf_backend import join_rows
from pagedkv.client.transformers import PagedKVCache, generate_with_prefix_cache, prefill_with_prefix_cache

SYSTEM = prompt_ids(10, 40)  # 2 full blocks of 16 + 8 tokens
NEW_TOKENS = 12


def gen_kwargs() -> dict:
    return {
        "max_new_tokens": NEW_TOKENS,
        "min_new_tokens": NEW_TOKENS,
        "do_sample": False,
        "output_logits": True,
        "return_dict_in_generate": True,
    }


def reference(ref_model, ids, mask=None):
    with torch.no_grad():
        return ref_model.generate(
            ids, attention_mask=mask, cache=DynamicCache(config=ref_model.config), **gen_kwargs()
        )


def test_second_request_prefills_only_its_suffix(model, ref_model, make_backend):
    backend = make_backend(16)
    first = torch.cat([SYSTEM, prompt_ids(11, 9)])[None]
    with PagedKVCache(model, backend) as cache, torch.no_grad():
        _, hit = generate_with_prefix_cache(model, cache, first, **gen_kwargs())
        assert hit.num_cached_tokens == [0]
        assert cache.fed_lengths[0] == 49

    second = torch.cat([SYSTEM, prompt_ids(12, 7)])[None]  # 47 tokens, same system prompt
    with PagedKVCache(model, backend) as cache, torch.no_grad():
        out, hit = generate_with_prefix_cache(model, cache, second, **gen_kwargs())
        assert hit.num_cached_tokens == [32]  # the system prompt's two full blocks
        assert cache.fed_lengths == [47 - 32] + [1] * (NEW_TOKENS - 1)  # the model saw 15 prompt tokens
    assert_same_generation(out, reference(ref_model, second))
    assert backend.stats()["prefix_hit_tokens"] >= 32


def test_prefill_logits_of_the_suffix_match_full_recompute(model, ref_model, make_backend):
    backend = make_backend(4)
    with PagedKVCache(model, backend) as cache, torch.no_grad():
        prefill_with_prefix_cache(model, cache, SYSTEM[None])
    prompt = torch.cat([SYSTEM, prompt_ids(13, 10)])[None]
    with PagedKVCache(model, backend) as cache, torch.no_grad():
        result = prefill_with_prefix_cache(model, cache, prompt)
    assert result.num_cached_tokens == [40] and result.num_fed_tokens == 10
    with torch.no_grad():
        full = ref_model(prompt).logits
    err = (result.logits - full[:, 40:]).abs().max().item()
    assert err < LOGIT_TOL, err


def test_left_padded_batch_reuses_each_rows_prefix(model, ref_model, make_backend):
    backend = make_backend(16)
    with PagedKVCache(model, backend) as cache, torch.no_grad():
        prefill_with_prefix_cache(model, cache, torch.cat([SYSTEM, prompt_ids(11, 9)])[None])
    ids, mask = left_pad([torch.cat([SYSTEM, prompt_ids(12, 7)]), torch.cat([SYSTEM, prompt_ids(14, 13)])])
    with PagedKVCache(model, backend) as cache, torch.no_grad():
        out, hit = generate_with_prefix_cache(model, cache, ids, mask, **gen_kwargs())
        # Row 0 has 6 pads: its hit ends at 38; row 1's at 32, where the batch resumes.
        assert hit.num_cached_tokens == [32, 32] and hit.start == 32
        assert cache.fed_lengths[0] == 53 - 32
        assert cache.num_stored_tokens == [47 + NEW_TOKENS - 1, 53 + NEW_TOKENS - 1]
    assert_same_generation(out, reference(ref_model, ids, mask))


def test_beam_search_on_a_cached_prefix(model, ref_model, make_backend):
    backend = make_backend(8)
    with PagedKVCache(model, backend) as cache, torch.no_grad():
        prefill_with_prefix_cache(model, cache, SYSTEM[None])
    prompt = torch.cat([SYSTEM, prompt_ids(15, 5)])[None]
    kw = {**gen_kwargs(), "num_beams": 2, "early_stopping": False}
    with PagedKVCache(model, backend) as cache, torch.no_grad():
        out, hit = generate_with_prefix_cache(model, cache, prompt, **kw)
        assert hit.num_cached_tokens == [40, 40]  # both beams start on the cached system prompt
    with torch.no_grad():
        ref = ref_model.generate(prompt, cache=DynamicCache(config=ref_model.config), **kw)
    assert_same_generation(out, ref)


def test_unpadded_batch_on_a_cached_prefix_matches_and_joins_rows_without_copies(
    model, ref_model, make_backend
):
    """Every row fully fed (no pads, every hit ends at `start`): the whole batch goes to the node
    as one block per layer (the rows are views of one buffer, joined without a copy) and every
    fed position's logits still match full recompute, then generation matches DynamicCache."""
    backend = make_backend(8)
    with PagedKVCache(model, backend) as cache, torch.no_grad():
        prefill_with_prefix_cache(model, cache, SYSTEM[None])
    prompts = torch.stack([torch.cat([SYSTEM, prompt_ids(20 + b, 11)]) for b in range(3)])
    with PagedKVCache(model, backend) as cache, torch.no_grad():
        result = prefill_with_prefix_cache(model, cache, prompts)
    assert result.num_cached_tokens == [40, 40, 40] and result.num_fed_tokens == 11
    with torch.no_grad():
        full = ref_model(prompts).logits
    err = (result.logits - full[:, 40:]).abs().max().item()
    assert err < LOGIT_TOL, err

    with PagedKVCache(model, backend) as cache, torch.no_grad():
        out, hit = generate_with_prefix_cache(model, cache, prompts, **gen_kwargs())
        assert hit.num_cached_tokens == [48, 48, 48]  # each row's own suffix blocks now cached too
    assert_same_generation(out, reference(ref_model, prompts))


def test_join_rows_is_a_view_for_adjacent_rows_and_a_copy_otherwise():
    buffer = torch.arange(60.0).view(3, 5, 4)
    joined = join_rows(list(buffer.unbind(0)))
    assert torch.equal(joined, buffer.view(15, 4)) and joined.data_ptr() == buffer.data_ptr()
    flat = buffer.view(15, 4)
    parts = list(flat.split([2, 0, 13]))
    joined = join_rows(parts)
    assert torch.equal(joined, flat) and joined.data_ptr() == flat.data_ptr()
    gap = [flat[:2], flat[3:]]  # a row left out between them: must be copied
    joined = join_rows(gap)
    assert torch.equal(joined, torch.cat(gap)) and joined.data_ptr() != flat.data_ptr()
    apart = [torch.ones(2, 4), torch.zeros(3, 4)]
    assert torch.equal(join_rows(apart), torch.cat(apart))
    strided = [buffer[:, 0], buffer[:, 1]]  # not contiguous
    assert torch.equal(join_rows(strided), torch.cat(strided))

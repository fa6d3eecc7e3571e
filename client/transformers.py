"""Hugging Face transformers on pagedkv: the "pagedkv" attention function, prefix reuse, a demo model.

transformers is an optional extra: importing this module imports it (nothing else in the client
does). Importing it also registers the "pagedkv" attention implementation -- before any model is
built with `attn_implementation="pagedkv"`, as transformers requires.

How transformers' calls map to pagedkv calls (B rows, L layers, see hf_cache / hf_backend):

    generate() / model(...)           pagedkv
    ------------------------------    -----------------------------------------------------------
    first forward (no open_prompt)    Open(row's real ids, max_cached_tokens=0) per row
    open_prompt / *_with_prefix_cache Open(full prompt) per row, the node caps the hit -> resume
    forward pre-hook                  records input_ids + which positions are real (not pads)
    cache.update(k, v, layer)         node mode: nothing; gather mode: ReadKV per row (layer 0)
    attention(q, k, v), decode        Attend(all rows, layer, q, k, v, token_ids at layer 0)
    attention(q, k, v), prefill       AttendPrefillBatch(all rows, pads skipped), one per layer
    forward post-hook                 gather mode: Append per row (all layers' new K/V)
    cache.reorder_cache(beam_idx)     Fork chosen parents, Free dropped ones (CoW shares blocks)
    cache.close()                     Free every row (full blocks stay cached for prefix hits)

The attention function falls back to transformers' sdpa when the forward's cache is not a
PagedKVCache in node mode, so one model serves DynamicCache, gathered-KV and node attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..protos.errors import InvalidArgument
from ..protos.spec import ModelSpec
from .hf_backend import EngineBackend, GrpcBackend, KVBackend
from .hf_cache import PagedKVCache, PrefixHit, active_cache, install_hooks

__all__ = [
    "ATTENTION_NAME",
    "EngineBackend",
    "GrpcBackend",
    "KVBackend",
    "PagedKVCache",
    "PrefillResult",
    "PrefixHit",
    "demo_config",
    "demo_model",
    "generate_with_prefix_cache",
    "load_model",
    "node_spec",
    "paged_attention_forward",
    "prefill_with_prefix_cache",
    "register",
]

ATTENTION_NAME = "pagedkv"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [B, Hq, T, D], key/value [B, Hk, T, D] (the new
    tokens only, in node mode) -> ([B, T, Hq, D], None). The node masks causally per sequence and
    never stores pads, so `attention_mask` is not needed there."""
    cache = active_cache()
    if cache is None or cache.mode != "node":
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise InvalidArgument("pagedkv attention runs inference only (dropout must be 0)")
    if scaling is not None and abs(scaling - query.shape[-1] ** -0.5) > 1e-9:
        raise InvalidArgument(f"the node scales scores by 1/sqrt(head_dim); the model asks for {scaling}")
    for name in ("sliding_window", "softcap"):
        if kwargs.get(name) is not None:
            raise InvalidArgument(f"pagedkv attention does not support {name}")
    return cache.attend(cast(int, module.layer_idx), query, key, value), None


def paged_attention_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask function registered with the attention: none in node mode (the node masks
    causally per sequence and stores no pads, so a [B, 1, T, past + T] mask would be built for
    nothing: ~1 ms per forward at 128 x 1,152), sdpa's otherwise (the fallback and gather mode)."""
    cache = active_cache()
    if cache is not None and cache.mode == "node":
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register the "pagedkv" attention and its mask function with transformers. Idempotent."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, paged_attention_mask)


register()


# -- prefix reuse ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillResult:
    """logits [B, num_fed_tokens (or logits_to_keep), vocab] of the positions the model computed;
    num_cached_tokens per row; num_fed_tokens: positions per row actually fed to the model."""

    logits: torch.Tensor
    num_cached_tokens: list[int]
    num_fed_tokens: int
    start: int


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as generate() computes them: real tokens count from 0, pads get 0."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def prefill_with_prefix_cache(
    model: PreTrainedModel,
    cache: PagedKVCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    logits_to_keep: int = 0,
) -> PrefillResult:
    """Open the prompt on the node (learning how much of it is cached) and run the model on the
    uncached suffix only. The cache then holds the whole prompt, ready for decoding.

        prompt (padded)   | pads | cached on the node (whole blocks) | suffix: fed to the model |
                          0                                        start                      T

    `logits_to_keep` as in transformers (0: every fed position; 1: the last one, for TTFT).
    """
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    hit = cache.open_prompt(input_ids, mask)
    with torch.no_grad():
        out = model(
            input_ids=input_ids[:, hit.start :],
            attention_mask=mask,
            position_ids=_positions(mask)[:, hit.start :],
            cache=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
    return PrefillResult(out.logits, hit.num_cached_tokens, input_ids.shape[1] - hit.start, hit.start)


def generate_with_prefix_cache(
    model: PreTrainedModel,
    cache: PagedKVCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    **generate_kwargs: Any,
) -> tuple[Any, PrefixHit]:
    """`model.generate(input_ids, cache=cache, ...)` that prefills only the uncached suffix.

    The cache opens the prompt first and reports the resume position as its length, so generate
    (given the full ids, as it requires) feeds the model only `input_ids[:, start:]`. With beams
    or several return sequences the rows are opened already expanded, as generate expands them.
    `cache.fed_lengths[0]` is the number of prompt positions the model computed.
    """
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    config = generate_kwargs.get("generation_config") or model.generation_config
    beams = generate_kwargs.get("num_beams", config.num_beams) or 1
    returns = generate_kwargs.get("num_return_sequences", config.num_return_sequences) or 1
    expand = max(beams, returns)
    hit = cache.open_prompt(input_ids.repeat_interleave(expand, 0), mask.repeat_interleave(expand, 0))
    output = cast(Any, model).generate(input_ids, attention_mask=mask, cache=cache, **generate_kwargs)
    return output, hit


# -- models ----------------------------------------------------------------------------------


def demo_config(
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 1000,
    max_position_embeddings: int = 4096,
    initializer_range: float = 0.1,
) -> LlamaConfig:
    """A small Llama config (GQA, fp32). initializer_range is larger than Llama's 0.02 so that a
    random model has clear winners among its logits (fewer near-ties in greedy comparisons)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def demo_model(seed: int = 0, **config_kwargs: Any) -> tuple[LlamaForCausalLM, LlamaConfig]:
    """A randomly initialised Llama (fixed seed, fp32, eval mode) with the pagedkv attention.
    No weights are downloaded. `config_kwargs` go to demo_config."""
    config = demo_config(**config_kwargs)
    config._attn_implementation = ATTENTION_NAME
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = config.pad_token_id
    install_hooks(model)
    return model, model.config


def load_model(path: str, **kwargs: Any) -> PreTrainedModel:
    """from_pretrained with the pagedkv attention (any causal LM with a standard attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=ATTENTION_NAME, **kwargs).eval()
    install_hooks(model)
    return model


def node_spec(config: Any, block_size: int = 16, dtype: str = "float32") -> ModelSpec:
    """The ModelSpec a node must serve for this model config."""
    config = config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelSpec(config.num_hidden_layers, config.num_key_value_heads, head_dim, dtype, block_size)

"""Hugging Face transformers on pagedkv: the "pagedkv" attention function, prefix reuse, a demo model.

transformers is an optional extra: importing this module imports it (nothing else in the client
does). Importing it also registers the "pagedkv" attention implementation -- before any model is
built with `attn_implementation="pagedkv"`, as transformers requires.

How transformers' calls map to pagedkv calls (B rows, L layers, see hf_cache / hf_generate / hf_backend):

    generate() / model(...)           pagedkv
    ------------------------------    -----------------------------------------------------------
    PagedKVCache(model, backend)      nothing on the node: the model is checked (hf_support)
    generate(), before the forwards   Open(full prompt) per row (x beams), the node caps the hit
    open_prompt / *_with_prefix_cache   -> the model resumes there (reuse_prefix=False: no Open)
    first forward (nothing opened)    Open(row's real ids, max_cached_tokens=0) per row
    forward pre-hook                  records input_ids + which positions are real (not pads)
    cache.update(k, v, layer)         node mode: nothing; gather mode: ReadKV per row (layer 0)
    attention(q, k, v), decode        Attend(all rows, layer, q, k, v, token_ids at layer 0)
    attention(q, k, v), prefill       AttendPrefillBatch(all rows, pads skipped), one per layer
    forward post-hook                 gather mode: Append per row (all layers' new K/V)
    cache.reorder_cache(beam_idx)     Fork chosen parents, Free dropped ones (CoW shares blocks)
    cache.close()                     Free every row (full blocks stay cached for prefix hits)

The attention function falls back to transformers' sdpa when the forward's cache is not a
PagedKVCache in node mode, so one model serves DynamicCache, gathered-KV and node attention
(except attention sinks, which sdpa would drop: refused there). In node mode it refuses, before
the first token, anything the node would compute differently (hf_support; docs/models.md).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from ..protos.errors import FailedPrecondition, InvalidArgument
from ..protos.spec import ModelSpec
from .hf_backend import EngineBackend, GrpcBackend, KVBackend
from .hf_cache import PagedKVCache, PrefixHit, active_cache
from .hf_generate import install_hooks, open_for_generate
from .hf_masks import recognise
from .hf_support import ATTENTION_NAME, UnsupportedModel, check_call, model_shape, reaches_attention_interface

__all__ = [
    "ATTENTION_NAME",
    "EngineBackend",
    "GrpcBackend",
    "KVBackend",
    "PagedKVCache",
    "PrefillResult",
    "PrefixHit",
    "UnsupportedModel",
    "demo_config",
    "demo_model",
    "generate_with_prefix_cache",
    "load_model",
    "node_spec",
    "paged_attention_forward",
    "prefill_with_prefix_cache",
    "register",
]

_SDPA_MASK_SIGNATURE = inspect.signature(sdpa_mask)


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
    tokens only, in node mode) -> ([B, T, Hq, D], None). In node mode every argument is checked
    first (hf_support.check_call): what the node cannot compute exactly is refused."""
    cache = active_cache()
    if cache is None or cache.mode != "node":
        if kwargs.get("s_aux") is not None:  # sdpa would drop the sinks without a word
            raise InvalidArgument(
                f"{type(module).__name__}: attention sinks (s_aux) are computed in node mode only; "
                "run this model with attn_implementation='eager' outside a PagedKVCache"
            )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer = cast(int, getattr(module, "layer_idx", None))
    try:
        if not isinstance(layer, int):
            raise cache.plan.refuse(
                type(module).__name__,
                "an attention module without layer_idx",
                "the node keys each layer's K/V by its index",
            )
        call = check_call(
            cache.plan, layer, query.shape[-1], attention_mask, dropout, scaling, kwargs, cache.masks
        )
    except InvalidArgument:
        cache.abandon_forward()
        raise
    return cache.attend(layer, query, key, value, q_scale=call.q_scale, sinks=call.sinks), None


def paged_attention_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask function registered with the attention. Node mode: none is built (the node masks
    by the sequence's spec and stores no pads, so a [B, 1, T, past + T] mask would be built for
    nothing: ~1 ms per forward at 128 x 1,152). The plain causal mask becomes None; a window or
    chunks the node applies, or a mask it refuses, become a marker that each layer receiving it
    checks against its own spec (hf_masks.recognise, hf_support.check_call). Otherwise sdpa's
    (the fallback and gather mode)."""
    cache = active_cache()
    if cache is not None and cache.mode == "node":
        if args:  # transformers passes keywords; a positional call is bound to sdpa_mask's names
            bound = dict(_SDPA_MASK_SIGNATURE.bind_partial(*args, **kwargs).arguments)
            kwargs = {**bound, **bound.pop("kwargs", {})}
        mask_function = kwargs.get("mask_function", causal_mask_function)
        if mask_function is causal_mask_function:
            return None
        plan = cache.plan
        windows = [layer.window for layer in plan.layers if layer.window]
        chunks = [layer.chunk for layer in plan.layers if layer.chunk]
        kind = recognise(mask_function, windows, chunks, kwargs.get("attention_mask"))
        return None if kind is None else cache.mask_marker(kind)
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
    """`model.generate(input_ids, cache=cache, ...)`, returning also what the prompt's open found.

    generate() on a hooked model already opens the prompt first (PagedKVCache(reuse_prefix=True),
    the default) and feeds the model only the uncached suffix; this opens it explicitly, so the
    hit is returned whatever the cache's setting. With beams or several return sequences the rows
    are opened already expanded, as generate expands them. `cache.fed_lengths[0]` is the number
    of prompt positions the model computed.
    """
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    if cache.seq_ids:
        raise FailedPrecondition("generate_with_prefix_cache: the cache already holds sequences")
    hit = cast(PrefixHit, open_for_generate(model, cache, input_ids, mask, generate_kwargs))
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
    """from_pretrained with the pagedkv attention (any causal LM whose attention goes through
    transformers' attention interface; others are refused here, naming the model class)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, **{k: v for k, v in kwargs.items() if k in _HUB_KWARGS})
    model_class = _causal_lm_class(config)
    if model_class is not None and not reaches_attention_interface(model_class):
        raise UnsupportedModel(
            model_class.__name__,
            "every layer",
            "its own attention modules",
            "the model computes attention itself instead of calling transformers' attention interface, "
            "so it cannot run with attn_implementation='pagedkv' (load it with attn_implementation='sdpa' "
            "and use PagedKVCache(..., mode='gather'))",
        )
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=ATTENTION_NAME, **kwargs).eval()
    install_hooks(model)
    return model


# from_pretrained arguments that say where the config lives (the rest concern the weights).
_HUB_KWARGS = frozenset(
    {"trust_remote_code", "revision", "token", "cache_dir", "local_files_only", "subfolder"}
)


def _causal_lm_class(config: Any) -> type | None:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return cast(type, MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])
    except KeyError:
        return None


def node_spec(config: Any, block_size: int = 16, dtype: str = "float32") -> ModelSpec:
    """The ModelSpec a node must serve for this model config (no `num_key_value_heads`: MHA)."""
    shape = model_shape(config)
    return ModelSpec(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype, block_size)

"""Which transformers models the node computes exactly, and the checks that refuse the rest.

The node attends causally over every stored token of a sequence with scale 1/sqrt(head_dim) and
returns the output with its log-sum-exp. From that, the client makes exact:

    feature                                  how
    ---------------------------------------  --------------------------------------------------
    causal + left padding                    the node never stores pads
    custom scale (Granite, Gemma, GPT-2)     q is pre-scaled by scaling * sqrt(head_dim)
    attention sinks (gpt-oss `s_aux`)        out * sigmoid(lse - sink): one more softmax term
    sliding window / chunked attention       only while no row holds more tokens than the
                                             window or chunk (`max_tokens`, declared up front)

Everything else is refused with `UnsupportedModel` (an InvalidArgument) before the first token:
soft-capping, Doge's learned dynamic mask, bidirectional or packed masks, attention weights as
output, K and V of different head sizes (latent attention), layers that are not attention,
models whose attention never reaches transformers' attention interface, and any attention
argument this module does not know. Checks run once per cache (the config) and once
per layer call (a handful of dict lookups); none touches the tensors.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers.masking_utils import causal_mask_function

from ..protos.errors import InvalidArgument

ATTENTION_NAME = "pagedkv"

# Attention kwargs that transformers passes through every layer without changing the attention's
# result (bookkeeping of the forward): their values are ignored.
_PASSTHROUGH = frozenset(
    {
        "position_ids",
        "cache_position",
        "use_cache",
        "output_router_logits",
        "output_hidden_states",
        "return_dict",
        "logits_to_keep",
        "layer_idx",
    }
)
_HANDLED = frozenset({"sliding_window", "softcap", "s_aux", "is_causal", "output_attentions"})


class UnsupportedModel(InvalidArgument):
    """The model needs an attention feature the node does not compute (or not exactly)."""

    def __init__(self, model: str, layer: int | str, feature: str, detail: str) -> None:
        self.model, self.layer, self.feature = model, layer, feature
        where = f"layer {layer}" if isinstance(layer, int) else layer
        super().__init__(f"{model} {where}: {feature} is not supported by pagedkv attention: {detail}")


@dataclass(frozen=True)
class ModelShape:
    """The attention shape of a model's text decoder (what a node's ModelSpec must match)."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


def model_shape(config: Any) -> ModelShape:
    """Layers and heads from a transformers config. No `num_key_value_heads` means multi-head
    attention (GPT-NeoX, GPT-2, GPT-J, OPT); `multi_query` (GPT-BigCode) means one KV head."""
    config = config.get_text_config(decoder=True)
    num_q_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None)
    if num_kv_heads is None:
        num_kv_heads = 1 if getattr(config, "multi_query", False) else num_q_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_q_heads
    return ModelShape(config.num_hidden_layers, num_q_heads, num_kv_heads, head_dim)


@dataclass(frozen=True)
class LayerLimit:
    """A layer that sees only the last `size` tokens (window) or its own chunk of `size`."""

    layer: int
    feature: str
    size: int


@dataclass(frozen=True)
class AttentionPlan:
    """What one model needs from the node, checked once when a PagedKVCache is made.

    `max_tokens`: the most tokens a row may hold (prompt + generated), or None for unbounded;
    `limits`: the windows and chunks the bound keeps exact (every size >= max_tokens)."""

    model_name: str
    num_layers: int
    max_tokens: int | None
    limits: tuple[LayerLimit, ...]

    def refuse(self, layer: int | str, feature: str, detail: str) -> UnsupportedModel:
        return UnsupportedModel(self.model_name, layer, feature, detail)


def reaches_attention_interface(model_class: type) -> bool:
    """Whether the model's attention modules call transformers' attention interface (where
    "pagedkv" is registered): the class says so, or its modeling file looks the function up
    there (StableLM does without saying). Bloom, MPT, GPT-Neo do neither."""
    if getattr(model_class, "_supports_attention_backend", False):
        return True
    module = sys.modules.get(model_class.__module__)
    return module is not None and "ALL_ATTENTION_FUNCTIONS" in vars(module)


def layer_limits(config: Any, model_name: str) -> list[LayerLimit]:
    """Each layer's window or chunk from the config: `layer_types` when the config has them
    (Gemma2/3, Cohere2, Qwen2/3, gpt-oss, Llama 4, ...), else `sliding_window` on every layer
    (Mistral, Phi3, PhiMoE) and `attention_chunk_size` on every layer."""
    config = config.get_text_config(decoder=True)
    window = getattr(config, "sliding_window", None) or None
    chunk = getattr(config, "attention_chunk_size", None) or None
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        use = getattr(config, "use_sliding_window", True)
        layer_types = ["sliding_attention" if window and use else "full_attention"] * config.num_hidden_layers
        if chunk:
            layer_types = ["chunked_attention"] * config.num_hidden_layers
    limits = []
    for layer, kind in enumerate(layer_types[: config.num_hidden_layers]):
        if kind == "full_attention":
            continue
        if kind == "sliding_attention" and window:
            limits.append(LayerLimit(layer, "sliding window", int(window)))
        elif kind == "chunked_attention" and chunk:
            limits.append(LayerLimit(layer, "chunked attention", int(chunk)))
        else:
            raise UnsupportedModel(model_name, layer, f"layer type {kind!r}", "the node computes attention")
    return limits


def plan_attention(model: Any, max_tokens: int | None = None) -> AttentionPlan:
    """Check that node attention computes `model` exactly (rows up to `max_tokens` tokens).

    Raises UnsupportedModel naming the model class, the layer and the feature; changes nothing."""
    name = type(model).__name__
    config = model.config.get_text_config(decoder=True)
    num_layers = config.num_hidden_layers
    is_count = isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
    if max_tokens is not None and (not is_count or max_tokens < 1):
        raise InvalidArgument(f"max_tokens must be a positive int or None, got {max_tokens!r}")
    if not reaches_attention_interface(type(model)):
        raise UnsupportedModel(
            name,
            "every layer",
            "its own attention modules",
            "the model computes attention itself instead of calling transformers' attention interface, "
            "so the node never sees it (gathered-KV mode, mode='gather', still works)",
        )
    for cfg in {id(c): c for c in (model.config, config)}.values():
        impl = getattr(cfg, "_attn_implementation", None)
        if impl != ATTENTION_NAME:
            raise UnsupportedModel(
                name,
                "every layer",
                f"attn_implementation={impl!r}",
                f"node mode needs attn_implementation={ATTENTION_NAME!r}: build the model with "
                f"from_pretrained(..., attn_implementation={ATTENTION_NAME!r}) or "
                "pagedkv.client.transformers.load_model (or use mode='gather')",
            )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModel(
            name,
            "every layer",
            "attention logit soft-capping",
            f"attn_logit_softcapping={config.attn_logit_softcapping} needs a node kernel (None only if "
            "the checkpoint was trained without it)",
        )
    if getattr(config, "keep_window_size", None) is not None:
        raise UnsupportedModel(
            name,
            "every layer",
            "a dynamic mask (keep_window_size)",
            "the model adds a learned per-key bias to the scores, which the node cannot apply",
        )
    if getattr(config, "alibi", False):
        raise UnsupportedModel(
            name,
            "every layer",
            "ALiBi position biases",
            "the model adds a per-head linear bias to the scores through its attention mask, which "
            "the node does not apply",
        )
    shape = model_shape(config)
    qk_dim = (getattr(config, "qk_nope_head_dim", 0) or 0) + (getattr(config, "qk_rope_head_dim", 0) or 0)
    v_dim = getattr(config, "v_head_dim", None)
    if v_dim is not None and v_dim != (qk_dim or shape.head_dim):
        raise UnsupportedModel(
            name,
            "every layer",
            "multi-head latent attention",
            f"keys have {qk_dim or shape.head_dim} dimensions per head and values {v_dim}; a node stores "
            "both with one head_dim",
        )
    limits = layer_limits(config, name)
    for limit in limits:
        if max_tokens is None or max_tokens > limit.size:
            bound = "no max_tokens was given" if max_tokens is None else f"max_tokens={max_tokens}"
            raise UnsupportedModel(
                name,
                limit.layer,
                f"a {limit.feature} of {limit.size} tokens",
                f"the node attends over every token of a sequence, so this is exact only while no row holds "
                f"more than {limit.size} tokens ({bound}): pass PagedKVCache(..., max_tokens=N) with "
                f"N <= {limit.size}",
            )
    return AttentionPlan(name, num_layers, max_tokens, tuple(limits))


@dataclass(frozen=True)
class LayerCall:
    """What one attention call asks beyond plain causal attention: q's scale relative to the
    node's 1/sqrt(head_dim) (None: the node's own) and per-head sink logits [Hq] (None: none)."""

    q_scale: float | None
    sinks: torch.Tensor | None


def check_call(
    plan: AttentionPlan,
    layer: int,
    head_dim: int,
    attention_mask: Any,
    dropout: float,
    scaling: float | None,
    kwargs: Mapping[str, Any],
    refused_masks: Mapping[int, tuple[Any, str]],
) -> LayerCall:
    """Refuse an attention call the node would compute differently from the model (see the
    module docstring). `refused_masks`: the masks of this forward that mask_refusal turned
    down, by id. A None value means "feature off" in transformers; any other value of an
    argument this module does not know is refused."""
    if attention_mask is not None:
        refused = refused_masks.get(id(attention_mask))
        if refused is not None and refused[0] is attention_mask:
            raise plan.refuse(layer, "its attention mask", refused[1])
        raise plan.refuse(
            layer,
            "a mask built by the model itself",
            "the attention received a mask that pagedkv's mask function did not make (the node masks "
            "causally and skips pads; it cannot apply another mask)",
        )
    if dropout:
        raise plan.refuse(layer, f"dropout={dropout}", "pagedkv attention runs inference only (model.eval())")
    sinks = None
    for key, value in kwargs.items():
        if value is None or key in _PASSTHROUGH:
            continue
        if key not in _HANDLED:
            raise plan.refuse(layer, f"the attention argument {key!r}", "pagedkv does not know its effect")
        if key == "s_aux":
            sinks = value.detach().to("cpu", torch.float32).reshape(-1)
        elif key == "sliding_window":
            if plan.max_tokens is None or plan.max_tokens > int(value):
                raise plan.refuse(layer, f"a sliding window of {value} tokens", "needs max_tokens <= it")
        elif key == "is_causal":
            if not value:
                raise plan.refuse(layer, "bidirectional attention (is_causal=False)", "the node is causal")
        elif key == "output_attentions":
            if value:
                raise plan.refuse(layer, "output_attentions=True", "the node returns no attention weights")
        else:  # softcap
            raise plan.refuse(layer, f"soft-capping ({key}={value})", "needs a node kernel")
    q_scale = None
    if scaling is not None:
        default = head_dim**-0.5
        if abs(scaling - default) > 1e-12 * default:
            q_scale = scaling / default
    return LayerCall(q_scale, sinks)


def mask_refusal(plan: AttentionPlan, mask_function: Any, build: Any, kwargs: dict[str, Any]) -> str | None:
    """Why the node cannot apply the mask the model asks for (None: it can). The plain causal
    mask is an identity check, per forward. Another mask function (a window, a chunk) is
    accepted only under a declared `max_tokens`, and only when it selects exactly the causal
    positions for this forward (two boolean masks compared: windowed models pay it, the rest
    never do). `build` is sdpa_mask. The refusal is raised by the first layer that receives the
    mask (a model may build a sliding mask that no layer uses)."""
    if mask_function is causal_mask_function:
        return None
    if plan.max_tokens is not None:
        args = {**kwargs, "allow_is_causal_skip": False, "mask_function": mask_function}
        wanted = build(**args)
        causal = build(**{**args, "mask_function": causal_mask_function})
        if wanted is not None and causal is not None and torch.equal(wanted, causal):
            return None
    what = " + ".join(_mask_parts(mask_function)) or repr(mask_function)
    bound = "" if plan.max_tokens is None else f", and it differs from it within max_tokens={plan.max_tokens}"
    return f"the attention mask {what} is not the causal mask (plus left padding) the node applies{bound}"


def _mask_parts(mask_function: Any, depth: int = 0) -> list[str]:
    """The named pieces a transformers mask function is combined from (and_masks / or_masks
    close over them): sliding_window_overlay + causal_mask_function, chunked_overlay, ..."""
    name = getattr(mask_function, "__qualname__", "")
    cells = getattr(mask_function, "__closure__", None) or ()
    inner = [c.cell_contents for c in cells if _cell_is_set(c)]
    funcs = [f for v in inner for f in (v if isinstance(v, tuple) else (v,)) if callable(f)]
    if name.startswith(("and_masks.", "or_masks.")) and funcs and depth < 4:
        return [part for f in funcs for part in _mask_parts(f, depth + 1)]
    return [name.split(".<locals>")[0]] if name else []


def _cell_is_set(cell: Any) -> bool:
    try:
        return cell.cell_contents is not _UNSET
    except ValueError:  # a closure variable not yet bound
        return False


_UNSET = object()

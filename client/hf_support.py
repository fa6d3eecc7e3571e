"""Which transformers models the node computes exactly, and the checks that refuse the rest.

A node attends causally over a sequence's stored tokens and follows the attention spec the
sequence was opened with (protos/attention.py: per layer a window, chunks, a soft-cap, a scale);
it returns the output with its log-sum-exp. From that, what is exact and who does it:

    feature                                         how
    ----------------------------------------------  ------------------------------------------
    causal + left padding                           the node never stores pads
    sliding windows (per layer), chunked attention  the node, from the spec sent at open; it
    (Mistral, Qwen2/3, Gemma2/3, Cohere2, gpt-oss,  also releases the blocks no layer sees any
    PhiMoE, Exaone4, Llama 4), soft-capping (Gemma  more (cache_node/windows.py)
    2)
    custom scale (Granite, Gemma, GPT-2)            the client: q is pre-scaled by scaling *
                                                    sqrt(head_dim) (exact: scores are linear in q,
                                                    and the scale is known per call, not per open)
    attention sinks (gpt-oss `s_aux`)               the client: out * sigmoid(lse - sink), one
                                                    more softmax term, counted once

Everything else is refused with `UnsupportedModel` (an InvalidArgument) before the first token:
Doge's learned dynamic mask, ALiBi, bidirectional or packed masks, attention weights as output,
K and V of different head sizes (latent attention), layers that are not attention, models whose
attention never reaches transformers' attention interface, a mask or an argument that disagrees
with what the config declares for its layer, and any attention argument this module does not
know. Checks run once per cache (the config) and once per layer call (a handful of dict
lookups); none touches the tensors.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..protos.attention import LayerAttention, check_layers
from ..protos.errors import InvalidArgument
from .hf_masks import MaskKind, describe

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


_PLAIN = LayerAttention()


@dataclass(frozen=True)
class AttentionPlan:
    """What one model needs from the node, checked once when a PagedKVCache is made.

    `max_tokens`: the most tokens a row may hold (prompt + generated), or None for unbounded;
    `layers`: one LayerAttention per layer, sent with every open, or () when every layer is
    plain causal attention."""

    model_name: str
    num_layers: int
    max_tokens: int | None
    layers: tuple[LayerAttention, ...] = ()

    def refuse(self, layer: int | str, feature: str, detail: str) -> UnsupportedModel:
        return UnsupportedModel(self.model_name, layer, feature, detail)

    def layer(self, layer: int) -> LayerAttention:
        return self.layers[layer] if self.layers else _PLAIN

    def mask_kind(self, layer: int) -> MaskKind | None:
        """The mask the layer must receive from the model: what its spec makes the node do."""
        spec = self.layer(layer)
        if spec.window and spec.chunk:
            return ("both", 0)  # no transformers mask function is both: any mask is refused
        return ("window", spec.window) if spec.window else ("chunk", spec.chunk) if spec.chunk else None

    @property
    def masks(self) -> bool:
        """Some layer sees fewer keys than causal attention (positions must be left-padded)."""
        return any(layer.masks for layer in self.layers)


def reaches_attention_interface(model_class: type) -> bool:
    """Whether the model's attention modules call transformers' attention interface (where
    "pagedkv" is registered): the class says so, or its modeling file looks the function up
    there (StableLM does without saying). Bloom, MPT, GPT-Neo do neither."""
    if getattr(model_class, "_supports_attention_backend", False):
        return True
    module = sys.modules.get(model_class.__module__)
    return module is not None and "ALL_ATTENTION_FUNCTIONS" in vars(module)


def layer_attention(config: Any, model_name: str) -> tuple[LayerAttention, ...]:
    """Each layer's attention from the config, () when all are plain: windows and chunks from
    `layer_types` when the config has them (Gemma2/3, Cohere2, Qwen2/3, gpt-oss, Llama 4, ...),
    else `sliding_window` (Mistral, Phi3, PhiMoE) or `attention_chunk_size` on every layer;
    `attn_logit_softcapping` (Gemma 2) on every layer."""
    config = config.get_text_config(decoder=True)
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or None
    chunk = getattr(config, "attention_chunk_size", None) or None
    softcap = getattr(config, "attn_logit_softcapping", None) or 0.0
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        use = getattr(config, "use_sliding_window", True)
        layer_types = ["sliding_attention" if window and use else "full_attention"] * num_layers
        if chunk:
            layer_types = ["chunked_attention"] * num_layers
    if len(layer_types) < num_layers:
        raise UnsupportedModel(
            model_name, "every layer", f"{len(layer_types)} layer types", f"{num_layers} layers"
        )
    layers = []
    for layer, kind in enumerate(layer_types[:num_layers]):
        if kind == "full_attention":
            layers.append(LayerAttention(softcap=softcap))
        elif kind == "sliding_attention" and window:
            layers.append(LayerAttention(window=int(window), softcap=softcap))
        elif kind == "chunked_attention" and chunk:
            layers.append(LayerAttention(chunk=int(chunk), softcap=softcap))
        else:
            raise UnsupportedModel(model_name, layer, f"layer type {kind!r}", "the node computes attention")
    return check_layers(layers, num_layers)


def plan_attention(model: Any, max_tokens: int | None = None) -> AttentionPlan:
    """Check that node attention computes `model` exactly; `max_tokens` bounds each row (None:
    unbounded).

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
    return AttentionPlan(name, num_layers, max_tokens, layer_attention(config, name))


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
    masks: Mapping[int, tuple[Any, MaskKind | str]],
) -> LayerCall:
    """Refuse an attention call the node would compute differently from the model (see the
    module docstring). `masks`: the masks handed out in this forward, by id: the kind each
    stands for, or why it was refused (hf_masks.recognise). None as an argument's value means
    "feature off" in transformers; any other value of an argument this module does not know
    is refused, and so is a window, soft-cap or mask that differs from the layer's spec."""
    want = plan.mask_kind(layer) if plan.layers else None
    if attention_mask is None:
        if want is not None:
            raise plan.refuse(layer, "a plain causal mask", f"the config declares {describe(want)} for it")
    else:
        seen = masks.get(id(attention_mask))
        if seen is None or seen[0] is not attention_mask:
            raise plan.refuse(
                layer,
                "a mask built by the model itself",
                "the attention received a mask that pagedkv's mask function did not make (the node masks "
                "by the sequence's spec and skips pads; it cannot apply another mask)",
            )
        kind = seen[1]
        if isinstance(kind, str):
            raise plan.refuse(layer, "its attention mask", kind)
        if kind != want:
            raise plan.refuse(
                layer, f"a mask of {describe(kind)}", f"the config declares {describe(want)} for it"
            )
    if dropout:
        raise plan.refuse(layer, f"dropout={dropout}", "pagedkv attention runs inference only (model.eval())")
    sinks = None
    spec = plan.layer(layer)
    for key, value in kwargs.items():
        if value is None or key in _PASSTHROUGH:
            continue
        if key not in _HANDLED:
            raise plan.refuse(layer, f"the attention argument {key!r}", "pagedkv does not know its effect")
        if key == "s_aux":
            sinks = value.detach().to("cpu", torch.float32).reshape(-1)
        elif key == "sliding_window":
            if value != spec.window:
                raise plan.refuse(
                    layer,
                    f"a sliding window of {value} tokens",
                    f"the config declares {describe(want)} for it",
                )
        elif key == "is_causal":
            if not value:
                raise plan.refuse(layer, "bidirectional attention (is_causal=False)", "the node is causal")
        elif key == "output_attentions":
            if value:
                raise plan.refuse(layer, "output_attentions=True", "the node returns no attention weights")
        elif value != spec.softcap:  # softcap
            raise plan.refuse(
                layer, f"soft-capping ({key}={value})", f"the config declares softcap={spec.softcap or None}"
            )
    q_scale = None
    if scaling is not None:
        default = head_dim**-0.5
        if abs(scaling - default) > 1e-12 * default:
            q_scale = scaling / default
    return LayerCall(q_scale, sinks)

"""The transformers families pagedkv was checked against, as one table: a new family is one row.

Each row is a tiny random model (2 layers, hidden 64, vocab 128, fp32: built from its config, no
download) and what pagedkv must do with it: compute it exactly ("exact": logits within 1e-4 of
the same weights on eager attention with DynamicCache) or refuse it before the first token
(a regex the UnsupportedModel message must match). Windows (16 tokens), chunks and soft-caps
are computed on the node from the spec sent at open, so the test's rows of up to 30 tokens go
past them; the node releases the blocks outside every window as they decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

VOCAB = 128
EXACT = "exact"
DROP = "<drop>"  # an override that removes a BASE key the config does not take

BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,  # clear winners among random logits: fewer greedy near-ties
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
BOTH_FULL = {"layer_types": ["full_attention", "full_attention"]}
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16}


@dataclass(frozen=True)
class Family:
    """One row: `config` names a transformers config class; `overrides` go on top of BASE (DROP
    removes a BASE key); `outcome` is EXACT or a refusal regex."""

    name: str
    config: str
    overrides: dict[str, Any] = field(default_factory=dict)
    outcome: str = EXACT

    @property
    def is_exact(self) -> bool:
        return self.outcome == EXACT

    def make_config(self, attn: str) -> Any:
        kwargs = {**BASE, **self.overrides}
        config = getattr(transformers, self.config)(**{k: v for k, v in kwargs.items() if v != DROP})
        config._attn_implementation = attn
        return config


QWEN_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
QWEN2_MOE = {**QWEN_MOE, "shared_expert_intermediate_size": 32}
LLAMA4 = {
    "intermediate_size_mlp": 128,
    "num_local_experts": 2,
    "head_dim": 16,
    "no_rope_layers": [1, 0],
    "layer_types": ["chunked_attention", "full_attention"],
}
GPT = {"num_key_value_heads": DROP, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
}
QWEN_SLIDING = {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}
DEEPSEEK = {
    "q_lora_rank": None,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 2,
    "n_group": 1,
    "topk_group": 1,
}

# fmt: off
FAMILIES = [
    # Llama and its variants: GQA, MHA, MQA, a large head, rope scalings.
    Family("llama-gqa", "LlamaConfig"),
    Family("llama-mha", "LlamaConfig", {"num_key_value_heads": 4}),
    Family("llama-mqa", "LlamaConfig", {"num_key_value_heads": 1}),
    Family("llama-head256", "LlamaConfig",
           {"head_dim": 256, "num_attention_heads": 2, "num_key_value_heads": 1}),
    Family("llama-rope-llama3", "LlamaConfig", {"rope_parameters": LLAMA3_ROPE}),
    Family("llama-rope-yarn", "LlamaConfig", {"rope_parameters": YARN_ROPE}),
    Family("qwen2", "Qwen2Config"),
    Family("qwen3", "Qwen3Config", {"head_dim": 16}),
    Family("qwen2-moe", "Qwen2MoeConfig", QWEN2_MOE),
    Family("qwen3-moe", "Qwen3MoeConfig", {**QWEN_MOE, "head_dim": 16}),
    Family("phi", "PhiConfig", {"partial_rotary_factor": 0.5, "qk_layernorm": True}),
    Family("phi3", "Phi3Config", {"partial_rotary_factor": 0.5}),
    Family("stablelm", "StableLmConfig", {"partial_rotary_factor": 0.25, "qk_layernorm": True}),
    Family("cohere", "CohereConfig", {"use_qk_norm": False}),
    Family("cohere2-full", "Cohere2Config", BOTH_FULL),
    Family("olmo2", "Olmo2Config"),
    Family("smollm3", "SmolLM3Config", {"no_rope_layers": [1, 0]}),
    Family("exaone4-full", "Exaone4Config", {**BOTH_FULL, "sliding_window": None}),
    Family("gemma2-full", "Gemma2Config",
           {**BOTH_FULL, "head_dim": 16, "attn_logit_softcapping": None, "query_pre_attn_scalar": 24}),
    Family("gemma3-full", "Gemma3TextConfig", {**BOTH_FULL, "head_dim": 16, "query_pre_attn_scalar": 24}),
    # Families without num_key_value_heads (multi-head attention).
    Family("gpt-neox", "GPTNeoXConfig", {"num_key_value_heads": DROP, "rotary_pct": 0.5}),
    Family("gpt2", "GPT2Config", GPT),
    Family("gpt2-layer-scaling", "GPT2Config", {**GPT, "scale_attn_by_inverse_layer_idx": True}),
    Family("gptj", "GPTJConfig", {**GPT, "rotary_dim": 8}),
    Family("opt", "OPTConfig", {"num_key_value_heads": DROP, "ffn_dim": 128, "word_embed_proj_dim": 64}),
    Family("falcon", "FalconConfig", {"num_key_value_heads": DROP}),
    Family("falcon-new-arch", "FalconConfig",
           {"num_key_value_heads": DROP, "new_decoder_architecture": True, "num_kv_heads": 2}),
    # ALiBi rides in the attention mask as a per-head bias.
    Family("falcon-alibi", "FalconConfig", {"num_key_value_heads": DROP, "alibi": True}, r"ALiBi"),
    Family("bloom", "BloomConfig", {"num_key_value_heads": DROP}, "own attention modules"),
    # A custom scale: exact by pre-scaling q.
    Family("granite", "GraniteConfig", {"attention_multiplier": 0.3}),
    # Sliding windows, chunks and soft-capping: on the node, from the spec sent at open.
    Family("mistral-sliding", "MistralConfig", {"sliding_window": 16}),
    Family("mistral-long-window", "MistralConfig", {"sliding_window": 64}),  # never reached
    Family("mixtral", "MixtralConfig", MOE),
    Family("mixtral-sliding", "MixtralConfig", {**MOE, "sliding_window": 16}),
    Family("cohere2-sliding", "Cohere2Config", SLIDING),
    Family("qwen2-sliding", "Qwen2Config", QWEN_SLIDING),
    Family("qwen3-sliding", "Qwen3Config", {**QWEN_SLIDING, "head_dim": 16}),
    # Qwen2-MoE counts its window layers the other way: the first max_window_layers, odd ones.
    Family("qwen2-moe-sliding", "Qwen2MoeConfig", {**QWEN2_MOE, **QWEN_SLIDING, "max_window_layers": 2}),
    Family("phimoe-sliding", "PhimoeConfig", {**MOE, "sliding_window": 16}),
    Family("exaone4-sliding", "Exaone4Config", SLIDING),
    # A cap well below the random models' scores, so that it changes them.
    Family("gemma2-softcap", "Gemma2Config", {**BOTH_FULL, "head_dim": 16, "attn_logit_softcapping": 1.0}),
    Family("gemma2", "Gemma2Config", {**SLIDING, "head_dim": 16, "attn_logit_softcapping": 2.0,
                                      "query_pre_attn_scalar": 24}),  # all three at once
    Family("gemma3-sliding", "Gemma3TextConfig", {**SLIDING, "head_dim": 16, "query_pre_attn_scalar": 24}),
    Family("llama4-chunked", "Llama4TextConfig", {**LLAMA4, "attention_chunk_size": 16}),
    # Attention sinks: exact from the LSE, on the client; with windows on the node.
    Family("gpt-oss-full", "GptOssConfig", {**MOE, **BOTH_FULL, "head_dim": 16}),
    Family("gpt-oss-sliding", "GptOssConfig", {**MOE, **SLIDING, "head_dim": 16}),
    # A learned dynamic mask: never exact.
    Family("doge", "DogeConfig", {"keep_window_size": 16}, r"dynamic mask"),
    # Attention the node does not store: latent K/V of another size, state-space layers.
    Family("deepseek-v3", "DeepseekV3Config", DEEPSEEK, r"multi-head latent attention"),
    Family("jamba", "JambaConfig", {"num_experts": 1, "attn_layer_period": 2, "attn_layer_offset": 1,
           "expert_layer_period": 2}, r"JambaForCausalLM layer 0: layer type 'linear_attention'"),
]
# fmt: on
BY_NAME = {f.name: f for f in FAMILIES}


def build(family: Family, attn: str, seed: int = 0) -> Any:
    """The family's tiny causal LM (random weights from `seed`, fp32, eval mode)."""
    torch.manual_seed(seed)
    config = family.make_config(attn)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    model.generation_config.pad_token_id = 0
    return model

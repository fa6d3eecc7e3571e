"""The KV shape of a transformers model, read from its config.json without importing
transformers (so `pagedkv up --model PATH` works from a node's or a coordinator's install).

It computes what `pagedkv.client.transformers.node_spec` computes from a loaded config:
layers, KV heads (num_key_value_heads, else num_attention_heads), head_dim (else
hidden_size // num_attention_heads), and the model's dtype. Multimodal configs keep the
language model's numbers under `text_config`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .usage import UsageError

KV_DTYPES = ("float32", "float16", "bfloat16")


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json of a model folder (or the file itself); UsageError when absent or not JSON."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise UsageError(f"--model {path}: no {file} (give a model folder with a config.json)") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"--model {path}: cannot read {file}: {exc}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"--model {path}: {file} is not a JSON object")
    text = raw.get("text_config")
    return {**raw, **text} if isinstance(text, dict) else raw


def kv_shape(path: str | Path) -> dict[str, Any]:
    """{num_layers, num_kv_heads, head_dim, dtype} of the model at `path`."""
    c = read_config(path)
    try:
        layers = int(c["num_hidden_layers"])
        heads = int(c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise UsageError(
            f"--model {path}: config.json lacks a decoder's shape ({exc}); give --num-layers, "
            "--num-kv-heads and --head-dim instead"
        ) from None
    dtype = str(c.get("dtype") or c.get("torch_dtype") or "float32")
    return {
        "num_layers": layers,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": dtype if dtype in KV_DTYPES else "float32",
    }

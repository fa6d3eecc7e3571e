"""generate() on pagedkv: the hooks a model gets once, and the prompt's open before the forwards.

`install_hooks(model)` registers the forward hooks that hand each forward's token ids to the
PagedKVCache it runs with (hf_cache), and wraps the model's generate() so that a fresh cache
opens the prompt on the node first: the node keeps the longest cached prefix and the model is
fed only the rest (generate slices its input by the cache's length, which the open sets):

    generate(ids [B, T], num_beams=K)       pagedkv
    ------------------------------------    ---------------------------------------------------
    before the first forward                Open(row's real ids) for each of the B x K rows
    (cache opened by the caller, B rows)    Fork each row K - 1 times (the beams share blocks)
    first forward                           input_ids[:, start:]: only the uncached suffix
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch

from ..protos.errors import InvalidArgument
from .hf_cache import PagedKVCache, PrefixHit, post_forward_hook, pre_forward_hook

_HOOKED = "_pagedkv_hooks_installed"


def install_hooks(model: torch.nn.Module) -> None:
    """Hook the module that receives input_ids and the cache, once per model: the model itself
    (a causal LM's forward; OPT's skips its base model's), and its generate() (see
    _generate_with_reuse)."""
    if getattr(model, _HOOKED, False):
        return
    model.register_forward_pre_hook(pre_forward_hook, with_kwargs=True)
    model.register_forward_hook(post_forward_hook, with_kwargs=True)
    generate = getattr(model, "generate", None)
    if callable(generate):
        # An instance attribute, as transformers' own custom_generate does (functools.partial).
        wrapped = functools.partial(_generate_with_reuse, model, generate)
        object.__setattr__(model, "generate", wrapped)  # not a submodule: bypass Module.__setattr__
    setattr(model, _HOOKED, True)


def _generate_with_reuse(model: torch.nn.Module, generate: Any, *args: Any, **kwargs: Any) -> Any:
    """model.generate(...): with a fresh PagedKVCache (reuse_prefix, the default) the prompt is
    opened first, so the model is fed only its uncached suffix; a cache the caller opened with
    fewer rows than generate will expand to is expanded by forking (beams share blocks)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, PagedKVCache) and not cache._is_closed:
        ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
        if isinstance(ids, torch.Tensor) and ids.ndim == 2:
            mask = kwargs.get("attention_mask")
            mask = torch.ones_like(ids) if mask is None else mask
            if cache.max_tokens is not None:
                _check_generate_bound(model, cache, ids, mask, kwargs)
            if cache.reuse_prefix or cache._seq_ids:
                open_for_generate(model, cache, ids, mask, kwargs)
    return generate(*args, **kwargs)


def _check_generate_bound(
    model: torch.nn.Module, cache: PagedKVCache, ids: torch.Tensor, mask: torch.Tensor, kwargs: dict[str, Any]
) -> None:
    """Refuse, before any token, a generate() that could take a row past the cache's max_tokens
    (each forward checks it too; this makes the refusal come before the first output)."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if new is None:
        max_length = kwargs.get("max_length", getattr(config, "max_length", None))
        new = None if max_length is None else int(max_length) - ids.shape[1]
    if new is None:
        return
    longest = int(torch.as_tensor(mask).sum(1).max()) + int(new)
    if longest > cast(int, cache.max_tokens):
        raise InvalidArgument(
            f"generate() could make a row {longest} tokens long (prompt + max_new_tokens), beyond this "
            f"cache's max_tokens={cache.max_tokens}"
        )


def open_for_generate(
    model: torch.nn.Module,
    cache: PagedKVCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    generate_kwargs: dict[str, Any],
) -> PrefixHit | None:
    """Make `cache` hold the rows generate() will run for `input_ids`: B x expand, where expand
    is num_beams or num_return_sequences (generate repeats each prompt that many times).

    A fresh cache opens the prompt (expanded) and returns what it found; a cache already opened
    with B rows is forked to B x expand (each prompt's copies share its blocks); one already at
    B x expand is left as it is. Returns the open's PrefixHit (None when nothing was opened)."""
    config = generate_kwargs.get("generation_config") or getattr(model, "generation_config", None)
    beams = generate_kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1
    returns = generate_kwargs.get("num_return_sequences", getattr(config, "num_return_sequences", 1)) or 1
    expand = max(int(beams), int(returns))
    num_rows = input_ids.shape[0]
    if not cache._seq_ids:
        ids, mask = input_ids, attention_mask
        if expand > 1:
            ids, mask = ids.repeat_interleave(expand, 0), mask.repeat_interleave(expand, 0)
        return cache.open_prompt(ids, mask)
    if expand > 1 and len(cache._seq_ids) == num_rows:
        cache.batch_repeat_interleave(expand)
    return None

"""Which backend serves a call (attention/__init__.py lists them), chosen per call or by env."""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType
from typing import Literal

import torch
from torch import Tensor

from pagedkv.protos.errors import FailedPrecondition, InvalidArgument

from . import cpu_kernel
from .spec import AttentionSpec

logger = logging.getLogger("pagedkv.cache_node.attention")

Backend = Literal["auto", "kernel", "triton", "torch"]
BACKEND_ENV = "PAGEDKV_ATTENTION_BACKEND"


@functools.cache
def load_triton() -> ModuleType | None:
    """triton_backend, imported on first use (importing triton takes a second, and on a
    machine without CUDA it puts triton in interpreter mode); None when triton is missing."""
    from . import triton_backend

    if not triton_backend.IS_AVAILABLE:
        logger.info("paged attention: triton is not installed; CUDA tensors use the torch path")
        return None
    return triton_backend


def pick_backend(backend: Backend | None, device: torch.device) -> str:
    choice = backend or os.environ.get(BACKEND_ENV, "auto")
    if choice not in ("auto", "kernel", "triton", "torch"):
        raise InvalidArgument(f"backend must be 'auto', 'kernel', 'triton' or 'torch', got {choice!r}")
    if choice == "torch":
        return "torch"
    if choice == "triton":
        tri = load_triton()
        if tri is None:
            raise FailedPrecondition("backend 'triton' needs the triton package (pip install pagedkv[gpu])")
        if device.type == "cpu" and not tri.IS_INTERPRETED:
            raise InvalidArgument("the triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
        return "triton"
    if device.type != "cpu":
        if choice == "kernel":
            raise InvalidArgument(f"the C++ kernel runs on CPU tensors only, got {device}")
        tri = load_triton()
        return "triton" if tri is not None and not tri.IS_INTERPRETED else "torch"
    fn, info = cpu_kernel.get_kernel()
    if fn is None:
        if choice == "kernel":
            raise FailedPrecondition(f"paged attention kernel unavailable: {info.detail}")
        return "torch"
    return "kernel"


def score_mods(spec: AttentionSpec, q: Tensor) -> object:
    """The Triton kernels' compile-time score hooks for a spec (the scale travels apart)."""
    tri = load_triton()
    assert tri is not None
    if spec.is_plain:
        return tri.NO_MODS
    return tri.ScoreMods(spec.window, spec.chunk, spec.softcap, spec.sinks_tensor(q.device))

"""Paged attention over one layer of the node's block pool.

The pool is `kv[num_layers, 2, num_blocks, Hk, block_size, D]`; these functions take one layer's
`k_cache = kv[layer, 0]` and `v_cache = kv[layer, 1]` ([num_blocks, Hk, block_size, D], contiguous)
after the engine has appended the new tokens (append-then-attend). Token t of a sequence lives in
physical block `table[t // block_size]` at offset `t % block_size`:

    logical blocks   | 0            | 1            | 2       ...  |
    block table      | 7            | 2            | 9            |   (any order, may be shared)
    tokens           | 0 .. bs-1    | bs .. 2bs-1  | 2bs .. len-1 |   (last block may be partial)

Every result carries the natural-log LSE of the scaled scores, so attention computed by several nodes
over disjoint key sets merges exactly (`merge_partials`, the flash-decoding merge), and optionally the
attention mass per logical block, which feeds the attention-score-aware eviction policy.

Three backends with one contract:
- "kernel": `../csrc/paged_attention.cpp` (`cpu_kernel.py`), a C++/OpenMP kernel that walks the
  blocks in place (no gather), built on first use with the system C++ compiler and cached on disk,
  called via ctypes. Decode on CPU tensors.
- "triton": `triton_backend.py` (kernels in `triton_kernels.py`), decode and prefill walking the
  block tables on the device. The default on CUDA tensors when triton is installed; on CPU tensors
  only in Triton's interpreter (the tests).
- "torch": gather the blocks into [B, Hk, L, D] with one index_select, then matmuls with the query
  heads of each KV head folded together. Used whenever the others are unavailable.
Pick one per call (`backend=`) or process-wide with PAGEDKV_ATTENTION_BACKEND=auto|kernel|triton|torch.
Prefill on CPU uses torch's flash kernel (or explicit matmuls when block mass is asked for).

Modules: `output.py` (the result type), `backends.py` (picking a backend), `checks.py` (the input checks every
entry point shares), `decode.py` / `prefill.py` (the entry points), `torch_decode.py` + `gather.py`
(the torch path), `cpu_kernel.py`, `triton_backend.py` + `triton_kernels.py`, `spec.py` (windows,
chunks, soft-cap, sinks, scale).
"""

from pagedkv.protos.merge import merge_partials  # the node's and the client's one merge

from .backends import BACKEND_ENV, Backend
from .cpu_kernel import KernelInfo, kernel_info
from .decode import paged_decode
from .gather import release_workspace
from .output import AttentionOutput
from .prefill import paged_prefill
from .spec import PLAIN, AttentionSpec

__all__ = [
    "BACKEND_ENV",
    "PLAIN",
    "AttentionOutput",
    "AttentionSpec",
    "Backend",
    "KernelInfo",
    "kernel_info",
    "merge_partials",
    "paged_decode",
    "paged_prefill",
    "release_workspace",
]

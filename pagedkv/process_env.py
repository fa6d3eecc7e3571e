"""The environment every pagedkv process starts with.

torch's native libraries read these once, when torch is first imported, so they are set before
that: by the `pagedkv` command for itself and every process it starts (`pagedkv up`, `pagedkv
demo`), and by the benchmarks. A value already in the environment wins. Imports no torch.

- THP_MEM_ALLOC_ENABLE=1: transparent huge pages for torch's large allocations. A fresh 100+ MB
  tensor (a streamed KV range, a gathered batch) otherwise pays a page fault per 4 KiB, ~4x slower
  on the VMs measured here.
- GOMP_SPINCOUNT=30000: a torch intra-op thread that finishes its share of an op spins ~1 ms
  (30,000 pauses, ~35 ns each on the EPYC measured) for the next one, then sleeps; libgomp's
  default is 300,000 (~10 ms). A node and its workers share a host's cores and hand control back
  and forth every layer: a thread still spinning holds a core the other process needs, and on a
  busy host a spinning team waits out its descheduled member. Measured on a 2-core VM (bench/
  README.md, "threads"): with other work running, a 2-thread matmul took 16 ms with the default
  spin, ~4-5 ms with a passive wait; quiet, the passive wait (a futex wake per op) cost a model's
  own compute 15-30%, and the bounded spin neither.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import warnings
from collections.abc import MutableMapping

DEFAULTS: dict[str, str] = {
    "THP_MEM_ALLOC_ENABLE": "1",
    "GOMP_SPINCOUNT": "30000",
}


def apply_defaults(environ: MutableMapping[str, str] | None = None) -> None:
    """Set each of DEFAULTS the environment does not set already (os.environ by default).
    Warns when torch is already imported in this process: its libraries have read theirs."""
    target = os.environ if environ is None else environ
    missing = {k: v for k, v in DEFAULTS.items() if k not in target}
    target.update(missing)
    if missing and environ is None and "torch" in sys.modules:
        warnings.warn(
            f"pagedkv: {', '.join(missing)} set after torch was imported; "
            "they take effect in child processes only",
            RuntimeWarning,
            stacklevel=2,
        )


def freeze_at_exit() -> None:
    """At exit, move every live object to the collector's permanent generation (gc.freeze): the
    interpreter's last collections then skip torch's object graph, which took a node process
    1-3 s to exit on a loaded 2-core VM (0.6-1 s frozen). Files still close and atexit hooks
    still run (refcounts free what they hold); only cycles alive at exit are left to the OS."""
    atexit.register(_freeze)


def _freeze() -> None:
    # nanobind extensions (triton's) count objects never collected as leaks and print each at exit
    if "triton" not in sys.modules:
        gc.freeze()


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a process pagedkv starts: DEFAULTS, overridden by this process's
    environment, then by `extra`."""
    return {**DEFAULTS, **os.environ, **(extra or {})}

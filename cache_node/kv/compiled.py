"""The manager whose open, reserve and free run compiled (csrc/lifecycle.c), for a manager
without prefix caching on the compiled pool.

There a sequence's lifecycle is a few list operations around the pool's take and release,
and Python frames cost more than the work. `KVCacheManager(...)` with `native=True` and
`enable_prefix_caching=False` builds this subclass, whose base is the compiled Lifecycle
type: its methods take the usual case and call KVCacheManager's own for the rest, so the
Python methods stay the reference (tests/unit/test_block_core_lifecycle.py runs both).
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import TYPE_CHECKING, Any

from ..block_core import get_core
from .sequence import NO_HIT, Sequence

if TYPE_CHECKING:
    from ..kv_manager import KVCacheManager

_FIRST = ("seq_id", "root", "tokens", "table", "keys", "scores")  # set by open(); the rest by default
_classes: dict[type, Any] = {}


def compiled_class(base: type[KVCacheManager]) -> Any:
    """The compiled subclass of `base` (KVCacheManager), or None without the compiled core."""
    if base not in _classes:
        core = get_core()[0]
        names = [f.name for f in fields(Sequence)]
        defaults = tuple(f.default for f in fields(Sequence)[len(_FIRST) :])
        if core is None or tuple(names[: len(_FIRST)]) != _FIRST or MISSING in defaults:
            _classes[base] = None
        else:
            slots = tuple(vars(Sequence)[name] for name in names)

            def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                base.__init__(self, *args, **kwargs)
                self.bind(
                    self.seqs,
                    self.device,
                    self.device.compiled_core,
                    self.counters,
                    self.tiers,
                    self.prefix.root(b""),
                    self.block_size,
                    Sequence,
                    slots,
                    defaults,
                    NO_HIT,
                    base.open,
                    base.reserve,
                    base.free,
                    self.decoder,
                )

            _classes[base] = type(
                "CompiledKVCacheManager",
                (core.Lifecycle, base),
                {"__init__": __init__, "__doc__": base.__doc__, "__module__": base.__module__},
            )
    return _classes[base]

"""ReuseClasses: which sizes of uncached run the workload asks for again, learned online.

Placement sends scans (long prompts nobody continues: a pasted document, a one-shot
summarisation) to one node in a fixed order, so that they flush one node's cache instead of
every node's (placement.py). What a scan looks like depends on the workload: in a chat service
the long uncached runs are documents that never come back, in an agent trace they are the long
contexts every later turn extends. So the coordinator learns it from what it sees:

- after each open it records the open's first uncached key with the size class of its uncached
  run (placement.size_class: 1, 2-3, 4-7, ... blocks), in a bounded memory of recent opens;
- when a later open's cached prefix passes a recorded key, the run that key started was
  continued: its class gets a reuse;
- a class is a scan class when it has seen at least `min_opens` opens (decayed), its runs are
  at least as long as the mean run (only long runs flush a cache: sending short one-shot
  prompts to one node would spend that node's share of the opens on little data), and its
  reuse rate is below `scan_ratio` times the rate over all classes.

Counts decay by `half_life_opens`, so a change of workload is followed. Everything here is the
coordinator's own memory: after a restart it learns again (no scans until `min_opens`), and
replicas learn each from the opens it placed. Not thread-safe: the caller holds its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from pagedkv.protos.errors import InvalidArgument

from .placement import size_class

_MAX_CLASSES = 48  # size classes of runs up to 2**47 blocks: beyond any pool


@dataclass(frozen=True)
class ReuseConfig:
    """half_life_opens: how fast old opens stop counting; min_opens: opens a class needs before
    it can be a scan class; scan_ratio: a scan class is reused less than this times the mean;
    memory: recent opens' first uncached keys remembered (16-byte keys: ~6 MB at 64 Ki)."""

    half_life_opens: float = 1024.0
    min_opens: float = 32.0
    scan_ratio: float = 0.5
    memory: int = 1 << 16

    def __post_init__(self) -> None:
        for name in ("half_life_opens", "min_opens", "scan_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < float("inf"):
                raise InvalidArgument(f"ReuseConfig.{name} must be a finite number >= 0, got {value!r}")
        if self.half_life_opens <= 0:
            raise InvalidArgument(f"ReuseConfig.half_life_opens must be > 0, got {self.half_life_opens!r}")
        if not isinstance(self.memory, int) or isinstance(self.memory, bool) or self.memory < 1:
            raise InvalidArgument(f"ReuseConfig.memory must be an int >= 1, got {self.memory!r}")


class ReuseClasses:
    """Decayed opens and reuses per size class; `scan_classes()` is placement's bit mask."""

    def __init__(self, config: ReuseConfig | None = None) -> None:
        self.config = config or ReuseConfig()
        # Counts are kept scaled by a growing factor (O(1) decay: add `growth`, read value / growth).
        self._step = 2.0 ** (1.0 / self.config.half_life_opens)
        self._growth = 1.0
        self._opens = [0.0] * _MAX_CLASSES
        self._reuses = [0.0] * _MAX_CLASSES
        self._run_blocks = 0.0  # decayed sum of uncached run lengths (their mean gates scans)
        self._marks: OrderedDict[bytes, int] = OrderedDict()  # first uncached key -> its run's class
        self._mask = 0
        self._num_observed = 0

    def scan_classes(self) -> int:
        """Bit c set: runs of size class c are scans now. Changes nothing; O(1)."""
        return self._mask

    def observe(self, cached_keys: Iterable[bytes], first_uncached: bytes | None, run_blocks: int) -> None:
        """One open placed: `cached_keys` are the keys it found cached on its node (a recorded key
        among them was continued), `first_uncached` the key its uncached run starts with (None
        when it had none, or a run under one block), `run_blocks` that run's length."""
        marks = self._marks
        self._growth *= self._step
        if self._growth > 1e100:  # rescale before the factor overflows
            self._opens = [v / self._growth for v in self._opens]
            self._reuses = [v / self._growth for v in self._reuses]
            self._run_blocks /= self._growth
            self._growth = 1.0
        growth = self._growth
        if marks:
            for key in cached_keys:
                cls = marks.pop(key, None)
                if cls is not None:
                    self._reuses[cls] += growth
        cls = min(size_class(run_blocks), _MAX_CLASSES - 1)
        self._opens[cls] += growth
        self._run_blocks += growth * run_blocks
        if first_uncached is not None:
            marks[first_uncached] = cls
            marks.move_to_end(first_uncached)
            if len(marks) > self.config.memory:
                marks.popitem(last=False)
        self._num_observed += 1
        if self._num_observed % 16 == 0 or self._num_observed <= 16:  # the mask moves slowly
            self._mask = self._compute_mask()

    def _compute_mask(self) -> int:
        opens, reuses = self._opens, self._reuses
        total = sum(opens)
        if total <= 0:
            return 0
        mean_run = self._run_blocks / total
        limit = self.config.scan_ratio * sum(reuses) / total
        min_opens = self.config.min_opens * self._growth
        mask = 0
        for cls in range(1, _MAX_CLASSES):
            n = opens[cls]
            # A class holds runs of [2**(cls-1), 2**cls) blocks: long when its shortest reaches the mean.
            if n >= min_opens and n > 0 and 1 << (cls - 1) >= mean_run and reuses[cls] < limit * n:
                mask |= 1 << cls
        return mask

    def stats(self) -> dict[int, tuple[float, float]]:
        """{class: (decayed opens, decayed reuses)} for classes seen; for tools and tests."""
        g = self._growth
        return {
            c: (self._opens[c] / g, self._reuses[c] / g) for c in range(_MAX_CLASSES) if self._opens[c] > 0
        }

"""ReuseClasses: which sizes of uncached run the workload asks for again, learned online.

Placement sends scans (long prompts nobody continues: a pasted document, a one-shot
summarisation) to one node in a fixed order, so that they flush one node's cache instead of
every node's (placement.py). What a scan looks like depends on the workload: in a chat service
the long uncached runs are documents that never come back, in an agent trace they are the long
contexts every later turn extends. So the coordinator learns it from what it sees:

- after each open it records the open's first uncached key with the size class of its uncached
  run (placement.size_class: 1, 2-3, 4-7, ... blocks), in a bounded memory of recent opens;
- when a later open's cached prefix passes a recorded key, the run that key started was
  continued: its class gets a reuse. A chain key names its block position (it hashes every
  block before it), so marks are looked up only at the positions that hold one: an open that
  hits a long prefix costs the marked positions below it, not a lookup per cached block;
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
from pagedkv.protos.keys import KEY_BYTES

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
        # first uncached key -> (its run's class, its block position); marks at each position
        self._marks: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._marked_at: dict[int, int] = {}
        self._mask = 0
        self._num_observed = 0

    def scan_classes(self) -> int:
        """Bit c set: runs of size class c are scans now. Changes nothing; O(1)."""
        return self._mask

    def observe(self, keys: bytes, cached_blocks: int, run_blocks: int) -> None:
        """One open placed: `keys` are its prompt's chain keys (packed, KEY_BYTES each), of which
        the first `cached_blocks` were cached on its node (a recorded key among them was
        continued); the key after them (if `keys` goes on) starts its uncached run of
        `run_blocks` blocks."""
        marks = self._marks
        self._growth *= self._step
        if self._growth > 1e100:  # rescale before the factor overflows
            self._opens = [v / self._growth for v in self._opens]
            self._reuses = [v / self._growth for v in self._reuses]
            self._run_blocks /= self._growth
            self._growth = 1.0
        growth = self._growth
        if marks and cached_blocks > 0:
            marked_at = self._marked_at
            if len(marked_at) < cached_blocks:
                positions: Iterable[int] = [p for p in marked_at if p < cached_blocks]
            else:
                positions = range(cached_blocks)
            for p in positions:
                mark = marks.pop(keys[p * KEY_BYTES : (p + 1) * KEY_BYTES], None)
                if mark is not None:
                    self._reuses[mark[0]] += growth
                    self._unmark(mark[1])
        cls = min(size_class(run_blocks), _MAX_CLASSES - 1)
        self._opens[cls] += growth
        self._run_blocks += growth * run_blocks
        first_uncached = keys[cached_blocks * KEY_BYTES : (cached_blocks + 1) * KEY_BYTES]
        if len(first_uncached) == KEY_BYTES:
            old = marks.get(first_uncached)
            if old is None or old[1] != cached_blocks:  # (a key at another position: not a chain's)
                if old is not None:
                    self._unmark(old[1])
                self._marked_at[cached_blocks] = self._marked_at.get(cached_blocks, 0) + 1
            marks[first_uncached] = (cls, cached_blocks)
            marks.move_to_end(first_uncached)
            if len(marks) > self.config.memory:
                self._unmark(marks.popitem(last=False)[1][1])
        self._num_observed += 1
        if self._num_observed % 16 == 0 or self._num_observed <= 16:  # the mask moves slowly
            self._mask = self._compute_mask()

    def _unmark(self, position: int) -> None:
        left = self._marked_at[position] - 1
        if left:
            self._marked_at[position] = left
        else:
            del self._marked_at[position]

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

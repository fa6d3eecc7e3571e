"""pagedkv's benchmarks: `python -m bench.<name> --help`; results in bench/README.md."""

import atexit
import gc
import sys

from pagedkv.process_env import apply_defaults

# Every benchmark runs with the environment pagedkv's own processes get (the same for both
# sides of every comparison), set here because this package is imported before torch.
apply_defaults()


# pagedkv.process_env.freeze_at_exit, spelled out: this package also runs beside older pagedkv
# trees (--baseline, bench.versus) that lack it. Each process exits in a second, not several.
@atexit.register
def _freeze() -> None:
    if "triton" not in sys.modules:  # triton's nanobind would print every frozen object as a leak
        gc.freeze()

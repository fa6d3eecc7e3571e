"""pagedkv's benchmarks: `python -m bench.<name> --help`; results in bench/README.md."""

from pagedkv.process_env import apply_defaults, freeze_at_exit

# Every benchmark runs with the environment pagedkv's own processes get (the same for both
# sides of every comparison), set here because this package is imported before torch.
apply_defaults()
freeze_at_exit()  # each benchmark process exits in a second, not several (see there)

"""The `pagedkv` command: one entry point, a subcommand per role.

    pagedkv up           a local cluster (coordinator + nodes), until Ctrl-C
    pagedkv demo         the local cluster plus worker processes sharing system prompts
    pagedkv status       nodes, usage and hit rates of a running cluster
    pagedkv node         one cache node
    pagedkv coordinator  the control plane
    pagedkv health ADDR  exit 0 when ADDR's gRPC health service says SERVING

Each subcommand's module is imported only when it runs, so `pagedkv coordinator`
never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pagedkv.process_env import apply_defaults

# subcommand -> (module with main(argv), one-line help)
SUBCOMMANDS = {
    "up": ("pagedkv.cluster", "start a local cluster (coordinator + nodes) until Ctrl-C"),
    "demo": ("pagedkv.demo", "local cluster + workers sharing system prompts; prints and plots hit rates"),
    "status": ("pagedkv.status", "show the nodes, usage and hit rates of a running cluster"),
    "node": ("pagedkv.cache_node.cli", "run one cache node"),
    "coordinator": ("pagedkv.coordinator.cli", "run the coordinator"),
    "health": ("pagedkv.health", "probe a gRPC health service; exit 0 when SERVING"),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # before any subcommand imports torch; inherited by the processes it starts
    apply_defaults()
    parser = argparse.ArgumentParser(
        prog="pagedkv",
        description="pagedkv: a distributed paged KV-cache service for LLM inference.",
        epilog="Run `pagedkv <command> --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        raise SystemExit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        parser.error(f"unknown command {name!r}; choose one of {', '.join(SUBCOMMANDS)}")
    module = importlib.import_module(SUBCOMMANDS[name][0])
    module.main(rest)

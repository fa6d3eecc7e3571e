"""The `pagedkv` command: one entry point, a subcommand per role.

    pagedkv up           a local cluster (coordinator + nodes), until Ctrl-C
    pagedkv demo         the local cluster plus worker processes sharing system prompts
    pagedkv status       nodes, usage and hit rates of a running cluster
    pagedkv node         one cache node
    pagedkv coordinator  the control plane
    pagedkv health ADDR  exit 0 when ADDR's gRPC health service says SERVING

Each subcommand's module is imported only when it runs, so `pagedkv coordinator`
never imports torch. The roles are extras of one package (`pip install 'pagedkv[node]'`):
a command whose extra is not installed says which one to install instead of a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pagedkv import __version__
from pagedkv.process_env import apply_defaults, freeze_at_exit
from pagedkv.usage import fail

# subcommand -> (module with main(argv), one-line help)
SUBCOMMANDS = {
    "up": ("pagedkv.cluster", "start a local cluster (coordinator + nodes) until Ctrl-C"),
    "demo": ("pagedkv.demo", "local cluster + workers sharing system prompts; prints and plots hit rates"),
    "status": ("pagedkv.status", "show the nodes, usage and hit rates of a running cluster"),
    "node": ("pagedkv.cache_node.cli", "run one cache node"),
    "coordinator": ("pagedkv.coordinator.cli", "run the coordinator"),
    "health": ("pagedkv.health", "probe a gRPC health service; exit 0 when SERVING"),
}

# an optional distribution's import name -> the extra that brings it (pyproject.toml)
EXTRA_FOR_MODULE = {
    "torch": "node",
    "prometheus_client": "node",
    "redis": "coordinator",
    "hiredis": "coordinator",
    "transformers": "hf",
    "matplotlib": "hf",
}
# the extra each command needs as a whole (`up` and `demo` run every role on this machine)
EXTRA_FOR_COMMAND = {"up": "all", "demo": "all", "node": "node", "coordinator": "coordinator"}


def missing_extra_message(command: str, module: str) -> str:
    extra = EXTRA_FOR_COMMAND.get(command) or EXTRA_FOR_MODULE[module]
    return f"`pagedkv {command}` needs {module}, which is not installed: pip install 'pagedkv[{extra}]'"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # before any subcommand imports torch; inherited by the processes it starts
    apply_defaults()
    freeze_at_exit()
    parser = argparse.ArgumentParser(
        prog="pagedkv",
        description="pagedkv: a distributed paged KV-cache service for LLM inference.",
        epilog="Run `pagedkv <command> --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    parser.add_argument("-V", "--version", action="version", version=f"pagedkv {__version__}")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        raise SystemExit(0 if argv else 2)
    if argv[0] in ("-V", "--version"):
        parser.parse_args(argv[:1])
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        fail("pagedkv", f"unknown command {name!r}; choose one of {', '.join(SUBCOMMANDS)}")
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
        module.main(rest)
    except ModuleNotFoundError as exc:
        root = (exc.name or "").split(".")[0]
        if root not in EXTRA_FOR_MODULE:
            raise
        fail("pagedkv", missing_extra_message(name, root))

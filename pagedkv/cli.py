"""The `pagedkv` command (placeholder until the subcommands land)."""

def main() -> None:  # pragma: no cover - replaced below
    raise SystemExit("pagedkv: no subcommands yet")

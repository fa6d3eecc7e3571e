"""`python -m pagedkv ...` is the `pagedkv` command."""

from .cli import main

main()

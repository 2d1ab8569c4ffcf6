"""`python -m orchestrator.cli` is the `autoresearch` command."""

from orchestrator.cli import main

main()

"""`python -m orchestrator.faces.cli` is the `autoresearch` command."""

from orchestrator.faces.cli import main

main()

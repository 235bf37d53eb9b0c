"""Lets `python -m agent` run the CLI."""

from agent.cli import main

main()

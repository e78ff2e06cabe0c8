"""`python -m specula` runs the command line."""

from specula.cli import run

run()

#!/usr/bin/env bash
# The whole test suite: installs into .venv if needed, checks style, runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check specula tests
# One worker per core, at most 4 (each loads its own models: ~1-2 GiB), each test file on one worker (its module
# fixtures load once); `-n 0` runs in one process.
exec .venv/bin/python -m pytest -n auto --maxprocesses 4 --dist loadfile "$@"

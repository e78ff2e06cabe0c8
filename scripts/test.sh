#!/usr/bin/env bash
# The whole test suite: installs into .venv if needed, checks style, runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check specula tests
exec .venv/bin/python -m pytest "$@"

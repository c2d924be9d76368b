#!/usr/bin/env bash
# The whole check: lint, types, then the test suite. Run inside the project's environment
# (see the README's test command, which creates it). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== ruff"; ruff check gpujobs jobs tests bench scripts
echo "== mypy"; mypy
echo "== pytest"; python -m pytest "$@"

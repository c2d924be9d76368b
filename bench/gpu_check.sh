#!/usr/bin/env bash
# The one-GPU check (issue 25), within 10 min on one GPU: bench/gpu_check.py runs each check, says which
# need a GPU, runs the others on the CPU where there is none, and ends with one summary table.
# Exit 0: every check ran and passed; 3: all that ran passed, the GPU checks were skipped (no GPU); 1: a
# check failed; 2: no environment to run in. Usage: bash bench/gpu_check.sh [overrides for every run...]
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "gpu_check: $1" >&2; exit "${2:-1}"; }

# The environment's interpreter: $PYTHON if set, else `python`, else `python3` (GPU images often have only that).
py=${PYTHON:-$(command -v python || command -v python3 || true)}
[ -n "$py" ] || fail "no python or python3 on PATH" 2
"$py" -c 'import gpujobs.config.load, pynvml' 2>/dev/null || fail "gpujobs is not importable: activate the project's environment (README)" 2
exec "$py" bench/gpu_check.py "$@"

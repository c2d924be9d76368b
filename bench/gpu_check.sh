#!/usr/bin/env bash
# The GPU check (issues 25, 39), from a plain checkout with the node's own PyTorch: the checkout goes on
# PYTHONPATH (no `pip install -e .`), torch's, CUDA's and NCCL's versions are printed, and every module the
# check imports is tried first, one line for each missing (bench/gpu_check_env.py). `--wheelhouse DIR`
# installs the missing ones from DIR's wheels into a temporary folder put on PYTHONPATH, removed at the end:
# nothing else is touched (docs/guides/benchmarks.md says how to fill DIR, offline too). Then
# bench/gpu_check.py runs each check within its budget and the whole within `--deadline SECONDS` (540).
# Exit 0: every check ran and passed; 3: all that ran passed, the GPU checks were skipped (no GPU); 4: all
# that ran passed, the deadline left some unrun; 1: a check failed or ran out of its budget; 2: no
# environment to run in.
# Usage: bash bench/gpu_check.sh [--wheelhouse DIR] [--deadline S] [--table FILE] [--only NAME,...] [overrides...]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"

fail() { echo "gpu_check: $1" >&2; exit "${2:-1}"; }

# The environment's interpreter: $PYTHON if set, else `python`, else `python3` (GPU images often have only that).
py=${PYTHON:-$(command -v python || command -v python3 || true)}
[ -n "$py" ] || fail "no python or python3 on PATH" 2

wheels="" args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheelhouse) [ $# -ge 2 ] || fail "--wheelhouse needs a directory of wheels" 2; wheels=$2; shift 2 ;;
    --wheelhouse=*) wheels=${1#*=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
target=""
if [ -n "$wheels" ]; then
  [ -d "$wheels" ] || fail "--wheelhouse $wheels is not a directory" 2
  target=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_wheels.XXXXXX")
  trap 'rm -rf "$target"' EXIT
fi
export PYTHONPATH="$repo${target:+:$target}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$py" bench/gpu_check_env.py ${wheels:+--wheelhouse "$wheels" --target "$target"} || exit $?
"$py" bench/gpu_check.py ${args[@]+"${args[@]}"}

#!/usr/bin/env bash
# The whole check: lint, types, the test suite, then the installed wheel (scripts/wheel-check.sh), with
# a real throw-away Slurm cluster where this machine can run one (root + apt). Run inside the project's
# environment (the README's test command creates it). Extra arguments go to pytest.
#
# Without the cluster the Slurm tests skip with a reason; with CI set they fail instead, so a CI run
# can never go green by skipping them.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== ruff"; ruff check gpujobs jobs hydra_plugins tests bench scripts
echo "== mypy"; mypy

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "== slurm: bringing up the test cluster"
  if exports="$(bash scripts/local-slurm.sh up)"; then
    eval "$exports"
    trap 'bash scripts/local-slurm.sh down >/dev/null 2>&1 || true' EXIT
  else
    echo "!! local Slurm cluster did not come up: Slurm tests will skip (or fail under CI)" >&2
  fi
fi

echo "== pytest"; python -m pytest "$@"
# The wheel as users install it, run from outside the checkout (its dry runs use the cluster above).
echo "== wheel"; bash scripts/wheel-check.sh

#!/usr/bin/env bash
# The whole check: lint, types, the test suite, then the installed wheel (scripts/wheel-check.sh), with
# a real throw-away Slurm cluster where this machine can run one (root + apt), and the container tests' image
# (scripts/test-image.sh: cached, ~0.2 s when warm). Run inside the project's environment (the README's test
# command creates it). Extra arguments go to pytest.
#
# Without the cluster the Slurm tests skip with a reason; with CI set they fail instead, so a CI run
# can never go green by skipping them.
set -euo pipefail
cd "$(dirname "$0")/.."

# apt_install PACKAGE...: Debian's packages, from the apt cache (an outdated package list gets one update and
# a second try), as root. A postinst that would start a system daemon (prometheus, podman's units) is kept
# from it by a policy-rc.d that exits 101 (an existing one is kept). Returns apt's status; its log is kept.
apt_install() {
  local guard=/usr/sbin/policy-rc.d added=0 rc=0 aptlog
  aptlog="$(mktemp)"
  if [ ! -e "$guard" ]; then printf '#!/bin/sh\nexit 101\n' > "$guard"; chmod 755 "$guard"; added=1; fi
  local apt=(env DEBIAN_FRONTEND=noninteractive sh -c 'umask 022; exec "$@"' apt apt-get -y -q -o DPkg::Lock::Timeout=120)
  if ! "${apt[@]}" install --no-install-recommends "$@" >"$aptlog" 2>&1 </dev/null; then
    "${apt[@]}" update >>"$aptlog" 2>&1 </dev/null || true
    "${apt[@]}" install --no-install-recommends "$@" >>"$aptlog" 2>&1 </dev/null || rc=$?
  fi
  if [ "$added" = 1 ]; then rm -f "$guard"; fi
  if [ "$rc" != 0 ]; then echo "!! $* did not install ($aptlog): their tests will skip (or fail under CI)" >&2; fi
  return "$rc"
}

image_pid="" image_log=""
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  # Debian's prometheus + promtool for tests/test_prometheus.py (~15 s from the apt cache); podman with crun,
  # Charliecloud's ch-run and mmdebstrap for the container tests and their image (scripts/test-image.sh).
  # One apt run for whichever command is missing.
  missing_pkgs=()
  for want in prometheus:prometheus promtool:prometheus podman:podman crun:crun ch-run:charliecloud-runtime \
              mmdebstrap:mmdebstrap; do
    if ! command -v "${want%%:*}" >/dev/null && [[ " ${missing_pkgs[*]} " != *" ${want#*:} "* ]]; then
      missing_pkgs+=("${want#*:}")
    fi
  done
  if [ "${#missing_pkgs[@]}" -gt 0 ]; then
    echo "== packages: installing ${missing_pkgs[*]} (no daemon is started)"
    apt_install "${missing_pkgs[@]}" || true
  fi
  # The container tests' image: cold, 1.5-2.5 min on 2 busy cores (mmdebstrap 20-50 s, pip 40-60 s, podman
  # import ~30 s); warm, ~0.2 s. Built in the background beside the checks below (~30 s) and the cluster's
  # start, and waited for before pytest: no test's timeout then includes the build, and no timing-sensitive
  # test shares the cores with it. Only for the whole suite: with pytest arguments, a test that needs the
  # image builds it (its fixtures call the same script). A check below that fails leaves the build to finish
  # (a killed one would only be redone).
  if [ "$#" = 0 ]; then
    image_log="$(mktemp)"
    echo "== test image: building or checking it in the background (scripts/test-image.sh, log: $image_log)"
    # (as tests/conftest.py's fixtures do: this environment's python, whose pip and torch version it uses)
    GPUJOBS_TEST_IMAGE_PYTHON="$(command -v python)" bash scripts/test-image.sh podman >"$image_log" 2>&1 &
    image_pid=$!
  fi
fi

# TorchRec for parallel=torchrec and `gpujobs plan` (FBGEMM's CPU build, torchrec without its CUDA pin: ~10 s
# from pip's cache), as the README installs it
if ! python -c 'import torchrec, fbgemm_gpu' >/dev/null 2>&1; then
  echo "== torchrec: installing FBGEMM's CPU build and TorchRec (scripts/install-torchrec.sh cpu)"
  bash scripts/install-torchrec.sh cpu
fi

echo "== ruff"; ruff check gpujobs jobs hydra_plugins tests bench scripts docs
echo "== mypy"; mypy
echo "== import-linter"; lint-imports --no-cache
# the docs site, its reference generated from the code (docs/hooks/reference.py): quiet unless it fails. Not
# --quiet, which silences the warnings that --strict turns into a failure (and then passes).
echo "== docs"; site="$(mktemp -d)"; out="$(NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$site" 2>&1)" || { echo "$out"; exit 1; }; rm -rf "$site"
# the bench scripts and the docs hook too (not a package): the GPU ones run only where a GPU is lent, a typo costs that time
mypy bench docs/hooks

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "== slurm: bringing up the test cluster"
  # requeues restart after ~6 s (cred_expire 5, Slurm's minimum) and preemption requeues 15 s after the
  # signal: a tiny job saves in well under a second
  if exports="$(GPUJOBS_SLURM_CRED_EXPIRE="${GPUJOBS_SLURM_CRED_EXPIRE:-5}" \
                GPUJOBS_SLURM_GRACE_TIME="${GPUJOBS_SLURM_GRACE_TIME:-15}" bash scripts/local-slurm.sh up)"; then
    eval "$exports"
    trap 'bash scripts/local-slurm.sh down >/dev/null 2>&1 || true' EXIT
  else
    echo "!! local Slurm cluster did not come up: Slurm tests will skip (or fail under CI)" >&2
  fi
fi

if [ -n "$image_pid" ]; then
  # a failed build is not fatal here: the container tests' fixtures run the script again and report why
  # (they skip, or fail under CI)
  if wait "$image_pid"; then echo "== test image: $(tail -n 1 "$image_log")"
  else echo "!! the test image did not build (log: $image_log):" >&2; tail -n 20 "$image_log" >&2; fi
fi

echo "== pytest"
if [ "$#" -gt 0 ]; then
  python -m pytest "$@"
else
  # Two pytest runs side by side: the live Slurm tests one after another (they share the cluster's two
  # nodes, and some need them idle), with a few local files that even the two out (tests/conftest.py's
  # SLURM_LANE), and the others beside them, in the time the Slurm tests spend waiting on the scheduler. (pytest-xdist's loadgroup cannot keep them together under pytest 9: its group
  # suffix no longer reaches the test ids.) The others' output follows the Slurm tests' output.
  others_log="$(mktemp)"
  python -m pytest -m "not slurm and not slurm_lane" --basetemp="$(mktemp -d)" >"$others_log" 2>&1 &
  others=$!
  rc=0
  python -m pytest -m "slurm or slurm_lane" --basetemp="$(mktemp -d)" || rc=$?
  if ! wait "$others"; then rc=1; fi
  echo "== pytest: the tests that need no Slurm (run beside the Slurm tests)"
  cat "$others_log"
  if [ "$rc" != 0 ]; then exit "$rc"; fi
fi
# The wheel as users install it, run from outside the checkout (its dry runs use the cluster above).
echo "== wheel"; bash scripts/wheel-check.sh

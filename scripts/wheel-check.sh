#!/usr/bin/env bash
# The wheel as a user gets it: build it, check that it carries conf/ and sbatch_templates/, install it
# into a new venv (torch first, as the README says), and from a directory outside the checkout run
# `--cfg job` (also through the `gpujobs` console script, after its --help), the tiny rec job, and a
# Slurm dry run (single and -m sweep: the gpujobs Hydra plugins must be found in the installed
# hydra_plugins). Run with the project's environment active; it only builds with it. The dry runs need
# the test cluster (SLURM_CONF, see scripts/local-slurm.sh): without one they skip with a reason, or
# fail when CI is set, as the Slurm tests do.
#
# Wheels come from pip's usual sources (on this machine: a local index and /opt/wheels). pip runs with -qq:
# errors still print, warnings about the machine's index would bury them.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/gpujobs-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
fail() { echo "!! wheel-check: $*" >&2; exit 1; }
# Nothing of the checkout may leak into the installed run.
unset PYTHONPATH GPUJOBS_CONFIG_DIR GPUJOBS_SBATCH_TEMPLATES

echo "== wheel: build"
python -m pip wheel -qq --no-deps -w "$work/dist" "$repo"
wheels=("$work"/dist/gpujobs-*.whl)
[ "${#wheels[@]}" = 1 ] || fail "expected one gpujobs wheel, got: ${wheels[*]}"
wheel="${wheels[0]}"

echo "== wheel: file list"
python - "$wheel" "$repo" <<'EOF'
import sys
import zipfile
from pathlib import Path

wheel, repo = sys.argv[1], Path(sys.argv[2])
names = set(zipfile.ZipFile(wheel).namelist())
want = {"gpujobs/py.typed", "gpujobs/submit.py", "hydra_plugins/gpujobs_launcher/__init__.py", "jobs/rec/task.py"}
for top, packaged in (("conf", "gpujobs/_conf"), ("sbatch_templates", "gpujobs/_sbatch_templates")):
    files = [p for p in (repo / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    if not files:
        sys.exit(f"!! wheel-check: {repo / top} has no files")
    want |= {f"{packaged}/{p.relative_to(repo / top).as_posix()}" for p in files}
missing = sorted(want - names)
stray = sorted(n for n in names if n.split("/")[0] in {"conf", "sbatch_templates"})
if missing or stray:
    sys.exit(f"!! wheel-check: {wheel}: missing {missing}, top-level {stray}")
print(f"{len(names)} files, conf/ and sbatch_templates/ inside gpujobs/")
EOF

echo "== wheel: install into a new venv"
python -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -qq torch==2.13.0
"$py" -m pip install -qq "$wheel"

mkdir "$work/cwd" && cd "$work/cwd"  # outside the checkout: only the installed package can answer

echo "== wheel: resources come from the installed package"
"$py" - "$work/venv" <<'EOF'
import sys
from pathlib import Path

import gpujobs
from gpujobs.config.packaged import config_dir, template_dir

venv = Path(sys.argv[1]).resolve()
package = Path(gpujobs.__file__).resolve().parent
for found, packaged in ((config_dir(), "_conf"), (template_dir(), "_sbatch_templates")):
    if found != package / packaged or venv not in package.parents:
        sys.exit(f"!! wheel-check: {found} is not {packaged} of the installed package (in {venv})")
print(config_dir(), template_dir(), sep="\n")
EOF

echo "== wheel: --cfg job"
"$py" -m gpujobs.submit +experiment=rec --cfg job >cfg.txt || fail "--cfg job exited $?: $(cat cfg.txt)"
grep -qx "task: jobs.rec.task:build_task" cfg.txt || fail "--cfg job did not print the rec config: $(cat cfg.txt)"

echo "== wheel: the gpujobs command (console script of the installed wheel)"
"$work/venv/bin/gpujobs" --help >help.txt || fail "gpujobs --help exited $?: $(cat help.txt)"
for command in submit status logs cancel resubmit cost report; do
  grep -q "^  $command " help.txt || fail "gpujobs --help does not list $command: $(cat help.txt)"
done
"$work/venv/bin/gpujobs" submit +experiment=rec --cfg job >cfg.txt || fail "gpujobs submit --cfg job exited $?: $(cat cfg.txt)"
grep -qx "task: jobs.rec.task:build_task" cfg.txt || fail "gpujobs submit --cfg job did not print the rec config: $(cat cfg.txt)"

echo "== wheel: the tiny rec job (cluster=local)"
"$py" -m gpujobs.submit +experiment=rec +debug=tiny cluster=local hydra.run.dir="$work/cwd/run" \
  || fail "the tiny rec job exited $?"
"$py" - "$work/cwd/run/result.json" <<'EOF'
import json
import sys

result = json.load(open(sys.argv[1]))
if result.get("status") != "completed":
    sys.exit(f"!! wheel-check: {sys.argv[1]}: status {result.get('status')!r}, not 'completed'")
print(f"completed: {result['steps']} steps, world size {result['world_size']}")
EOF

if [ -z "${SLURM_CONF:-}" ] || ! command -v sbatch >/dev/null; then
  [ -n "${CI:-}" ] && fail "no Slurm cluster (SLURM_CONF, sbatch): the dry runs cannot run under CI"
  echo "== wheel: dry runs skipped: no Slurm cluster (SLURM_CONF, sbatch)"
  exit 0
fi
echo "== wheel: dry run (cluster=slurm)"
"$py" -m gpujobs.submit +experiment=rec cluster=slurm cluster.dry_run=true hydra.run.dir="$work/cwd/dry" >dry.txt \
  || fail "the dry run exited $?: $(cat dry.txt)"
# The queued script must start the installed package with the venv's interpreter.
grep -q -- "$py -u -m gpujobs.rank.srun" dry.txt || fail "the dry run did not render the job: $(cat dry.txt)"

echo "== wheel: sweep dry run (-m: the gpujobs launcher and sweeper from the installed hydra_plugins)"
"$py" -m gpujobs.submit -m +experiment=rec cluster=slurm cluster.dry_run=true trainer.seed=1,2 \
  hydra.sweep.dir="$work/cwd/sweep" >sweep.txt 2>&1 || fail "the sweep dry run exited $?: $(cat sweep.txt)"
grep -q "gpujobs launcher" sweep.txt && grep -q -- "--array=0-1" sweep.txt \
  || fail "the sweep did not go through the gpujobs launcher: $(cat sweep.txt)"
echo "== wheel: ok"

#!/usr/bin/env bash
# GPU check, for a machine with an NVIDIA GPU (and the CUDA build of torch):
#   1. a local gpujobs run of the rec experiment on the GPUs (NCCL when there are 2+, bf16 AMP on CUDA),
#   2. gpu.jsonl holds real NVML readings (utilization, memory, power) for the GPUs of the run,
#   3. the report plots them,
#   4. bench/bench_gpu.py: samples/s of the gpujobs Trainer against a plain loop on one GPU.
# Without a GPU it stops at once with one line and exit code 3. Usage: bash bench/gpu_check.sh [overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "gpu_check: $1" >&2; exit "${2:-1}"; }

python -c 'import gpujobs.config, pynvml' 2>/dev/null || fail "gpujobs is not importable: activate the project's environment (README)" 2
gpus=$(python - <<'PY'
from gpujobs.launch.gpus import local_gpu_count
print(local_gpu_count())
PY
)
[ "$gpus" -ge 1 ] || fail "no NVIDIA GPU here (NVML sees none); this check needs one" 3
python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || fail "NVML sees $gpus GPU(s) but torch has no CUDA: install the CUDA build of torch (README)" 3
ranks=$(( gpus >= 2 ? 2 : 1 ))   # 2 ranks exercise NCCL; one GPU gives one rank (no process group)
run_dir=$(mktemp -d)/run
echo "== gpujobs run: $ranks GPU rank(s), run dir $run_dir"
python -m gpujobs.submit +experiment=rec cluster=local "resources.gpus_per_node=$ranks" trainer.max_steps=400 \
  trainer.progress=false telemetry.interval_s=0.5 "hydra.run.dir=$run_dir" "$@"

echo "== checks"
python - "$run_dir" "$ranks" <<'PY'
import json, sys
from pathlib import Path

run, ranks = Path(sys.argv[1]), int(sys.argv[2])
result = json.loads((run / "result.json").read_text())
assert result["status"] == "completed" and result["world_size"] == ranks, result
logs = "".join(p.read_text() for p in (run / "submitit").glob("*_log.err"))
assert "cuda:" in logs, "ranks did not train on CUDA"
if ranks > 1:
    assert "backend nccl" in logs, "2 GPU ranks but no NCCL process group"
samples = [json.loads(line) for line in (run / "gpu.jsonl").read_text().splitlines()]
assert samples, "gpu.jsonl is empty"
assert {s["rank"] for s in samples} == set(range(ranks)), {s["rank"] for s in samples}
assert max(s.get("util_pct", 0) for s in samples) > 0, "GPU utilization never above 0"
assert min(s["mem_used_mib"] for s in samples) > 0 and all(s["mem_total_mib"] > 0 for s in samples)
assert any("power_w" in s for s in samples), "no power readings"
print(f"ok: {len(samples)} GPU samples, max util {max(s.get('util_pct', 0) for s in samples)}%, "
      f"samples/s {result['samples_per_s']}, auc {result['auc']}")
PY
python -m gpujobs.report "$run_dir"
test -s "$run_dir/report/gpu.png" || fail "report wrote no gpu.png"

echo "== trainer vs plain loop on one GPU"
python bench/bench_gpu.py --steps 300 --rounds 3

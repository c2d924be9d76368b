#!/usr/bin/env bash
# GPU check, for a machine with an NVIDIA GPU (and the CUDA build of torch). Takes ~5 min at most on an
# H200 (it must fit a 15-minute device budget: keep the step counts modest):
#   1. a local gpujobs run of the rec experiment on the GPUs, always in a real NCCL process group: 2 ranks
#      where there are 2+ GPUs, else one rank that still joins a group (GPUJOBS_FORCE_PROCESS_GROUP=1), so
#      DDP's gradient all-reduce goes through NCCL and every collective site of gpujobs runs (timing
#      all-gather, stop flag, checkpoint agreement, barriers; the group is cpu:gloo,cuda:nccl, see
#      gpujobs/run/distributed.py), with bf16 autocast (trainer.amp=auto on CUDA);
#   2. the telemetry path: gpu.jsonl holds real NVML readings for the GPUs of the run, and the run's
#      Prometheus endpoint (on 127.0.0.1) is scraped while it runs and serves job and GPU series;
#   3. the report plots them;
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
ranks=$(( gpus >= 2 ? 2 : 1 ))
# A check-only knob (gpujobs/run/distributed.py): one rank joins a process group too, so one GPU runs NCCL.
export GPUJOBS_FORCE_PROCESS_GROUP=1
run_dir=$(mktemp -d)/run
echo "== gpujobs run: $ranks GPU rank(s) in an NCCL group, run dir $run_dir"
# nccl=debug: NCCL logs its communicator's init ("Init COMPLETE"), the proof that NCCL itself was used.
python - "$run_dir" "$ranks" "$@" <<'PY'
import json, os, signal, subprocess, sys, time, urllib.request
from pathlib import Path

run, ranks, extra = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
cmd = [sys.executable, "-m", "gpujobs.submit", "+experiment=rec", "cluster=local", f"resources.gpus_per_node={ranks}",
       "trainer.max_steps=300", "trainer.progress=false", "nccl=debug", "telemetry.interval_s=0.5",
       "telemetry.prometheus_port=0", "telemetry.prometheus_addr=127.0.0.1", "telemetry.prometheus_linger_s=3",
       # CUDA paths of balancing and async saves: compute time from CUDA events, a pinned host snapshot
       "trainer.balance=dynamic", "trainer.balance_every=20", "checkpoint.async=true", "checkpoint.every_steps=50",
       f"hydra.run.dir={run}", *extra]
proc = subprocess.Popen(cmd, start_new_session=True)
deadline, scrape = time.monotonic() + 300, ""
while proc.poll() is None:
    if time.monotonic() > deadline:
        os.killpg(proc.pid, signal.SIGKILL)
        sys.exit("gpu_check: the run took over 300 s")
    info = run / "prometheus.json"
    if info.exists():
        try:
            with urllib.request.urlopen(json.loads(info.read_text())["url"], timeout=2) as response:
                scrape = response.read().decode()
        except (OSError, ValueError):  # not up yet, or closed between two polls
            pass
    time.sleep(0.5)
(run.parent / "scrape.txt").write_text(scrape)
sys.exit(proc.returncode)
PY

echo "== checks"
python - "$run_dir" "$ranks" <<'PY'
import json, sys
from pathlib import Path

run, ranks = Path(sys.argv[1]), int(sys.argv[2])
result = json.loads((run / "result.json").read_text())
assert result["status"] == "completed" and result["world_size"] == ranks, result
logs = "".join(p.read_text() for pattern in ("*_log.err", "*_log.out") for p in (run / "submitit").glob(pattern))
assert "cuda:" in logs, "ranks did not train on CUDA"
assert logs.count("backend cpu:gloo,cuda:nccl") == ranks, "not every rank joined the device-aware NCCL group"
assert "NCCL INFO" in logs and "Init COMPLETE" in logs, "no NCCL communicator was initialised"
train = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
train = [r for r in train if r["kind"] == "train"]
assert train and all(len(r["step_time_s"]) == ranks and min(r["step_time_s"]) > 0 for r in train), \
    "no train record holds every rank's gathered step time"
records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
assert all(min(r["compute_s_per_sample"]) > 0 for r in train), "no compute time measured (CUDA events)"
saves = [r for r in records if r["kind"] == "checkpoint"]
assert [r["async"] for r in saves].count(True) >= 5 and saves[-1]["async"] is False, saves
assert result["samples"] == 300 * 256 * ranks and result["saved"].endswith("step_00000300"), result
assert [r for r in records if r["kind"] == "plan"], "no split plan recorded"
samples = [json.loads(line) for line in (run / "gpu.jsonl").read_text().splitlines()]
assert samples, "gpu.jsonl is empty"
assert {s["rank"] for s in samples} == set(range(ranks)), {s["rank"] for s in samples}
assert max(s.get("util_pct", 0) for s in samples) > 0, "GPU utilization never above 0"
assert min(s["mem_used_mib"] for s in samples) > 0 and all(s["mem_total_mib"] > 0 for s in samples)
assert any("power_w" in s for s in samples), "no power readings"
prometheus = json.loads((run / "prometheus.json").read_text())
assert prometheus["addr"] == "127.0.0.1", prometheus
scrape = (run.parent / "scrape.txt").read_text()
assert 'gpujobs_step{job="rec"}' in scrape and "gpujobs_gpu_utilization_percent{" in scrape, \
    "the Prometheus endpoint did not serve job and GPU series"
print(f"ok: {len(train)} gathered train records, {len(samples)} GPU samples, "
      f"max util {max(s.get('util_pct', 0) for s in samples)}%, samples/s {result['samples_per_s']}, "
      f"auc {result['auc']}")
PY
python -m gpujobs.report "$run_dir"
test -s "$run_dir/report/gpu.png" || fail "report wrote no gpu.png"

echo "== trainer vs plain loop on one GPU"
python bench/bench_gpu.py --steps 300 --rounds 3

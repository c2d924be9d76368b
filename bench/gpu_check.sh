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
#   3. the health check at start on the real GPUs: NVML's checks (ECC, retired pages, row remaps,
#      temperature, throttling) called directly on every GPU, then the run itself with
#      cluster.health_check=true, whose NVML look and NCCL all-reduce probe must pass and be recorded;
#   4. the report plots them;
#   5. the hang watchdog's request for PyTorch's NCCL flight recorder (through its pipe) gets a dump;
#   6. what only a GPU shows of issue 25's fixes: a resume leaves Adam's step counters on the CPU and loads
#      no second copy of the state into GPU memory; a rank's CUDA stream is saved alone and restored where
#      fewer GPUs are seen; amp=auto trains bf16 from compute capability 8.0, fp32 before; batches are
#      gathered into pinned memory and copied without blocking (the host time to queue them is printed);
#   7. the straggler signal on CUDA: the compute clock leaves out what the GPU still had queued (the wait
#      in the last all-reduce) where the host clock over a blocking copy holds it, and the slow-GPU
#      emulation slows by the rank's own compute; with 2+ GPUs, a rank slowed that way under NCCL, in a job
#      that copies its batches blocking from pageable memory, is named the straggler;
#   8. bench/bench_gpu.py: samples/s of the gpujobs Trainer against a plain loop on one GPU;
#   9. GPUs by uuid (issue 25 item 3): with CUDA_DEVICE_ORDER=PCI_BUS_ID torch's device i is NVML's i-th
#      visible GPU and its uuid is NVML's; a local run under CUDA_VISIBLE_DEVICES=GPU-<uuid> (the last GPU)
#      trains there, and its rank, health check and gpu.jsonl name that uuid; more ranks than GPUs in an
#      NCCL group stop before NCCL in one line naming resources.gpus_per_node, never "Duplicate GPU detected".
# Without a GPU it stops at once with one line and exit code 3. Usage: bash bench/gpu_check.sh [overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "gpu_check: $1" >&2; exit "${2:-1}"; }

# The environment's interpreter: $PYTHON if set, else `python`, else `python3` (GPU images often have only that).
py=${PYTHON:-$(command -v python || command -v python3 || true)}
[ -n "$py" ] || fail "no python or python3 on PATH" 2

"$py" -c 'import gpujobs.config, pynvml' 2>/dev/null || fail "gpujobs is not importable: activate the project's environment (README)" 2
gpus=$("$py" - <<'PY'
from gpujobs.launch.gpus import local_gpu_count
print(local_gpu_count())
PY
)
[ "$gpus" -ge 1 ] || fail "no NVIDIA GPU here (NVML sees none); this check needs one" 3
"$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || fail "NVML sees $gpus GPU(s) but torch has no CUDA: install the CUDA build of torch (README)" 3
ranks=$(( gpus >= 2 ? 2 : 1 ))
echo "== NVML health checks on every GPU (gpujobs.nvml.gpu_faults)"
"$py" - <<'PY'
from gpujobs.nvml import gpu_faults, nvml_session, read_gpu, visible_gpus

with nvml_session() as nv:
    gpus = visible_gpus(nv)
    assert gpus, "NVML lists no GPU"
    for gpu in gpus:
        faults = gpu_faults(nv, gpu.handle, 90.0)
        now = read_gpu(nv, gpu.handle)
        print(f"GPU {gpu.index} ({gpu.uuid}): {now.get('temp_c')} C, throttle {now.get('throttle')}, "
              f"ECC uncorrected {now.get('ecc_uncorrected', 'not reported')}: {'; '.join(faults) or 'healthy'}")
        assert not faults, f"GPU {gpu.index} is not healthy, the run below would stop at its health check: {faults}"
PY
echo "== GPUs by uuid: torch and NVML name the same GPUs; a run on CUDA_VISIBLE_DEVICES=GPU-<uuid>"
uuid_dir=$(mktemp -d)
"$py" - "$uuid_dir/run" <<'PY'
import json, os, subprocess, sys
from pathlib import Path

from gpujobs.nvml import CUDA_ORDER_ENV, nvml_session, rank_gpu_uuid, visible_gpus

os.environ.update(CUDA_ORDER_ENV)  # before CUDA starts here, as every rank has it
import torch

with nvml_session() as nv:
    nvml = [(g.index, g.uuid) for g in visible_gpus(nv)]
ours = [rank_gpu_uuid(str(torch.cuda.get_device_properties(i).uuid)) for i in range(torch.cuda.device_count())]
assert ours == [uuid for _, uuid in nvml], f"torch's devices {ours} are not NVML's, in order: {nvml}"
print(f"ok: torch's cuda:i is NVML's GPU, by uuid: {nvml}")

run, (index, uuid) = Path(sys.argv[1]), nvml[-1]  # the last GPU: on 2+ GPUs no rank's cuda:0 is NVML's 0
env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid}
env.pop("GPUJOBS_FORCE_PROCESS_GROUP", None)
cmd = [sys.executable, "-m", "gpujobs.submit", "+experiment=rec", "cluster=local", "resources.gpus_per_node=1",
       "trainer.max_steps=40", "trainer.progress=false", "telemetry.interval_s=0.2", "cluster.health_check=true",
       f"hydra.run.dir={run}"]
subprocess.run(cmd, env=env, check=True, timeout=240)
result = json.loads((run / "result.json").read_text())
assert result["status"] == "completed", result
assert [(r["cuda_visible_devices"], r["gpu_uuid"]) for r in result["ranks"]] == [(uuid, uuid)], result["ranks"]
samples = [json.loads(line) for line in (run / "gpu.jsonl").read_text().splitlines()]
assert samples and {(s["gpu"], s["uuid"], s["rank"]) for s in samples} == {(index, uuid, 0)}, samples[:3]
health = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
health = [r for r in health if r["kind"] == "health"]
assert health and health[0]["nvml"][0].endswith("1 GPU checked"), health
print(f"ok: a run on CUDA_VISIBLE_DEVICES={uuid} trained on GPU {index}; its rank, gpu.jsonl "
      f"({len(samples)} samples) and health check name it")
PY

echo "== more ranks than GPUs in an NCCL group: one line naming resources.gpus_per_node, before NCCL"
"$py" - "$gpus" <<'PY'
import os, socket, subprocess, sys

from gpujobs.nvml import nvml_session, visible_gpus

with nvml_session() as nv:
    uuids = [g.uuid for g in visible_gpus(nv)]
rank_code = """
import sys
from gpujobs.errors import ConfigError
from gpujobs.run import distributed, jobenv
from gpujobs.schema import JobConfig
info = jobenv.detect()
try:
    distributed.init_process_group(info, JobConfig().nccl, 60)
    distributed.gather_ranks(info, distributed.device_for(info))
except ConfigError as err:
    print(f"refused: {err}", flush=True)
    sys.exit(2)
"""
# one GPU for 2 ranks (each sees 1: the second is told apart by uuid); 2 GPUs for 3 ranks where there are 2
for visible in sorted({1, min(int(sys.argv[1]), 2)}):
    ranks = visible + 1
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", rank_code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(uuids[:visible]),
                                              "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(ranks),
                                              "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
                                              "MASTER_PORT": str(port), "NCCL_DEBUG": "WARN"})
             for r in range(ranks)]
    outs = [proc.communicate(timeout=120)[0] for proc in procs]
    for proc, out in zip(procs, outs, strict=True):
        refused = [line for line in out.splitlines() if line.startswith("refused: ")]
        assert proc.returncode == 2 and len(refused) == 1, out
        assert refused[0].startswith(f"refused: resources.gpus_per_node={ranks} is invalid: allowed at most the "
                                     f"{visible} GPU"), out
        assert "CUDA_VISIBLE_DEVICES=" in refused[0] and "Duplicate GPU" not in out, out
    print(f"ok: {ranks} ranks on {visible} GPU(s): {refused[0]}")
PY

# A check-only knob (gpujobs/run/distributed.py): one rank joins a process group too, so one GPU runs NCCL.
export GPUJOBS_FORCE_PROCESS_GROUP=1
run_dir=$(mktemp -d)/run
echo "== gpujobs run: $ranks GPU rank(s) in an NCCL group, run dir $run_dir"
# nccl=debug: NCCL logs its communicator's init ("Init COMPLETE"), the proof that NCCL itself was used.
"$py" - "$run_dir" "$ranks" "$@" <<'PY'
import json, os, signal, subprocess, sys, time, urllib.request
from pathlib import Path

run, ranks, extra = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
cmd = [sys.executable, "-m", "gpujobs.submit", "+experiment=rec", "cluster=local", f"resources.gpus_per_node={ranks}",
       "trainer.max_steps=300", "trainer.progress=false", "nccl=debug", "telemetry.interval_s=0.5",
       "telemetry.prometheus_port=0", "telemetry.prometheus_addr=127.0.0.1", "telemetry.prometheus_linger_s=3",
       # CUDA paths of balancing and async saves: compute time from CUDA events, a pinned host snapshot
       "trainer.balance=dynamic", "trainer.balance_every=20", "checkpoint.async=true", "checkpoint.every_steps=50",
       "cluster.health_check=true",  # NVML's look at the GPUs and an NCCL all-reduce probe before step 1
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
"$py" - "$run_dir" "$ranks" <<'PY'
import json, sys
from pathlib import Path

import yaml

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
# log_every (20) = balance_every: a window's rows per rank are its record's plan, and on CUDA the local time
# the straggler check compares is the compute clock's: per sample x rows per step
accum = yaml.safe_load((run / "config.yaml").read_text())["trainer"]["grad_accum"]
for r in train:
    for local, per_sample, count in zip(r["local_time_s"], r["compute_s_per_sample"], r["counts"], strict=True):
        assert abs(local - per_sample * count * accum) <= 0.01 * local + 2e-6, ("local time is not the clock's", r)
saves = [r for r in records if r["kind"] == "checkpoint"]
assert [r["async"] for r in saves].count(True) >= 5 and saves[-1]["async"] is False, saves
assert result["samples"] == 300 * 256 * ranks and result["saved"].endswith("step_00000300"), result
assert [r for r in records if r["kind"] == "plan"], "no split plan recorded"
health = [r for r in records if r["kind"] == "health"]
assert len(health) == 1 and health[0]["healthy"] is True, health
checked = f"{ranks} GPU{'s' if ranks > 1 else ''} checked"
assert len(health[0]["nvml"]) == 1 and health[0]["nvml"][0].endswith(checked), \
    f"the health check did not look at the run's {ranks} GPU(s) through NVML: {health[0]['nvml']}"
assert ranks == 1 or health[0]["busbw_gbps"] > 0, health  # one rank: no link, nothing to measure
attempt = [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines()][-1]
assert attempt["reason"] == "completed" and attempt["health_s"] > 0, attempt
assert "health: all-reduce bus bandwidth" in logs and checked in logs, "the health check's outcome is not in the logs"
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
      f"auc {result['auc']}, health check {health[0]['health_s']} s (bus bandwidth {health[0]['busbw_gbps']} GB/s)")
PY
"$py" -m gpujobs.report "$run_dir"
test -s "$run_dir/report/gpu.png" || fail "report wrote no gpu.png"

echo "== the hang watchdog's NCCL flight recorder: a dump asked for through its pipe"
# The watchdog asks each NCCL rank for its flight recorder through the pipe TORCH_NCCL_DEBUG_INFO_PIPE_FILE
# names (gpujobs/run/evidence.py); a hang cannot be staged on one GPU, the request and the dump can.
"$py" - <<'PY'
import datetime, os, tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from gpujobs.run import evidence
from gpujobs.run.distributed import torch_nccl_env
from gpujobs.schema import JobConfig

run = Path(tempfile.mkdtemp()) / "run"
(run / "heartbeat").mkdir(parents=True)
out = run / "hangs" / "1"
out.mkdir(parents=True)
os.environ.update(torch_nccl_env(JobConfig(), run))  # the settings every rank gets, defaults
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
x = torch.ones(1024, device="cuda")
for _ in range(5):
    dist.all_reduce(x)
torch.cuda.synchronize()
found = evidence.dump_flight_recorder(run, out, [0], wait_s=30)
dist.destroy_process_group()
dumps = sorted(p.name for p in out.iterdir())
assert found == [0] and dumps == ["nccl_trace_rank_0"], (found, dumps, sorted(p.name for p in (run / "heartbeat").iterdir()))
print(f"ok: flight recorder dump of {(out / dumps[0]).stat().st_size} bytes after 5 NCCL all-reduces")
PY

echo "== GPU paths of issue 25: resume placement, the rank's CUDA stream, amp=auto, pinned batches"
"$py" - <<'PY'
import sys, tempfile, time
from pathlib import Path

import torch

sys.path.insert(0, "bench")
from bench_trainer import job_config

from gpujobs.run.checkpoint import CheckpointManager
from gpujobs.run.entry import load_task_builder
from gpujobs.run.jobenv import DistInfo
from gpujobs.run.metrics import MetricsLog
from gpujobs.run.precision import autocast_dtype
from gpujobs.run.rng import rng_state, seed_everything, set_rng_state
from gpujobs.run.trainer import Trainer

device = torch.device("cuda", 0)
torch.cuda.set_device(device)
job = job_config(20, ["resources.gpus_per_node=1", "trainer.log_every=0"])  # saved at its last step
info, run = DistInfo(0, 0, 1, 1, "127.0.0.1", 29500, "gpu_check"), Path(tempfile.mkdtemp())

def trainer():
    seed_everything(job.trainer.seed)
    task = load_task_builder(job.task)(job.model, job.data, 1, job.trainer.grad_accum)
    return Trainer(job, info, device, task, CheckpointManager(run, 20, 2, 0, world_size=1), MetricsLog(None))

capability = torch.cuda.get_device_capability(device)
first = trainer()
dtype = autocast_dtype("auto", [capability]) or torch.float32
with first.autocast():
    product = torch.ones(8, 8, device=device) @ torch.ones(8, 8, device=device)
native = torch.bfloat16 if capability >= (8, 0) else torch.float32
assert product.dtype == dtype == native, (capability, product.dtype)
first.fit()

resumed = trainer()
params = sum(p.numel() * p.element_size() for p in resumed.model.parameters())
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats(device)
before = torch.cuda.memory_allocated(device)
assert resumed.restore() and resumed.step == 20
peak = torch.cuda.max_memory_allocated(device) - before
moments = sum(t.numel() * t.element_size() for s in resumed.optimizer.state.values() for t in s.values() if t.is_cuda)
for state in resumed.optimizer.state.values():
    assert state["step"].device.type == "cpu" and state["exp_avg"].is_cuda, {k: v.device for k, v in state.items()}
# Loaded on the GPU, the model's saved copy would sit there beside the parameters: peak = moments + params
assert peak < moments + params / 2, f"restore peaked at {peak} bytes on the GPU, its moments are {moments}"
print(f"ok: resume peaked at {peak / 2**20:.1f} MiB on the GPU (moments {moments / 2**20:.1f} MiB, "
      f"parameters {params / 2**20:.1f} MiB); Adam's step counters on the CPU; amp=auto: {dtype} on {capability}")

torch.cuda.manual_seed(1)
saved = rng_state(device)
assert isinstance(saved["cuda"], dict) and saved["cuda"]["device"] == 0, saved["cuda"]
expected = torch.rand(4, device=device)
# An old-format state from a rank that saw one GPU more than this one: all of them set, it raised IndexError
set_rng_state({**saved, "cuda": [saved["cuda"]["state"]] * (torch.cuda.device_count() + 1)}, device)
assert torch.equal(torch.rand(4, device=device), expected)
set_rng_state(saved, device)
assert torch.equal(torch.rand(4, device=device), expected)
print("ok: the rank's own CUDA stream saved, and restored from an old state of more GPUs than seen")

data, rows = resumed.task.data, resumed.task.global_batch_size
assert all(t.is_pinned() for t in data.train_rows(0, 0, rows, True))
batch = resumed.task.train_batch(0, 0, rows, device)
assert all(a.is_cuda and torch.equal(a.cpu(), b) for a, b in zip(batch, data.train_rows(0, 0, rows), strict=True))

def queue(pinned):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for step in range(200):
        data.train_rows(step, 0, rows, pinned).to(device, non_blocking=pinned)
    queued = time.perf_counter() - start
    torch.cuda.synchronize()
    return queued, time.perf_counter() - start

queue(True)  # warm-up: the pinned allocator's blocks
for pinned in (False, True):
    queued, done = queue(pinned)
    print(f"{'pinned  ' if pinned else 'pageable'}: 200 batches of {rows} rows queued in {queued:.3f} s, "
          f"copied in {done:.3f} s")
PY

echo "== the straggler signal on CUDA: the compute clock, not the host clock"
"$py" - <<'PY'
import time

import torch

from gpujobs.run.compute_clock import ComputeClock

device = torch.device("cuda", 0)
torch.cuda.set_device(device)
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1)).to(device)
rows = torch.randn(4096, 512)  # pageable: its copy to the GPU blocks the host until the GPU gets to it

def gpu_ms(cycles):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)

gpu_ms(1000)
wait_cycles = int(1_000_000 * 50 / gpu_ms(1_000_000))  # ~50 ms of GPU time

def steps(clock, n=10):
    """n steps that each find the GPU still busy 50 ms (a fast rank's wait in the last all-reduce)."""
    host = 0.0
    for _ in range(n):
        torch.cuda._sleep(wait_cycles)
        clock.start()
        started = time.perf_counter()
        loss = model(rows.to(device)).square().mean()
        host += time.perf_counter() - started  # the old signal: data + forward on the host clock
        loss.backward()
        clock.end()
    return host / n, clock.read() / n

steps(ComputeClock(device), 2)  # warm-up
host, own = steps(ComputeClock(device))
assert host >= 0.045, f"the blocking copy did not wait for the queued work ({host * 1e3:.1f} ms): no check"
assert own < 0.01, f"the compute clock holds the queued wait: {own * 1e3:.1f} ms a step (host {host * 1e3:.1f} ms)"
_, slowed = steps(ComputeClock(device, slow_factor=3))
assert 2 * own <= slowed < 0.045, f"3x slowed: {slowed * 1e3:.2f} ms, own {own * 1e3:.2f} ms: the emulation sleeps on the wait"
print(f"ok: with 50 ms queued before each step, the host clock reads {host * 1e3:.1f} ms a step, the compute "
      f"clock {own * 1e3:.2f} ms ({slowed * 1e3:.2f} ms slowed 3x)")
PY
if [ "$ranks" -ge 2 ]; then
  echo "== a slowed rank under NCCL is named the straggler (a job that copies its batches blocking)"
  slow_dir=$(mktemp -d)
  # A user's job may copy from pageable memory without non_blocking: the signal must not depend on it.
  cat >"$slow_dir/blocking_rec.py" <<'PY'
"""The rec task, copying its batches to the GPU from pageable memory, blocking (gpu_check's job)."""
from jobs.rec.task import RecTask


class BlockingRec(RecTask):
    def train_batch(self, step, start, stop, device):
        return self.data.train_rows(step, start, stop).to(device)


def build_task(model_cfg, data_cfg, world_size, micro_batches):
    return BlockingRec(model_cfg, data_cfg, world_size, micro_batches)
PY
  PYTHONPATH="$slow_dir:$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 300 "$py" -m gpujobs.submit +experiment=rec cluster=local \
    resources.gpus_per_node=2 task=blocking_rec:build_task trainer.max_steps=100 trainer.log_every=10 \
    trainer.eval_every=0 checkpoint.every_steps=0 trainer.progress=false telemetry.gpu=false trainer.balance=off \
    telemetry.debug_slow_rank=1 telemetry.debug_slow_factor=4 "hydra.run.dir=$slow_dir/run" "$@" >"$slow_dir/out.txt" 2>&1 \
    || { tail -20 "$slow_dir/out.txt"; fail "the slowed-rank run failed (output in $slow_dir/out.txt)"; }
  "$py" - "$slow_dir/run" <<'PY'
import json, sys
from pathlib import Path

run = Path(sys.argv[1])
train = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
late = train[1:]  # the first window holds CUDA's warm-up
assert len(late) >= 5, train
# rank 1 spends 4x its own compute: 4 / median(1, 4) = 1.6
assert all(r["slowest_rank"] == 1 and r["imbalance"] > 1.3 for r in late), [(r["step"], r["local_time_s"]) for r in late]
log0 = next((run / "submitit").glob("*_0_log.err")).read_text()
warnings = [line for line in log0.splitlines() if "straggler at step" in line]
assert warnings and all("rank 1 (node " in line and "GPU" in line for line in warnings), warnings
print(f"ok: rank 1 named the straggler at {len(warnings)} log steps, imbalance "
      f"{min(r['imbalance'] for r in late)}..{max(r['imbalance'] for r in late)}; local times {late[-1]['local_time_s']} s")
PY
else
  echo "(a 2-rank NCCL straggler run needs 2 GPUs: NCCL refuses two ranks on one GPU; skipped)"
fi

echo "== trainer vs plain loop on one GPU"
"$py" bench/bench_gpu.py --steps 300 --rounds 3

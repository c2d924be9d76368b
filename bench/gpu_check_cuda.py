"""The checks of `gpu_check.py` that use CUDA in their own process, one per invocation (needs a GPU):

    python bench/gpu_check_cuda.py nvml_health|flight_recorder|cuda_paths|compute_clock

Each prints what it saw and, last, one line: its key figure. A failed check raises (exit 1).
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import stat
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import checkout  # noqa: F401  (first: the checkout on the path, before gpujobs)
import torch
import torch.distributed as dist
from bench_trainer import job_config
from gpu_check import CheckFailed, need

from gpujobs.backends.jobenv import DistInfo
from gpujobs.config.load import JobConfig
from gpujobs.rank.checkpoint import CheckpointManager
from gpujobs.rank.metrics import MetricsLog
from gpujobs.rank.train import load_task_builder
from gpujobs.rank.trainer import Trainer
from jobs.rec.task import RecTask


def nvml_health() -> str:
    """NVML's checks (ECC, retired pages, row remaps, temperature, throttling) on every GPU: the run's
    health check at start would stop on what they find."""
    from gpujobs.base.nvml import gpu_faults, nvml_session, read_gpu, visible_gpus

    with nvml_session() as nv:
        gpus = visible_gpus(nv)
        need(bool(gpus), "NVML lists no GPU")
        for gpu in gpus:
            faults = gpu_faults(nv, gpu.handle, 90.0)
            now = read_gpu(nv, gpu.handle)
            print(f"GPU {gpu.index} ({gpu.uuid}): {now.get('temp_c')} C, throttle {now.get('throttle')}, "
                  f"ECC uncorrected {now.get('ecc_uncorrected', 'not reported')}: {'; '.join(faults) or 'healthy'}")
            need(not faults, f"GPU {gpu.index} is not healthy: {faults}")
    return f"{len(gpus)} GPU(s) healthy, {now.get('temp_c')} C"


def flight_recorder() -> str:
    """The hang watchdog's request for PyTorch's NCCL flight recorder gets a dump: the watchdog writes a
    request file in the run dir, the rank's heartbeat thread relays it into torch's pipe in the rank's
    private node-local dir (TORCH_NCCL_DEBUG_INFO_PIPE_FILE), no pipe lies in the run dir, and the private
    dir is gone once the rank closes (gpujobs/rundir/heartbeat.py, gpujobs/attempt/evidence.py)."""
    from gpujobs.attempt import evidence
    from gpujobs.rank.distributed import torch_nccl_env
    from gpujobs.rundir.heartbeat import Heartbeat, heartbeat_path

    run = Path(tempfile.mkdtemp()) / "run"
    run.mkdir(mode=0o700)
    out = run / "hangs" / "1"
    out.mkdir(parents=True)
    beat = Heartbeat(run, 0, "gpu_check", 0.5).start()
    need(beat.pipe_dir is not None, "the rank made no private pipe dir")
    pipe_dir = beat.pipe_dir
    assert pipe_dir is not None
    os.environ.update(torch_nccl_env(JobConfig(), run, pipe_dir))  # the settings every rank gets, defaults
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        x = torch.ones(1024, device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        deadline = time.monotonic() + 10
        while not json.loads(heartbeat_path(run, 0).read_text()).get("flight_recorder"):
            need(time.monotonic() < deadline, "the heartbeat never said torch made the flight recorder's pipe")
            time.sleep(0.2)
        pipes = [p for p in run.rglob("*") if stat.S_ISFIFO(p.lstat().st_mode)]
        need(not pipes, f"a pipe in the run dir: {pipes}")
        found = evidence.dump_flight_recorder(run, out, {0: json.loads(heartbeat_path(run, 0).read_text())}, 0.5)
    finally:
        dist.destroy_process_group()
        beat.close()
    dumps = sorted(p.name for p in out.iterdir())
    need(found == [0] and dumps == ["nccl_trace_rank_0"], (found, dumps, sorted(os.listdir(run / "heartbeat"))))
    with (out / dumps[0]).open("rb") as handle:
        trace = pickle.load(handle)
    need(isinstance(trace, dict) and "entries" in trace, f"the dump holds no entries: {type(trace)}")
    need(not pipe_dir.exists(), f"the private pipe dir {pipe_dir} outlived the rank")
    return f"{len(trace['entries'])} entries dumped on request after 5 NCCL all-reduces; no pipe in the run dir"


def cuda_paths() -> str:
    """What only a GPU shows: a resume leaves Adam's step counters where its kernel reads them and loads no
    second copy of the state into GPU memory; a rank's CUDA stream is saved alone and restored where fewer
    GPUs are seen; amp=auto trains bf16 from compute capability 8.0, fp32 before; batches are gathered into
    pinned memory and copied without blocking (the host time to queue them is printed)."""
    from gpujobs.rank.precision import autocast_dtype
    from gpujobs.rank.rng import rng_state, seed_everything, set_rng_state

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    # one GPU rank (the rec experiment's own 2 are CPU ranks); saved at its last step
    job = job_config(20, ["resources.gpus_per_node=1", "resources.procs_per_node=1", "trainer.log_every=0"])
    info, run = DistInfo(0, 0, 1, 1, "127.0.0.1", 29500, "gpu_check"), Path(tempfile.mkdtemp())

    def trainer() -> Trainer:
        seed_everything(job.trainer.seed)
        task = load_task_builder(job.task)(job.model, job.data, 1, job.trainer.grad_accum)
        return Trainer(job, info, device, task, CheckpointManager(run, 20, 2, 0, world_size=1), MetricsLog(None))

    capability = torch.cuda.get_device_capability(device)
    first = trainer()
    dtype = autocast_dtype("auto", [capability]) or torch.float32
    with first.autocast():
        product = torch.ones(8, 8, device=device) @ torch.ones(8, 8, device=device)
    native = torch.bfloat16 if capability >= (8, 0) else torch.float32
    need(product.dtype == dtype == native, (capability, product.dtype))
    first.fit()

    resumed = trainer()
    params = sum(p.numel() * p.element_size() for p in resumed.model.parameters())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    need(resumed.restore() and resumed.step == 20, f"no resume at step 20 (step {resumed.step})")
    peak = torch.cuda.max_memory_allocated(device) - before
    moments = sum(t.numel() * t.element_size() for s in resumed.optimizer.state.values() for t in s.values()
                  if t.is_cuda)
    # Adam's fused kernel (the default on CUDA, `step_settings`) reads its step counters on the GPU; torch's
    # other kernels read them on the host, where the load must leave them
    fused = bool(resumed.optimizer.defaults.get("fused"))
    for state in resumed.optimizer.state.values():
        need(state["step"].is_cuda == fused and state["exp_avg"].is_cuda, {k: v.device for k, v in state.items()})
    # Loaded on the GPU, the model's saved copy would sit there beside the parameters: peak = moments + params
    need(peak < moments + params / 2, f"restore peaked at {peak} bytes on the GPU, its moments are {moments}")
    counters = "GPU (fused Adam)" if fused else "CPU"
    print(f"resume peaked at {peak / 2**20:.1f} MiB on the GPU (moments {moments / 2**20:.1f} MiB, "
          f"parameters {params / 2**20:.1f} MiB); Adam's step counters on the {counters}; amp=auto: {dtype} on "
          f"{capability}")

    torch.cuda.manual_seed(1)
    saved = rng_state(device)
    need(isinstance(saved["cuda"], dict) and saved["cuda"]["device"] == 0, saved["cuda"])
    expected = torch.rand(4, device=device)
    # An old-format state from a rank that saw one GPU more than this one: all of them set, it raised IndexError
    set_rng_state({**saved, "cuda": [saved["cuda"]["state"]] * (torch.cuda.device_count() + 1)}, device)
    need(torch.equal(torch.rand(4, device=device), expected), "the old-format CUDA stream was not restored")
    set_rng_state(saved, device)
    need(torch.equal(torch.rand(4, device=device), expected), "the rank's CUDA stream was not restored")
    print("the rank's own CUDA stream saved, and restored from an old state of more GPUs than seen")

    task = resumed.task
    if not isinstance(task, RecTask):
        raise CheckFailed(f"the rec experiment's task, not {type(task).__name__}")
    data, rows = task.data, task.global_batch_size
    need(all(t.is_pinned() for t in data.train_rows(0, 0, rows, True)), "batches not gathered into pinned memory")
    batch = resumed.task.train_batch(0, 0, rows, device)
    need(all(a.is_cuda and torch.equal(a.cpu(), b) for a, b in zip(batch, data.train_rows(0, 0, rows), strict=True)),
         "the batch on the GPU is not the rows gathered on the host")

    def queue(pinned: bool) -> tuple[float, float]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for step in range(200):
            data.train_rows(step, 0, rows, pinned).to(device, non_blocking=pinned)
        queued = time.perf_counter() - start
        torch.cuda.synchronize()
        return queued, time.perf_counter() - start

    queue(True)  # warm-up: the pinned allocator's blocks
    times = {}
    for pinned in (False, True):
        times[pinned] = queue(pinned)
        print(f"{'pinned  ' if pinned else 'pageable'}: 200 batches of {rows} rows queued in {times[pinned][0]:.3f} s, "
              f"copied in {times[pinned][1]:.3f} s")
    return (f"resume peak {peak / 2**20:.1f} MiB (moments {moments / 2**20:.1f}); {dtype} on {capability}; "
            f"pinned queue {times[True][0]:.3f} s vs pageable {times[False][0]:.3f} s")


def compute_clock() -> str:
    """The straggler signal on CUDA: the compute clock leaves out what the GPU still had queued (the wait in
    the last all-reduce) where the host clock over a blocking copy holds it, and the slow-GPU emulation
    slows by the rank's own compute.

    The queued wait is a `torch.cuda._sleep` of a number of cycles, whose length in time follows the GPU's
    clock: sized right after start, at idle clocks (345 MHz on an idle H100 against 1980 MHz under load), 50 ms
    became 9-25 ms once the GPU was busy. So it is sized after a warm-up that raises the clocks, and each step
    compares the host's time with the events' time of that same wait, not with what it was meant to last."""
    from gpujobs.rank.compute_clock import ComputeClock

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1)).to(device)
    rows = torch.randn(4096, 512)  # pageable: its copy to the GPU blocks the host until the GPU gets to it

    def gpu_ms(cycles: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    square = torch.randn(4096, 4096, device=device)
    warmed = time.monotonic() + 2.0  # the clocks rise under load within a second or so
    while time.monotonic() < warmed:
        for _ in range(20):
            square = square @ square
            square = square / square.norm()
        torch.cuda.synchronize()
    wait_cycles = int(1_000_000 * 50 / gpu_ms(1_000_000))  # ~50 ms of GPU time at the clocks of a busy GPU

    def steps(clock: ComputeClock, n: int = 10) -> tuple[float, float, float]:
        """n steps that each find the GPU still busy with a wait (a fast rank's wait in the last all-reduce):
        the host clock's data + forward, the compute clock's step and the wait's own length, each a step."""
        host = waited = 0.0
        for _ in range(n):
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record()
            torch.cuda._sleep(wait_cycles)
            after.record()
            clock.start()
            started = time.perf_counter()
            loss = model(rows.to(device)).square().mean()
            host += time.perf_counter() - started  # the old signal: data + forward on the host clock
            loss.backward()
            clock.end()
            after.synchronize()
            waited += before.elapsed_time(after) / 1000
        return host / n, clock.read() / n, waited / n

    steps(ComputeClock(device), 2)  # warm-up
    host, own, wait = steps(ComputeClock(device))
    print(f"the queued wait lasted {wait * 1e3:.1f} ms a step by its events (sized for 50 ms)")
    need(host >= 0.9 * wait, f"the blocking copy did not wait for the queued work ({host * 1e3:.1f} ms, the wait "
                             f"{wait * 1e3:.1f} ms): no check")
    need(own < 0.2 * wait, f"the compute clock holds the queued wait: {own * 1e3:.1f} ms a step (host "
                           f"{host * 1e3:.1f} ms, the wait {wait * 1e3:.1f} ms)")
    _, slowed, wait_slowed = steps(ComputeClock(device, slow_factor=3))
    need(2 * own <= slowed < 0.9 * wait_slowed,
         f"3x slowed: {slowed * 1e3:.2f} ms, own {own * 1e3:.2f} ms, the wait {wait_slowed * 1e3:.1f} ms: it sleeps "
         "on the wait")
    return (f"host clock {host * 1e3:.1f} ms/step over a {wait * 1e3:.1f} ms wait, compute clock {own * 1e3:.2f} ms "
            f"({slowed * 1e3:.2f} ms slowed 3x)")


CHECKS: dict[str, Callable[[], str]] = {
    f.__name__: f for f in (nvml_health, flight_recorder, cuda_paths, compute_clock)
}


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in CHECKS:
        sys.exit(f"usage: gpu_check_cuda.py {'|'.join(CHECKS)}")
    if not torch.cuda.is_available():
        print("gpu_check_cuda: no CUDA GPU here (torch.cuda.is_available() is False)", file=sys.stderr)
        sys.exit(3)
    print(CHECKS[sys.argv[1]](), flush=True)

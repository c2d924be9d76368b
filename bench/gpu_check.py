"""The one-GPU check of gpujobs (issue 25), run by `bench/gpu_check.sh`: as much as one GPU shows, within 10 min.

    python bench/gpu_check.py [--deadline SECONDS] [--table FILE] [--only NAME,...] [overrides...]

Each check says whether it needs a GPU. Without one, every check that can run on the CPU runs there, on
the same code path (device cpu, group gloo); only what truly needs a GPU (NVML, NCCL, bf16, pinned memory,
CUDA streams, CUDA_VISIBLE_DEVICES=GPU-<uuid>) is skipped, and each skip is named. It ends with one table
(check, needs GPU, result, key figure) that a note can quote, and exits 0 when every check ran and passed,
3 when all that ran passed but GPU checks were skipped (no GPU here), 4 when all that ran passed but the
deadline left some unrun, 1 on any failure.

A deadline (`--deadline`, 540 s) holds for the whole check, and each check runs within its own budget (its
`budget_s`, at most what is left): a check over it is stopped, its processes killed, and its row says so. Each
row is printed, and the table file (`--table`, else `table.txt` in the check's folder) rewritten, as a check
ends, so a hang, or the node taken away, costs one row; rows not reached say so.

The checks that need CUDA inside the driver's own process live in `gpu_check_cuda.py`, each run in a
process of its own. This driver stays torch-free until a check needs to read a checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Optional

from checkout import REPO  # first: the checkout (and tests/) on the path, before gpujobs
from jobctl import RunningJob, attempts  # the operator's handle on a running job, shared with the tests

from gpujobs.config.nccl import GLOO_ON_CUDA_ENV

#: A small run on either device: the rec experiment at test sizes, cheap enough for ten runs in the budget.
TINY = ("+experiment=rec", "+debug=tiny", "cluster=local", "trainer.progress=false")

#: A GPU check's exit code where there is nothing to check (the same as the script's "no GPU").
NO_GPU = 3
#: The exit code where all that ran passed but the deadline left checks unrun.
NOT_ALL_RUN = 4
#: The whole check's default deadline in seconds: within the 10 minutes a device is lent for one command.
DEADLINE_S = 540
#: A check is started only with at least this many seconds left (else its row says it was not reached).
LEAST_S = 10


class CheckTimedOut(BaseException):
    """A check's budget is spent (raised by the timer's signal wherever the check is; BaseException: no
    check's own `except Exception` keeps it going)."""


@dataclass
class Budget:
    """When the running check must be over (`time.monotonic()`)."""

    ends: float = math.inf

    def left(self, limit: float) -> float:
        """Seconds a step of the check may take: `limit`, at most what the budget has left (at least 1)."""
        return max(1.0, min(limit, self.ends - time.monotonic()))


class CheckFailed(Exception):
    """A check saw something wrong: the message says what."""


def need(ok: bool, what: object) -> None:
    """Fail the check with `what` unless `ok` (not `assert`: `python -O` would drop the checks)."""
    if not ok:
        raise CheckFailed(str(what))


@dataclass(frozen=True)
class Machine:
    """This machine as the checks see it."""

    gpus: int
    """GPUs that NVML sees and torch can use (0: none)."""
    why_no_gpu: str
    """Why there is no GPU to use ("" where there is one)."""
    uuid: str
    """The first GPU's UUID ("" without one)."""
    work: Path
    """A fresh folder: every run dir of the check is inside it."""
    overrides: tuple[str, ...]
    """The user's overrides, given to every run."""
    budget: Budget = field(default_factory=Budget)
    """The running check's budget: every process it starts waits at most what is left of it."""

    @property
    def cuda(self) -> bool:
        return self.gpus > 0

    def ranks(self, count: int) -> list[str]:
        """Overrides for `count` ranks on this machine's device: GPU ranks (sharing one GPU where `count` is
        more than the GPUs, see `two_ranks_env`), else CPU ranks."""
        return gpu_ranks(count) if self.cuda else ["resources.gpus_per_node=0", f"resources.procs_per_node={count}"]


def gpu_ranks(count: int) -> list[str]:
    """Overrides for `count` GPU ranks: the rec experiment's 2 CPU ranks (procs_per_node) must match them."""
    return [f"resources.gpus_per_node={count}", f"resources.procs_per_node={count}"]


@dataclass
class Run:
    """A finished `gpujobs.submit` run."""

    dir: Path
    returncode: int
    output: str

    def result(self) -> dict[str, Any]:
        return dict(json.loads((self.dir / "result.json").read_text()))

    def metrics(self, kind: str) -> list[dict[str, Any]]:
        lines = (self.dir / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["kind"] == kind]

    def rank_logs(self) -> str:
        return "".join(p.read_text() for p in sorted((self.dir / "submitit").glob("*_log.*")))

    def completed(self) -> dict[str, Any]:
        """result.json of a run that must have completed."""
        need(self.returncode == 0, f"the run in {self.dir} exited {self.returncode}: {self.output[-1500:]}")
        result = self.result()
        need(result["status"] == "completed", result)
        return result


def run_child(m: Machine, cmd: list[str], timeout_s: float, what: str, *, env: Optional[dict[str, str]] = None,
              stdout: int = subprocess.PIPE, stderr: Optional[int] = subprocess.STDOUT) -> tuple[int, str]:
    """`cmd` to its end in a session of its own, within `timeout_s` and the check's budget; its exit code and
    output. Over time, or on the budget's signal, its whole process group is killed (the ranks a submit
    started included), so a hung child costs its check and nothing more."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=stdout, stderr=stderr, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        out, _ = proc.communicate(timeout=m.budget.left(timeout_s))
    except subprocess.TimeoutExpired as err:
        raise CheckFailed(f"{what} took over {m.budget.left(timeout_s):.0f} s") from err
    finally:
        end(proc)
    return proc.returncode, out or ""


def end(proc: subprocess.Popen[Any]) -> None:
    """Kill `proc` (a session leader) if it still runs, with its process group and every process below it
    (one that left the group too), and reap it."""
    if proc.poll() is not None:
        return
    from gpujobs.attempt.evidence import descendants, kill_tree

    below = descendants(proc.pid)  # before the kill: orphans leave the tree
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    kill_tree([*below, proc.pid])
    proc.wait()


def submit(m: Machine, run_dir: Path, *overrides: str, env: dict[str, str] | None = None,
           timeout_s: float = 240) -> Run:
    """`python -m gpujobs.submit` to the end, its output kept beside the run dir."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "gpujobs.submit", f"hydra.run.dir={run_dir}", *overrides, *m.overrides]
    code, output = run_child(m, cmd, timeout_s, f"the run in {run_dir}", env=env)
    (run_dir.parent / f"{run_dir.name}.out").write_text(output)
    return Run(run_dir, code, output)


def cuda_child(m: Machine, name: str, timeout_s: float = 300) -> str:
    """Run check `name` of gpu_check_cuda.py in a process of its own; its last line is the key figure."""
    code, out = run_child(m, [sys.executable, str(REPO / "bench" / "gpu_check_cuda.py"), name], timeout_s, name,
                          stderr=None)  # its tracebacks straight to the log
    print(out, end="")
    lines = out.strip().splitlines()
    need(code == 0, f"exit {code}: {lines[-1] if lines else 'no output'}")
    return lines[-1] if lines else ""


# ---------------------------------------------------------------- checks that run on the CPU too
def resume_in_place(m: Machine) -> str:
    """A run stopped at its last step, resumed in the same run dir to twice as many steps: it goes on from
    the save, at the speed it had (samples/s after >= 0.9x before), with trainer.grad_accum=2 throughout."""
    steps = 200 if m.cuda else 60  # a GPU's steps are short: more of them for as many log windows of note
    common = (*TINY, *m.ranks(1), "trainer.grad_accum=2", f"trainer.log_every={steps // 12}", "trainer.eval_every=0",
              "checkpoint.every_steps=0")
    run_dir = m.work / "resume" / "run"
    first = submit(m, run_dir, *common, f"trainer.max_steps={steps}").completed()
    need(first["saved"].endswith(f"step_{steps:08d}"), first)
    second = submit(m, run_dir, *common, f"trainer.max_steps={2 * steps}")
    result = second.completed()
    need(result["resumed_from"] == first["saved"] and result["start_step"] == steps, result)
    need(result["samples"] == 2 * first["samples"], f"{result['samples']} samples in all, {first['samples']} at first")

    def rate(lo: int, hi: int) -> float:
        # the median log window, the first of each attempt left out (warm-up: allocator, threads, caches)
        rates = sorted(r["samples_per_s"] for r in second.metrics("train") if lo + steps // 12 < r["step"] <= hi)
        need(len(rates) >= 5, f"{len(rates)} log windows in steps {lo}..{hi}")
        return float(rates[len(rates) // 2])

    before, after = rate(0, steps), rate(steps, 2 * steps)
    figure = f"grad_accum=2; samples/s after/before resume {after / before:.2f} ({after:.0f}/{before:.0f})"
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores:  # the other processes' share of the cores, not the resume, would set the ratio
        return f"{figure}, not judged: load {load:.1f} on {cores} cores"
    need(after >= 0.9 * before, f"samples/s {after:.0f} after the resume, {before:.0f} before: under 0.9x")
    return figure


def usr2_save_resume(m: Machine) -> str:
    """USR2 to the launcher mid-run: the ranks agree, save synchronously (checkpoint.async=false: on a GPU a
    CUDA save), stop as preempted, and the next attempt resumes from that save with no step redone."""
    run_dir = m.work / "usr2" / "run"
    job = RunningJob(run_dir, *TINY, *m.ranks(1), "trainer.max_steps=400", "checkpoint.async=false",
                     "checkpoint.every_steps=0", "telemetry.debug_slow_rank=0", "telemetry.debug_slow_ms=20",
                     *m.overrides)
    try:
        job.wait_for_step(15, timeout=m.budget.left(180))
        os.kill(job.proc.pid, signal.SIGUSR2)
        code = job.wait(timeout=m.budget.left(240))
    finally:
        job.kill()
    need(code == 0, f"exit {code}: {job.output()[-1500:]}")
    preempted, completed = attempts(run_dir)
    need(preempted["reason"] == "preempted" and preempted["saved"], preempted)
    need(completed["resumed_from"] == preempted["saved"], completed)
    need(completed["start_step"] == preempted["steps_done"], (preempted, completed))
    return f"saved at step {preempted['steps_done']} on USR2, resumed there (0 steps redone)"


def live_hang(m: Machine) -> str:
    """A rank that stops beating mid-run while alive (a 10-minute sleep in its loop): the watchdog finds it
    hung and keeps its stacks, nvml.json and, on a GPU, its NCCL flight recorder (the rank is in a forced
    one-rank group: cpu:gloo,cuda:nccl there, gloo on the CPU), then kills it."""
    run_dir = m.work / "hang" / "run"
    run = submit(m, run_dir, *TINY, *m.ranks(1), "trainer.max_steps=40", "trainer.hang_timeout_s=5",
                 "telemetry.debug_slow_rank=0", "telemetry.debug_slow_ms=600000", "cluster.max_restarts=0",
                 env={"GPUJOBS_FORCE_PROCESS_GROUP": "1"}, timeout_s=180)
    need(run.returncode != 0, "the hung run exited 0")
    (hung,) = attempts(run_dir)
    need(hung["reason"] == "hung", hung)
    evidence = Path(hung["evidence"])
    stack = (evidence / "rank_0.txt").read_text()
    need("fit" in stack, f"rank 0's stack does not show the train loop: {stack[:500]}")
    nvml = json.loads((evidence / "nvml.json").read_text())
    need(nvml["node"] and (not m.cuda or nvml.get("gpus")), f"nvml.json: {nvml}")
    summary = json.loads((evidence / "hang.json").read_text())
    traces = summary["flight_recorder_ranks"]
    if m.cuda:
        need(traces == [0] and (evidence / "nccl_trace_rank_0").stat().st_size > 0, summary)
    return f"hung after {hung['hung_s']:.0f} s; kept {', '.join(sorted(p.name for p in evidence.iterdir()))}"


def two_ranks_one_device(m: Machine) -> str:
    """Two ranks on one device, DDP over CUDA tensors where there is a GPU: rank 1 computes 3x slower, so
    dynamic balancing gives it the smaller share; async saves agreed by both; each rank's own random
    stream saved; then the run resumed on one rank (2 -> 1)."""
    import torch  # only here: the driver itself stays torch-free

    run_dir = m.work / "two" / "run"
    # one global batch at either world size: what a run dir must keep to resume 2 -> 1
    common = (*TINY, "data.global_batch_size=128", "trainer.balance=dynamic", "trainer.balance_every=6",
              "trainer.log_every=6", "checkpoint.async=true", "checkpoint.every_steps=10")
    run = submit(m, run_dir, *common, *m.ranks(2), "trainer.max_steps=60", "telemetry.debug_slow_rank=1",
                 "telemetry.debug_slow_factor=3", env={GLOO_ON_CUDA_ENV: "1"})  # NCCL refuses a shared GPU
    result = run.completed()
    need(result["world_size"] == 2, result)
    shared = f"({'cpu' if not m.cuda else 'cuda:0' if m.gpus == 1 else 'cuda:'}"
    said = re.findall(r"rank \d/2 on .*", run.rank_logs())
    need(len(said) == 2 and all(shared in line and "backend gloo)" in line for line in said), said)
    plans = run.metrics("plan")
    counts = plans[-1]["counts"]
    need(counts[0] > counts[1], f"rank 1 is 3x slower, yet its share is not the smaller: {plans}")
    saves = run.metrics("checkpoint")
    need(sum(s["async"] for s in saves) >= 3 and saves[-1]["async"] is False, saves)
    kept = [d for d in (run_dir / "checkpoints").iterdir() if (d / "COMPLETE").exists()]
    need(bool(kept) and all((d / "rank_0.pt").exists() and (d / "rank_1.pt").exists() for d in kept),
         f"a checkpoint marked complete without both ranks' files: {[sorted(os.listdir(d)) for d in kept]}")
    saved = Path(result["saved"])
    streams = [torch.load(saved / f"rank_{r}.pt", map_location="cpu", weights_only=False)["rng"] for r in (0, 1)]
    need(all(isinstance(s["torch"], torch.Tensor) for s in streams), "a rank saved no random stream of its own")
    if m.cuda:  # each rank's own CUDA stream, of the device it ran on (on one GPU: the one they share)
        devices = [s["cuda"]["device"] if isinstance(s.get("cuda"), dict) else None for s in streams]
        need(None not in devices and (m.gpus > 1 or devices == [0, 0]), f"the ranks' CUDA streams: {devices}")
    one = submit(m, run_dir, *common, *m.ranks(1), "trainer.max_steps=72")
    resumed = one.completed()
    need(resumed["world_size"] == 1 and resumed["resumed_from"] == result["saved"] and resumed["start_step"] == 60,
         resumed)
    need("saved at world size 2, now 1" in one.rank_logs(), "the resumed rank did not say it resumed 2 -> 1")
    return f"final shares {counts[0]}:{counts[1]} rows, {len(saves)} agreed saves, resumed 2 -> 1 at step 60"


# ---------------------------------------------------------------- checks that need a GPU
def fbgemm_cuda_missing() -> str:
    """Why the TorchRec check cannot run here: FBGEMM's CUDA build or TorchRec not installed ("": both are)."""
    import importlib.metadata

    for dist in ("fbgemm-gpu", "torchrec"):
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return f"needs {dist} (FBGEMM's CUDA build and TorchRec: scripts/install-torchrec.sh cuda)"
    return ""


def torchrec_sharded(m: Machine) -> str:
    """The rec job with its tables sharded by TorchRec on the GPU (parallel=torchrec: FBGEMM's fused CUDA
    kernels, fused Adam for the tables), saved through DCP at its last step and resumed to twice as many."""
    common = (*TINY, *m.ranks(1), "parallel=torchrec", "optim.table_optimizer=adam", "trainer.eval_every=0",
              "checkpoint.every_steps=0")
    run_dir = m.work / "torchrec" / "run"
    first = submit(m, run_dir, *common, "trainer.max_steps=40").completed()
    plan = json.loads((run_dir / "plan.json").read_text())
    need(plan["parallel"] == "torchrec" and plan["device"] == "cuda", plan)
    marker = json.loads((Path(first["saved"]) / "COMPLETE").read_text())
    need(any(name.startswith("sharded/") for name in marker["files"]), "no sharded state in the checkpoint")
    second = submit(m, run_dir, *common, "trainer.max_steps=80").completed()
    need(second["resumed_from"] == first["saved"] and second["start_step"] == 40, second)
    kernels = sorted({table["compute_kernel"] for table in plan["tables"]})
    return f"{len(plan['tables'])} tables ({', '.join(kernels)}), {second['samples_per_s']} samples/s, resumed"


def nvml_health(m: Machine) -> str:
    return cuda_child(m, "nvml_health")


def nccl_run(m: Machine) -> str:
    """The rec experiment on the GPUs in a real NCCL group (one rank joins one too: forced), with bf16,
    dynamic balancing, async saves, the health check, NVML telemetry and Prometheus; the report plots it."""
    ranks = min(m.gpus, 2)
    run_dir = m.work / "nccl" / "run"
    run_dir.parent.mkdir(parents=True)
    # nccl=debug: NCCL logs its communicator's init ("Init COMPLETE"), the proof that NCCL itself was used.
    cmd = [sys.executable, "-m", "gpujobs.submit", "+experiment=rec", "cluster=local",
           *gpu_ranks(ranks), "trainer.max_steps=300", "trainer.progress=false", "nccl=debug",
           "telemetry.interval_s=0.5", "telemetry.prometheus_port=0", "telemetry.prometheus_addr=127.0.0.1",
           "telemetry.prometheus_linger_s=3", "trainer.balance=dynamic", "trainer.balance_every=20",
           "checkpoint.async=true", "checkpoint.every_steps=50", "cluster.health_check=true",
           f"hydra.run.dir={run_dir}", *m.overrides]
    with open(run_dir.parent / "run.out", "w") as out:
        proc = subprocess.Popen(cmd, start_new_session=True, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "GPUJOBS_FORCE_PROCESS_GROUP": "1"})
        deadline, scrape = time.monotonic() + m.budget.left(300), ""
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise CheckFailed("the run took over its budget")
                info = run_dir / "prometheus.json"
                if info.exists():
                    try:
                        with urllib.request.urlopen(json.loads(info.read_text())["url"], timeout=2) as response:
                            scrape = response.read().decode()
                    except (OSError, ValueError):  # not up yet, or closed between two polls
                        pass
                time.sleep(0.5)
        finally:
            end(proc)
    run = Run(run_dir, proc.returncode, (run_dir.parent / "run.out").read_text())
    result = run.completed()
    need(result["world_size"] == ranks, result)
    logs = run.rank_logs()
    need("cuda:" in logs, "ranks did not train on CUDA")
    need(logs.count("backend cpu:gloo,cuda:nccl") == ranks, "not every rank joined the device-aware NCCL group")
    need("NCCL INFO" in logs and "Init COMPLETE" in logs, "no NCCL communicator was initialised")
    train = run.metrics("train")
    need(bool(train) and all(len(r["step_time_s"]) == ranks and min(r["step_time_s"]) > 0 for r in train),
         "no train record holds every rank's gathered step time")
    need(all(min(r["compute_s_per_sample"]) > 0 for r in train), "no compute time measured (CUDA events)")
    # log_every (20) = balance_every: a window's rows per rank are its record's plan, and on CUDA the local time
    # the straggler check compares is the compute clock's: per sample x rows per step
    import yaml

    accum = yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["grad_accum"]
    for r in train:
        for local, per_sample, count in zip(r["local_time_s"], r["compute_s_per_sample"], r["counts"], strict=True):
            need(abs(local - per_sample * count * accum) <= 0.01 * local + 2e-6, ("local time is not the clock's", r))
    saves = run.metrics("checkpoint")
    need([r["async"] for r in saves].count(True) >= 5 and saves[-1]["async"] is False, saves)
    need(result["samples"] == 300 * 256 * ranks and result["saved"].endswith("step_00000300"), result)
    need(bool(run.metrics("plan")), "no split plan recorded")
    health = run.metrics("health")
    need(len(health) == 1 and health[0]["healthy"] is True, health)
    checked = f"{ranks} GPU{'s' if ranks > 1 else ''} checked"
    need(len(health[0]["nvml"]) == 1 and health[0]["nvml"][0].endswith(checked),
         f"the health check did not look at the run's {ranks} GPU(s) through NVML: {health[0]['nvml']}")
    need(ranks == 1 or health[0]["busbw_gbps"] > 0, health)  # one rank: no link, nothing to measure
    attempt = attempts(run_dir)[-1]
    need(attempt["reason"] == "completed" and attempt["health_s"] > 0, attempt)
    need("health: all-reduce bus bandwidth" in logs and checked in logs, "the health check's outcome is not logged")
    from gpujobs.rundir.gpu_files import read_gpu_samples

    samples = read_gpu_samples(run_dir)
    need(bool(samples), "no GPU samples (gpu.<node>.jsonl)")
    need({s["rank"] for s in samples} == set(range(ranks)), {s["rank"] for s in samples})
    need(max(s.get("util_pct", 0) for s in samples) > 0, "GPU utilization never above 0")
    need(min(s["mem_used_mib"] for s in samples) > 0 and all(s["mem_total_mib"] > 0 for s in samples), samples[0])
    need(any("power_w" in s for s in samples), "no power readings")
    need(json.loads((run_dir / "prometheus.json").read_text())["addr"] == "127.0.0.1", "Prometheus not on 127.0.0.1")
    need('gpujobs_step{job="rec"}' in scrape and "gpujobs_gpu_utilization_percent{" in scrape,
         "the Prometheus endpoint did not serve job and GPU series")
    report, _ = run_child(m, [sys.executable, "-m", "gpujobs.report", str(run_dir)], 120, "the report")
    need(report == 0 and (run_dir / "report" / "gpu.png").stat().st_size > 0, "the report drew no gpu.png")
    return (f"{ranks} rank(s): {result['samples_per_s']} samples/s, auc {result['auc']}, max util "
            f"{max(s.get('util_pct', 0) for s in samples)}%, health {health[0]['health_s']} s")


def flight_recorder(m: Machine) -> str:
    return cuda_child(m, "flight_recorder")


def cuda_paths(m: Machine) -> str:
    return cuda_child(m, "cuda_paths")


def compute_clock(m: Machine) -> str:
    return cuda_child(m, "compute_clock")


def nccl_two_ranks_one_gpu(m: Machine) -> str:
    """More NCCL ranks than GPUs (two on one GPU, without the gloo switch): a clear error naming
    resources.gpus_per_node within a minute, not a hang or NCCL's own trace."""
    started = time.monotonic()
    run = submit(m, m.work / "nccl-refused" / "run", *TINY, *gpu_ranks(m.gpus + 1),
                 timeout_s=120)
    took = time.monotonic() - started
    need(run.returncode != 0, "two NCCL ranks on one GPU completed")
    need(took <= 60, f"the refusal took {took:.0f} s")
    lines = [line for line in run.output.splitlines() if "resources.gpus_per_node" in line]
    need(bool(lines), f"no line names resources.gpus_per_node: {run.output[-1500:]}")
    return f"exit {run.returncode} in {took:.0f} s: {lines[0].strip()[:70]}"


def uuid_visible_devices(m: Machine) -> str:
    """With CUDA_DEVICE_ORDER=PCI_BUS_ID torch's cuda:i is NVML's i-th GPU, by uuid; a local run with
    CUDA_VISIBLE_DEVICES naming the last GPU by its uuid (on 2+ GPUs no rank's cuda:0 is NVML's 0) trains
    there, and its rank, health check and gpu.jsonl name that uuid."""
    from gpujobs.base.nvml import CUDA_ORDER_ENV, nvml_session, visible_gpus

    with nvml_session() as nv:
        nvml = [(g.index, g.uuid) for g in visible_gpus(nv)]
    _, order = run_child(
        m, [sys.executable, "-c", "import torch; from gpujobs.base.nvml import rank_gpu_uuid as u; "
            "print(*[u(str(torch.cuda.get_device_properties(i).uuid)) for i in range(torch.cuda.device_count())])"],
        60, "torch's device list", env=CUDA_ORDER_ENV, stderr=subprocess.DEVNULL)
    need(order.split() == [uuid for _, uuid in nvml],
         f"torch's devices are not NVML's, in order: {nvml}: {order[-500:]}")
    index, uuid = nvml[-1]
    run = submit(m, m.work / "uuid" / "run", *TINY, *gpu_ranks(1), "cluster.health_check=true",
                 "telemetry.interval_s=0.2", env={"CUDA_VISIBLE_DEVICES": uuid})
    result = run.completed()
    need([(r["cuda_visible_devices"], r["gpu_uuid"]) for r in result["ranks"]] == [(uuid, uuid)], result["ranks"])
    from gpujobs.rundir.gpu_files import read_gpu_samples

    samples = read_gpu_samples(run.dir)
    need(bool(samples) and {(s["gpu"], s["uuid"], s["rank"]) for s in samples} == {(index, uuid, 0)}, samples[:3])
    health = run.metrics("health")
    need(bool(health) and health[0]["nvml"][0].endswith("1 GPU checked"), health)
    return f"CUDA_VISIBLE_DEVICES={uuid[:12]}... trained on GPU {index}; rank, gpu.jsonl, health name it"


def straggler_two_gpus(m: Machine) -> str:
    """A rank slowed by its own compute under NCCL, in a job that copies its batches blocking from pageable
    memory, is named the straggler."""
    slow_dir = m.work / "straggler"
    slow_dir.mkdir()
    # A user's job may copy from pageable memory without non_blocking: the signal must not depend on it.
    (slow_dir / "blocking_rec.py").write_text(
        '"""The rec task, copying its batches to the GPU from pageable memory, blocking."""\n'
        "from jobs.rec.task import RecTask\n\n\n"
        "class BlockingRec(RecTask):\n"
        "    def train_batch(self, step, start, stop, device):\n"
        "        return self.data.train_rows(step, start, stop).to(device)\n\n\n"
        "def build_task(model_cfg, data_cfg, world_size, micro_batches):\n"
        "    return BlockingRec(model_cfg, data_cfg, world_size, micro_batches)\n")
    path = os.pathsep.join(p for p in (str(slow_dir), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    run = submit(m, slow_dir / "run", "+experiment=rec", "cluster=local", *gpu_ranks(2),
                 "task=blocking_rec:build_task", "trainer.max_steps=100", "trainer.log_every=10",
                 "trainer.eval_every=0", "checkpoint.every_steps=0", "trainer.progress=false", "telemetry.gpu=false",
                 "trainer.balance=off", "telemetry.debug_slow_rank=1", "telemetry.debug_slow_factor=4",
                 env={"PYTHONPATH": path}, timeout_s=300)
    run.completed()
    late = run.metrics("train")[1:]  # the first window holds CUDA's warm-up
    need(len(late) >= 5, late)
    # rank 1 spends 4x its own compute: 4 / median(1, 4) = 1.6
    need(all(r["slowest_rank"] == 1 and r["imbalance"] > 1.3 for r in late),
         [(r["step"], r["local_time_s"]) for r in late])
    log0 = next((run.dir / "submitit").glob("*_0_log.err")).read_text()
    warnings = [line for line in log0.splitlines() if "straggler at step" in line]
    need(bool(warnings) and all("rank 1 (node " in line and "GPU" in line for line in warnings), warnings)
    return f"rank 1 named at {len(warnings)} log steps, imbalance {min(r['imbalance'] for r in late)}+"


def bench(m: Machine, *args: str) -> dict[str, Any]:
    """bench_gpu.py's figures, from a file of their own (NCCL's lines on its stdout cannot break them)."""
    out = Path(tempfile.mkdtemp(dir=m.work, prefix="bench_gpu.")) / "figures.json"
    cmd = [sys.executable, str(REPO / "bench" / "bench_gpu.py"), "--steps", "300", "--rounds", "3", "--json",
           str(out), *args]
    code, output = run_child(m, cmd, 300, "bench_gpu.py")
    print(output, end="")
    need(code == 0, f"exit {code}: {output[-500:]}")
    figures = dict(json.loads(out.read_text()))
    need(figures["ddp"] is True, figures)
    return figures


def bench_gpu(m: Machine) -> str:
    """Samples/s of the gpujobs Trainer against a plain loop on one GPU, both DDP in a one-rank NCCL group."""
    figures = bench(m)
    return f"DDP + hook: trainer/plain {figures['trainer_vs_plain']} ({figures['trainer_samples_per_s']:.0f} samples/s)"


def step_setting_check(name: str) -> Callable[[Machine], str]:
    """A check of the step setting `name` (`gpujobs.rank.step_settings`): the trainer's samples/s with the
    setting as it is against flipped; it fails where the default is slower by more than the noise (2%), so
    that the first GPU node decides each default."""

    def check(m: Machine) -> str:
        figures = bench(m, "--setting", name)
        ratio, default = figures["default_vs_flipped"], "on" if figures["default"] else "off"
        flipped = "off" if figures["default"] else "on"
        figure = (f"{name} {default} (default) / {flipped}: {ratio} "
                  f"({figures['trainer_samples_per_s']:.0f} / {figures['flipped_samples_per_s']:.0f} samples/s)")
        need(ratio >= 0.98, f"{figure}: the default is slower, turn it {flipped} in gpujobs/rank/step_settings.py")
        return figure

    check.__name__ = f"step_setting_{name}"
    return check


@dataclass(frozen=True)
class Check:
    """One check: what it is called, what it needs of the machine, its budget, and its body (which returns a key
    figure)."""

    name: str
    run: Callable[[Machine], str]
    needs: str = ""
    """What only a GPU gives this check ("": it runs on the CPU too)."""
    gpus: int = 0
    """The GPUs it needs (1 where `needs` says why, 2 for a two-GPU check)."""
    budget_s: float = 60
    """The most seconds it may take (on a GPU node; the deadline may leave it less)."""
    lacks: Callable[[], str] = lambda: ""
    """What else it needs that this machine lacks, in words ("": nothing)."""

    def skip_reason(self, m: Machine) -> str:
        """Why this check cannot run here ("": it can)."""
        if m.gpus >= self.gpus:
            return self.lacks()
        return f"needs {self.gpus} GPUs ({self.needs})" if m.cuda else f"needs a GPU ({self.needs})"


#: The GPU checks first: where the deadline bites, what only a GPU shows has run. The budgets add up to more
#: than the default deadline only by the checks a one-GPU node skips (the two-GPU one).
CHECKS = (
    Check("NVML health of every GPU", nvml_health, "real NVML", 1, 20),
    Check("compute clock vs host clock", compute_clock, "CUDA events and streams", 1, 30),
    Check("NCCL run: telemetry, health, report", nccl_run, "NCCL, NVML, bf16", 1, 90),
    Check("NCCL flight recorder dump", flight_recorder, "NCCL", 1, 30),
    Check("CUDA resume, RNG, amp, pinned", cuda_paths, "CUDA memory, CUDA RNG, bf16, pinned memory", 1, 45),
    Check("2 NCCL ranks on 1 GPU refused", nccl_two_ranks_one_gpu, "NCCL", 1, 60),
    Check("CUDA_VISIBLE_DEVICES=GPU-<uuid>", uuid_visible_devices, "a GPU's UUID", 1, 45),
    Check("straggler named under NCCL", straggler_two_gpus, "NCCL between two GPUs", 2, 60),
    Check("bench_gpu.py: trainer vs plain", bench_gpu, "CUDA throughput", 1, 45),
    Check("TorchRec tables sharded, DCP resume", torchrec_sharded, "FBGEMM's CUDA kernels", 1, 60,
          lacks=fbgemm_cuda_missing),
    *(Check(f"bench_gpu.py: {name}", step_setting_check(name), "CUDA throughput", 1, 30)
      for name in ("gradient_as_bucket_view", "fused_adam", "static_graph")),
    Check("resume in place, grad_accum=2", resume_in_place, budget_s=45),
    Check("USR2 -> sync save -> resume", usr2_save_resume, budget_s=40),
    Check("live hang, evidence kept", live_hang, budget_s=40),
    Check("2 ranks on 1 device, resume 2->1", two_ranks_one_device, budget_s=60),
)


def this_machine(work: Path, overrides: tuple[str, ...]) -> Machine:
    """How many GPUs the checks may use: NVML's count, where torch has CUDA too."""
    from gpujobs.backends.local.gpus import local_gpu_count
    from gpujobs.base.nvml import NvmlUnavailable, nvml_session, visible_gpus

    gpus = local_gpu_count()
    if gpus == 0:
        return Machine(0, "NVML sees no NVIDIA GPU here", "", work, overrides)
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, check=False, timeout=120)
    if probe.stdout.strip() != "True":
        return Machine(0, f"NVML sees {gpus} GPU(s) but torch has no CUDA: install its CUDA build (README)", "",
                       work, overrides)
    try:
        with nvml_session() as nv:
            uuid = visible_gpus(nv)[0].uuid
    except (NvmlUnavailable, IndexError):
        uuid = ""
    return Machine(gpus, "", uuid, work, overrides)


@dataclass
class Row:
    """A check's line of the table."""

    check: Check
    outcome: str = "not reached"
    """passed, FAILED, TIMEOUT, skipped (no GPU), n/a (more GPUs than here), not run (the deadline)."""
    figure: str = ""


class Table:
    """The summary table, printed row by row and kept whole in a file, rewritten as each row ends."""

    def __init__(self, checks: tuple[Check, ...], path: Path, title: str) -> None:
        self.rows = [Row(c) for c in checks]
        self.path, self.title = path, title
        self.width = max((len(c.name) for c in checks), default=5)

    def line(self, row: Row) -> str:
        return f"{row.check.name:{self.width}}  {'yes' if row.check.gpus else 'no':9}  {row.outcome:7}  {row.figure}"

    def text(self) -> str:
        head = f"{'check':{self.width}}  {'needs GPU':9}  {'result':7}  key figure"
        return "\n".join([self.title, head, *map(self.line, self.rows)]) + "\n"

    def end(self, row: Row, outcome: str, figure: str) -> None:
        """`row` is over: print it, rewrite the file (a temporary file renamed: never half a table)."""
        row.outcome, row.figure = outcome, figure
        print(f"row: {self.line(row)}", flush=True)
        self.save()

    def save(self) -> None:
        temp = self.path.with_name(f".{self.path.name}.tmp")
        temp.write_text(self.text())
        temp.replace(self.path)


@contextmanager
def budget(m: Machine, seconds: float) -> Iterator[None]:
    """Within `seconds`: a timer's signal then raises `CheckTimedOut` wherever the check is (waiting on a
    child, which `run_child` then kills with its group)."""

    def expired(signum: int, frame: Optional[FrameType]) -> None:
        raise CheckTimedOut

    previous = signal.signal(signal.SIGALRM, expired)
    m.budget.ends = time.monotonic() + seconds
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        m.budget.ends = math.inf


def run_checks(m: Machine, checks: tuple[Check, ...], deadline_s: float = DEADLINE_S,
               table_path: Optional[Path] = None) -> int:
    """Run every check `m` allows within `deadline_s`, each within its budget, a row printed and the table file
    (`table_path`, else table.txt in `m.work`) rewritten as each ends; the exit code: 0 every check ran and
    passed, 3 (`NO_GPU`) all that ran passed but GPU checks were skipped, 4 (`NOT_ALL_RUN`) all that ran passed
    but the deadline left some unrun, 1 a check failed or ran out of its budget."""
    started = time.monotonic()
    ends = started + deadline_s
    path = table_path or m.work / "table.txt"
    table = Table(checks, path, f"gpu_check summary ({m.gpus} GPU(s), deadline {deadline_s:.0f} s)")
    print(f"gpu_check: {m.gpus} GPU(s){'' if m.cuda else ': ' + m.why_no_gpu}; runs in {m.work}; "
          f"deadline {deadline_s:.0f} s; the table in {path}", flush=True)
    table.save()
    for row in table.rows:
        check = row.check
        skip = check.skip_reason(m)
        if skip:
            # no GPU: skipped, the exit code says so; a check of more GPUs than a GPU machine has: not applicable
            table.end(row, "n/a" if m.cuda else "skipped", skip)
            continue
        left = ends - time.monotonic()
        if left < LEAST_S:
            table.end(row, "not run", f"the deadline ({deadline_s:.0f} s) was spent before it")
            continue
        seconds = min(check.budget_s, left)
        print(f"== {check.name} (budget {seconds:.0f} s)", flush=True)
        began = time.monotonic()
        try:
            with budget(m, seconds):
                figure = check.run(m)
            outcome = "passed"
        except CheckTimedOut:
            outcome, figure = "TIMEOUT", f"stopped at its budget of {seconds:.0f} s"
        except Exception as err:  # a check's own bug fails that check, the others still run
            traceback.print_exc()
            outcome, figure = "FAILED", re.sub(r"\s+", " ", f"{type(err).__name__}: {err}")[:160]
        table.end(row, outcome, f"{figure} [{time.monotonic() - began:.0f} s]")
    table.title = f"gpu_check summary ({m.gpus} GPU(s), {time.monotonic() - started:.0f} s of {deadline_s:.0f})"
    table.save()
    print(f"\n{table.text()}", end="")
    outcomes = {row.outcome for row in table.rows}
    if outcomes & {"FAILED", "TIMEOUT"}:
        return 1
    if "not run" in outcomes:
        print(f"gpu_check: the deadline left checks unrun (rerun them with --only); exit {NOT_ALL_RUN}")
        return NOT_ALL_RUN
    if "skipped" in outcomes:
        print(f"gpu_check: no GPU to check ({m.why_no_gpu}): the GPU checks above were skipped; exit {NO_GPU}")
        return NO_GPU
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, metavar="SECONDS",
                        help=f"for the whole check (default {DEADLINE_S})")
    parser.add_argument("--table", type=Path, help="the table's file (default: table.txt in the check's folder)")
    parser.add_argument("--only", help="comma-separated words: only the checks whose name holds one")
    parser.add_argument("overrides", nargs="*", help="given to every run")
    args = parser.parse_args(argv)
    if args.deadline <= 0:
        parser.error(f"--deadline {args.deadline}: a number of seconds above 0")
    checks = CHECKS
    if args.only is not None:
        words = [w.strip() for w in args.only.split(",") if w.strip()]
        checks = tuple(c for c in CHECKS if any(w in c.name for w in words))
        if not checks:
            parser.error(f"--only {args.only}: no check's name holds one of these; checks: "
                         + "; ".join(c.name for c in CHECKS))
    m = this_machine(Path(tempfile.mkdtemp(prefix="gpu_check.")), tuple(args.overrides))
    return run_checks(m, checks, args.deadline, args.table)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""GPU throughput of the gpujobs Trainer against a plain loop, side by side in one invocation (needs CUDA).

    python bench/bench_gpu.py [--steps 300] [--rounds 3] [--json FILE] [--setting NAME] [overrides...]

The CUDA sibling of bench_trainer.py: one rank on one GPU, the same autocast in both loops (the trainer's
`amp=auto`: bf16 from compute capability 8.0, else fp32), the rec experiment, rounds alternating a, b, b,
a…; the median ratio of samples/s is reported. Both loops run DDP in a one-rank process group as a job's
(`cpu:gloo,cuda:nccl`, forced by GPUJOBS_FORCE_PROCESS_GROUP), so the trainer's side pays for what a job's
does on a GPU: NCCL all-reduces and the compute clock's communication hook (`--no-ddp`: no group, no DDP).
`--setting NAME` (a name of `gpujobs.rank.step_settings.DEFAULTS`) runs the trainer twice instead, with the
setting as it is and flipped, and reports their ratio. The figures go to stdout as JSON, or to `--json FILE`
alone (the GPU check's way: NCCL's own lines on stdout cannot break it). Exits 3 with one line where there
is no CUDA GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import checkout  # noqa: F401  (first: the checkout on the path, before gpujobs)
import torch
import torch.distributed as dist
from bench_trainer import job_config
from torch.nn.parallel import DistributedDataParallel

from gpujobs.backends.jobenv import DistInfo, free_port
from gpujobs.config.load import JobConfig
from gpujobs.rank.checkpoint import CheckpointManager
from gpujobs.rank.distributed import FORCE_GROUP_ENV, destroy_process_group, init_process_group
from gpujobs.rank.metrics import MetricsLog
from gpujobs.rank.precision import autocast_dtype
from gpujobs.rank.rng import seed_everything
from gpujobs.rank.step_settings import DEFAULTS, SETTINGS_ENV
from gpujobs.rank.train import load_task_builder
from gpujobs.rank.trainer import Trainer

INFO = DistInfo(0, 0, 1, 1, "127.0.0.1", 29500, "bench")


def run(kind: str, job: JobConfig) -> float:
    device = torch.device("cuda", 0)
    seed_everything(job.trainer.seed)
    task = load_task_builder(job.task)(job.model, job.data, 1, job.trainer.grad_accum)
    if kind != "plain":  # the trainer, as it is ("gpujobs") or with a setting flipped ("NAME=0|1")
        os.environ[SETTINGS_ENV] = "" if kind == "gpujobs" else kind
        info = INFO
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(job, info, device, task, CheckpointManager(Path(tmp), 0, 1, 0), MetricsLog(None))
            return float(trainer.fit()["samples_per_s"])
    model = task.model.to(device)
    # the plain loop's DDP, without a hook: what the trainer adds on top of it is the cost measured
    wrapped = DistributedDataParallel(model, device_ids=[0]) if dist.is_initialized() else model
    dtype = autocast_dtype(job.trainer.amp, [torch.cuda.get_device_capability(device)])  # the trainer's choice
    optimizer = torch.optim.Adam(model.parameters(), lr=job.optim.lr)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for step in range(job.trainer.max_steps):
        batch = task.train_batch(step, 0, task.global_batch_size, device)
        with torch.autocast(device_type="cuda", dtype=dtype, enabled=dtype is not None):
            loss = task.loss(wrapped, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return task.global_batch_size * job.trainer.max_steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-ddp", dest="ddp", action="store_false", help="one rank without a process group")
    parser.add_argument("--json", type=Path, help="write the figures here, not to stdout")
    parser.add_argument("--setting", choices=sorted(DEFAULTS), help="the trainer with this setting flipped, not "
                        "the plain loop, against the trainer as it is")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU here (torch.cuda.is_available() is False); this bench needs one",
              file=sys.stderr)
        raise SystemExit(3)
    # procs_per_node too: the rec experiment's 2 CPU ranks would otherwise refuse one GPU rank
    job = job_config(args.steps, ["resources.gpus_per_node=1", "resources.procs_per_node=1", "trainer.log_every=50",
                                  *args.overrides])
    if args.ddp:
        os.environ[FORCE_GROUP_ENV] = "1"
        init_process_group(dataclasses.replace(INFO, master_port=free_port()), job.nccl, 120)
    other = "plain" if args.setting is None else f"{args.setting}={int(not DEFAULTS[args.setting])}"
    rates: dict[str, list[float]] = {"gpujobs": [], other: []}
    run("plain", job)  # warm-up: CUDA context, kernels, allocator
    for round_ in range(args.rounds):
        for kind in ("gpujobs", other) if round_ % 2 == 0 else (other, "gpujobs"):
            rates[kind].append(run(kind, job))
            print(f"round {round_}: {kind:8s} {rates[kind][-1]:12.0f} samples/s", file=sys.stderr)
    ratios = [a / b for a, b in zip(rates["gpujobs"], rates[other], strict=True)]
    figures: dict[str, object] = {
        "device": torch.cuda.get_device_name(0),
        "steps": args.steps,
        "ddp": args.ddp,
        "trainer_samples_per_s": round(statistics.median(rates["gpujobs"]), 1),
    }
    if args.setting is None:
        figures.update(plain_samples_per_s=round(statistics.median(rates["plain"]), 1),
                       trainer_vs_plain=round(statistics.median(ratios), 3))
    else:
        figures.update(setting=args.setting, default=DEFAULTS[args.setting],
                       flipped_samples_per_s=round(statistics.median(rates[other]), 1),
                       default_vs_flipped=round(statistics.median(ratios), 3))
    text = json.dumps(figures, indent=2)
    if args.json is None:
        print(text)
    else:
        args.json.write_text(text + "\n")
    if args.ddp:
        destroy_process_group()


if __name__ == "__main__":
    main()

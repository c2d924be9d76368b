"""What telemetry costs the training loop, side by side in one invocation.

    python bench/bench_telemetry.py [--steps 200] [--rounds 5] [overrides...]

The gpujobs Trainer trains the rec experiment with 2 gloo ranks (a) with telemetry on (the
Prometheus endpoint on rank 0, the node's GPU sampler, the straggler check) and (b) with it off;
rounds alternate a, b, b, a… and the median ratio of samples/s is reported (this machine is shared
and noisy: only ratios mean anything). Target: on/off >= 0.98. Without NVML the sampler stops at
start, so on a CPU-only machine this measures the endpoint and the per-step hooks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_trainer import WORLD, job_config, join_as_rank, spawn_rate, trained_rate

from gpujobs.config.load import JobConfig
from gpujobs.rank.checkpoint import CheckpointManager
from gpujobs.rank.distributed import gather_ranks
from gpujobs.rank.metrics import MetricsLog
from gpujobs.rank.observe.telemetry import Telemetry
from gpujobs.rank.trainer import Trainer


def _rank(rank: int, on: bool, job: JobConfig, port: int, out: Any) -> None:
    info, task = join_as_rank(rank, job, port)
    device = torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        ranks = gather_ranks(info, device)  # the entry gathers this table whether telemetry is on or not
        telemetry = Telemetry.start(job, info, ranks, False, Path(tmp)) if on else None
        try:
            checkpoints = CheckpointManager(Path(tmp), 0, 1, rank, world_size=info.world_size)
            trainer = Trainer(job, info, device, task, checkpoints, MetricsLog(None), telemetry=telemetry)
            rate = trained_rate(trainer.fit(), job)
        finally:
            if telemetry is not None:
                telemetry.close()
    if rank == 0:
        out.put(rate)
    dist.destroy_process_group()


def run(on: bool, job: JobConfig, port: int) -> float:
    return spawn_rate(f"telemetry {'on' if on else 'off'}", _rank, on, job, port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    job = job_config(args.steps, ["telemetry.prometheus_port=0", "telemetry.interval_s=1", *args.overrides])
    rates: dict[bool, list[float]] = {True: [], False: []}
    port = 29600 + os.getpid() % 1000
    for round_ in range(args.rounds):
        for on in (True, False) if round_ % 2 == 0 else (False, True):
            port += 1
            rates[on].append(run(on, job, port))
            print(f"round {round_}: telemetry {'on ' if on else 'off'} {rates[on][-1]:10.0f} samples/s",
                  file=sys.stderr)
    ratios = [a / b for a, b in zip(rates[True], rates[False], strict=True)]
    report = {
        "world_size": WORLD,
        "steps": args.steps,
        "rounds": args.rounds,
        "on_samples_per_s": round(statistics.median(rates[True]), 1),
        "off_samples_per_s": round(statistics.median(rates[False]), 1),
        "on_vs_off": round(statistics.median(ratios), 3),
        "ratios": [round(r, 3) for r in ratios],
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

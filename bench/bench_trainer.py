"""Trainer overhead and data-pipeline headroom, side by side in one invocation.

    python bench/bench_trainer.py [--steps 500] [--rounds 8] [overrides...]
    python bench/bench_trainer.py logger=tensorboard     # the trainer side with a tracker (bar: >= 0.95x)

(a) the gpujobs Trainer and (b) a hand-written minimal DDP loop train the same rec model on the same
data for the same steps with 2 gloo ranks, doing the same math (Adam at a constant learning rate, no
gradient clipping: the trainer is configured so), so the ratio is the framework's overhead (logging,
timing, the preemption agreement, checkpoint policy, the hang watchdog's heartbeat), not the cost of
extra features. Rounds alternate a, b, a, b… and the median ratio of samples/s is reported (this
machine is shared and noisy: only ratios mean anything). Then the data pipeline alone (one rank's
`train_batch` calls) is timed against the trainer's per-rank rate.

With a `logger=...` override the trainer side also runs rank 0's experiment trackers as a job does
(`gpujobs.rank.observe.trackers`, fed by the trainer's `on_step`), really writing: TensorBoard event files and an
MLflow sqlite store in the round's temporary run dir. The minimal loop logs nothing, so the ratio then
includes the trackers' cost.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import checkout  # noqa: F401  (first: the checkout on the path, before gpujobs)
import torch
import torch.multiprocessing as mp
from hydra import compose, initialize_config_dir
from sides import fail, last_line
from torch.nn.parallel import DistributedDataParallel

from gpujobs.backends.jobenv import DistInfo
from gpujobs.config.load import JobConfig, load_config
from gpujobs.rank.checkpoint import CheckpointManager
from gpujobs.rank.distributed import destroy_process_group, init_process_group
from gpujobs.rank.metrics import MetricsLog
from gpujobs.rank.observe.trackers import open_trackers
from gpujobs.rank.rng import seed_everything
from gpujobs.rank.train import load_task_builder
from gpujobs.rank.trainer import Trainer
from gpujobs.rundir.heartbeat import Heartbeat, interval_for

REPO = Path(__file__).resolve().parent.parent
WORLD = 2
CPU = torch.device("cpu")


def job_config(steps: int, overrides: list[str]) -> JobConfig:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["+experiment=rec", "cluster=local", f"trainer.max_steps={steps}",
                       "trainer.eval_every=0", "checkpoint.every_steps=0",
                       # the minimal loop's math: constant lr, no clipping (overrides below may change it)
                       "optim.schedule=constant", "optim.warmup_steps=0", "trainer.grad_clip=null", *overrides],
        )
    return load_config(cfg)


def join_as_rank(rank: int, job: JobConfig, port: int) -> tuple[DistInfo, Any]:
    """In a spawned bench process: join the gloo group as `rank` and build the job's task."""
    torch.set_num_threads(job.resources.cpus)
    info = DistInfo(rank, rank, WORLD, WORLD, "127.0.0.1", port, "bench")
    init_process_group(info, job.nccl, 120)
    seed_everything(job.trainer.seed)
    return info, load_task_builder(job.task)(job.model, job.data, WORLD, job.trainer.grad_accum)


def tracked_in(job: JobConfig, tmp: Path) -> JobConfig:
    """`job` with its MLflow store (if `logger=mlflow`) in the round's temporary dir, not the submit dir's."""
    if job.logger.mlflow is None:
        return job
    store = dataclasses.replace(job.logger.mlflow, tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    return dataclasses.replace(job, logger=dataclasses.replace(job.logger, mlflow=store))


def _rank(rank: int, kind: str, job: JobConfig, port: int, out: Any) -> None:
    rate = _trainer_rate(rank, job, port) if kind == "gpujobs" else _minimal_rate(rank, job, port)
    if rank == 0:
        out.put(rate)
    # as a job leaves its group: after its DDP wrapper is gone (with the frame above), gloo's workers idle
    # (leaving with the wrapper alive aborted a rank now and then: "terminate called without an active exception")
    destroy_process_group()


def _trainer_rate(rank: int, job: JobConfig, port: int) -> float:
    """The gpujobs Trainer's samples/s on this rank."""
    with tempfile.TemporaryDirectory() as tmp:
        # as a job does: rank 0's trackers (`logger=...`) start before the rank joins and builds its task
        trackers = open_trackers(tracked_in(job, Path(tmp)), Path(tmp), rank == 0)
        info, task = join_as_rank(rank, job, port)
        checkpoints = CheckpointManager(Path(tmp), 0, 1, rank, world_size=WORLD)
        # the hang watchdog's heartbeat, as a real job runs it (a thread writing its file every second)
        beat = Heartbeat(Path(tmp), rank, "bench", interval_for(job.trainer.hang_timeout_s or 300)).start()
        with trackers:
            trainer = Trainer(job, info, CPU, task, checkpoints, MetricsLog(None), heartbeat=beat,
                              on_step=trackers.on_step(lambda record: None))
            # the final eval and checkpoint are outside the timed window (samples_per_s excludes them)
            rate = trained_rate(trainer.fit(), job)
        beat.close()
    return rate


def _minimal_rate(rank: int, job: JobConfig, port: int) -> float:
    """The hand-written minimal DDP loop's samples/s on this rank."""
    _, task = join_as_rank(rank, job, port)
    model = DistributedDataParallel(task.model)
    optimizer = torch.optim.Adam(model.parameters(), lr=job.optim.lr)
    samples = task.global_batch_size
    share = samples // WORLD  # the minimal loop's sharding: equal slices of the global batch
    start = time.perf_counter()
    for step in range(job.trainer.max_steps):
        batch = task.train_batch(step, rank * share, (rank + 1) * share, CPU)
        loss = task.loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return samples * job.trainer.max_steps / (time.perf_counter() - start)


def spawn_rate(side: str, rank_fn: Callable[..., None], *args: Any) -> float:
    """Run `rank_fn(rank, *args, queue)` on WORLD spawned ranks; rank 0 puts its samples/s in the queue. A rank
    that fails stops the bench naming `side` (`sides.fail`)."""
    queue = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(rank_fn, args=(*args, queue), nprocs=WORLD, join=True)
    except Exception as err:  # a rank's exception, re-raised here with its traceback as the message
        fail(side, last_line(str(err)))
    return float(queue.get())


def trained_rate(result: dict[str, Any], job: JobConfig) -> float:
    """The samples/s of a `Trainer.fit` result that trained every step; RuntimeError otherwise (a trainer that
    stopped early is fast, and no measure of the trainer)."""
    if result["status"] != "completed" or result["steps"] != job.trainer.max_steps:
        raise RuntimeError(f"the trainer ended {result['status']} at step {result['steps']} of "
                           f"{job.trainer.max_steps}")
    return float(result["samples_per_s"])


def run(kind: str, job: JobConfig, port: int) -> float:
    return spawn_rate(kind, _rank, kind, job, port)


def data_rate(job: JobConfig, steps: int) -> float:
    seed_everything(job.trainer.seed)
    task = load_task_builder(job.task)(job.model, job.data, WORLD, job.trainer.grad_accum)
    device = CPU
    share = task.global_batch_size // WORLD
    task.train_batch(0, 0, share, device)
    start = time.perf_counter()
    for step in range(steps):
        task.train_batch(step, 0, share, device)
    return share * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    job = job_config(args.steps, args.overrides)
    rates: dict[str, list[float]] = {"gpujobs": [], "minimal": []}
    load_before = os.getloadavg()[0]
    port = 29600 + os.getpid() % 1000
    for round_ in range(args.rounds):
        for kind in ("gpujobs", "minimal") if round_ % 2 == 0 else ("minimal", "gpujobs"):
            port += 1
            rates[kind].append(run(kind, job, port))
            print(f"round {round_}: {kind:8s} {rates[kind][-1]:10.0f} samples/s", file=sys.stderr)
    ratios = [a / b for a, b in zip(rates["gpujobs"], rates["minimal"], strict=True)]
    trainer_per_rank = statistics.median(rates["gpujobs"]) / WORLD
    pipeline = data_rate(job, 2000)
    report = {
        "world_size": WORLD,
        "steps": args.steps,
        "rounds": args.rounds,
        "logger": job.logger.selected,
        "trainer_samples_per_s": round(statistics.median(rates["gpujobs"]), 1),
        "minimal_samples_per_s": round(statistics.median(rates["minimal"]), 1),
        "trainer_vs_minimal": round(statistics.median(ratios), 3),
        "data_pipeline_samples_per_s_per_rank": round(pipeline, 1),
        "data_pipeline_vs_trainer_per_rank": round(pipeline / trainer_per_rank, 1),
        # on a shared machine: how loaded it was (1-minute load average, before and after, and its cores)
        "cores": os.cpu_count(),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "ratios": [round(r, 3) for r in ratios],
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

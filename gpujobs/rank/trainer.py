"""The DDP training loop. It reports its step; checkpoint, metrics and progress policy live elsewhere."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gpujobs.backends.jobenv import DistInfo
from gpujobs.config.load import JobConfig
from gpujobs.rank import collectives
from gpujobs.rank.balance import Balancer, replay_history
from gpujobs.rank.checkpoint import CheckpointManager
from gpujobs.rank.compute_clock import ComputeClock
from gpujobs.rank.metrics import MetricsLog, param_digest
from gpujobs.rank.observe.telemetry import Telemetry
from gpujobs.rank.optim import build_optimizer, build_scheduler
from gpujobs.rank.precision import autocast_dtype, describe, emulated_bf16
from gpujobs.rank.rng import reseed_rank, rng_state, set_rng_state
from gpujobs.rank.stop import PreemptionWatcher
from gpujobs.rank.task import Task
from gpujobs.rundir.heartbeat import NoBeat
from gpujobs.rundir.records import CheckpointRecord, EvalRecord, MetricsRecord, PlanRecord, TrainRecord
from gpujobs.rundir.resume import check_same_run

log = logging.getLogger(__name__)


@dataclass
class StepTimes:
    """Per-rank timing of the steps since the last log line."""

    steps: int = 0
    step_s: float = 0.0
    data_s: float = 0.0
    local_s: float = 0.0
    """Data wait + forward on the host clock: what the straggler check compares where `compute_s` is not
    measured (on the CPU, without dynamic balancing or the slow-GPU emulation)."""
    loss_sum: float | torch.Tensor = 0.0
    compute_s: float = 0.0
    """Data + forward + backward up to the gradient all-reduce (`ComputeClock`), summed."""
    rows: int = 0
    """Rows this rank read."""

    def reset(self) -> None:
        """Start a new window."""
        self.steps, self.step_s, self.data_s, self.local_s, self.loss_sum = 0, 0.0, 0.0, 0.0, 0.0
        self.compute_s, self.rows = 0.0, 0


class Trainer:
    """Runs `task` for `job.trainer.max_steps` optimizer steps on this rank."""

    def __init__(
        self,
        job: JobConfig,
        info: DistInfo,
        device: torch.device,
        task: Task,
        checkpoints: CheckpointManager,
        metrics: MetricsLog,
        on_step: Optional[Callable[[int, MetricsRecord], None]] = None,
        telemetry: Optional[Telemetry] = None,
        preemption: Optional[PreemptionWatcher] = None,
        heartbeat: Optional[NoBeat] = None,
    ) -> None:
        self.job = job
        self.info = info
        self.device = device
        self.task = task
        self.checkpoints = checkpoints
        self.metrics = metrics
        self.on_step = on_step or (lambda step, record: None)
        self.telemetry = telemetry or Telemetry()
        self.preemption = preemption or PreemptionWatcher()
        self.beat = heartbeat or NoBeat()
        """Step and phase for the hang watchdog: two attribute stores per phase, nothing more."""
        cfg = job.trainer
        self.model = task.model.to(device)
        slowed = job.telemetry.debug_slow_rank == info.rank
        # Compute time is measured where something uses it (dynamic plans, the slow-GPU emulation, the
        # straggler check on a GPU, where the host clock reads the slowest rank's time on every rank): its
        # communication hook costs a Python call per gradient bucket, ~2% of a small model's CPU step.
        self.timed = cfg.balance == "dynamic" or job.telemetry.debug_slow_factor > 1 or device.type == "cuda"
        self.clock = ComputeClock(device, job.telemetry.debug_slow_factor if slowed else 1.0)
        self.ddp: torch.nn.Module = self.model
        if dist.is_initialized():
            ids = [device.index] if device.type == "cuda" else None
            self.ddp = DistributedDataParallel(self.model, device_ids=ids)
            if self.timed:
                self.clock.install(self.ddp)
        self.optimizer = build_optimizer(list(self.model.parameters()), job.optim)
        self.scheduler = build_scheduler(self.optimizer, job.optim, cfg.max_steps)
        capabilities = self._gpu_capabilities() if device.type == "cuda" else []
        dtype = autocast_dtype(cfg.amp, capabilities)
        self.autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
        if dtype is not None:
            self.autocast = functools.partial(torch.autocast, device_type=device.type, dtype=dtype)
        if info.is_main:
            log.info("precision: %s", describe(dtype, capabilities))
            if warning := emulated_bf16(cfg.amp, capabilities):
                log.warning("%s", warning)
        self.global_batch = task.global_batch_size
        self.balancer = Balancer(
            cfg, info.world_size, self.global_batch // cfg.grad_accum,
            gpu_names=self._gpu_names() if cfg.balance == "static" and cfg.balance_gpu_weights else [],
            replay=replay_history(cfg.balance_replay) if cfg.balance == "replay" and cfg.balance_replay else [],
        )
        self.balance_window = StepTimes()
        self.step = 0
        self.samples = 0
        """Global samples trained over the run's whole life (restored from checkpoints)."""
        self.saved_step = -1  # same on every rank, so the decision to save is collective
        self.saved: Optional[str] = None
        self.resumed_from: Optional[str] = None
        self.resume_skipped: list[dict[str, Any]] = []
        self.trained_from: Optional[float] = None
        """When the first training step of this attempt began (epoch seconds)."""

    def _gpu_names(self) -> list[str]:
        """Every rank's GPU model name as CUDA reports it ("cpu" for a CPU rank); collective."""
        mine = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return [str(name) for name in collectives.all_gather_objects(mine)]

    def _gpu_capabilities(self) -> list[tuple[int, int]]:
        """Every rank's CUDA compute capability, so that all ranks choose one precision; collective."""
        mine = tuple(torch.cuda.get_device_capability(self.device))
        return [(int(major), int(minor)) for major, minor in collectives.all_gather_objects(mine)]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What every rank shares: written once, by rank 0."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "samples": self.samples,
            "balance": self.balancer.state_dict(),
            "config": self.job.to_dict(),
        }

    def restore(self) -> bool:
        """Continue from the newest checkpoint that verifies on every rank (collective); True when it did.

        Whatever `checkpoint.resume` says: the submit side refuses `resume=false` where the run dir holds
        checkpoints, so any found here are this run's own, saved by an earlier attempt of it (a requeue,
        a restart), and starting over would redo, and then prune, what it saved.

        Newer steps that did not verify are logged and kept in `resume_skipped` for the attempt's line;
        a checkpoint of another run (what a step computes differs) is refused. At another world size the
        shared state carries over and each rank's random streams are re-derived from (seed, step, rank).
        """
        self.beat.phase = "checkpoint"
        # Loaded on the CPU: `load_state_dict` copies the model into its parameters and moves the optimizer
        # state to their device, all but Adam's `step` counters, which stay where they were loaded; on the
        # GPU, Adam would read each with `.item()` (a host sync) per parameter per step. A GPU load would
        # also hold a second copy of model and optimizer in GPU memory until the copies are done.
        found, self.resume_skipped = self.checkpoints.load_latest(map_location="cpu")
        if found is None:
            return False
        check_same_run(found.meta, self.job, found.path, global_batch=self.global_batch)
        self.model.load_state_dict(found.shared["model"])
        self.optimizer.load_state_dict(found.shared["optimizer"])
        self.scheduler.load_state_dict(found.shared["scheduler"])
        self.step = self.saved_step = int(found.shared["step"])
        self.samples = int(found.shared.get("samples", self.step * self.global_batch))
        if "balance" in found.shared:
            self.balancer.load_state_dict(found.shared["balance"])
        saved_world = found.meta.get("world_size", self.info.world_size)
        if found.own:
            set_rng_state(found.own.get("rng", {}), self.device)
        else:
            reseed_rank(self.job.trainer.seed, self.step, self.info.rank)
        self.resumed_from = self.saved = found.path
        log.info("resumed from %s (step %d, saved at world size %s, now %d)",
                 found.path, self.step, saved_world, self.info.world_size)
        return True

    def _meta(self) -> dict[str, Any]:
        return {"config": self.job.to_dict(), "world_size": self.info.world_size,
                "global_batch_size": self.global_batch, "samples": self.samples,
                "balance": {"mode": self.balancer.mode, "history": self.balancer.history}}

    def save(self) -> None:
        """Collective and synchronous (it first waits for an asynchronous save in flight): every rank
        writes its part, rank 0 publishes once all are durable.

        Raises CheckpointNotSaved on every rank when any rank failed: nothing was published.
        """
        started = time.perf_counter()
        self.beat.phase = "checkpoint"
        self._published(self.checkpoints.wait())
        own = {"rng": rng_state(self.device)}
        self.saved = str(self.checkpoints.save(self.step, self.state_dict, own, self._meta()))
        self.saved_step = self.step
        self._record_save(False, time.perf_counter() - started)

    def save_async(self) -> None:
        """Collective: blocks while the state is copied to host memory; the rest runs in the background
        (`poll` at every step boundary publishes it, or raises its failure on every rank)."""
        self.beat.phase = "checkpoint"
        self._published(self.checkpoints.wait())  # the save before it, taken here: `saved` says it
        self.checkpoints.save_async(self.step, self.state_dict, {"rng": rng_state(self.device)}, self._meta())
        self.saved_step = self.step
        self._record_save(True, self.checkpoints.last_blocking_s)

    def _published(self, path: Any) -> None:
        if path is not None:
            self.saved = str(path)

    def _record_save(self, background: bool, blocking_s: float) -> None:
        record = self.telemetry.step(CheckpointRecord(self.step, round(blocking_s, 6), background))
        self.metrics.write(record)

    # ------------------------------------------------------------------ loop
    def _micro_steps(self) -> Iterator[tuple[int, contextlib.AbstractContextManager[Any]]]:
        accum = self.job.trainer.grad_accum
        for micro in range(accum):
            # Gradients are all-reduced on the last micro-step only; before it, no_sync
            # keeps them local so accumulation costs one all-reduce per optimizer step.
            last = micro == accum - 1
            sync = contextlib.nullcontext() if last or self.ddp is self.model else self.ddp.no_sync()  # type: ignore[operator]
            yield micro, sync

    def train_step(self, times: StepTimes) -> None:
        """One optimizer step over `grad_accum` micro-batches, this rank's rows of each by the split plan."""
        plan, rank = self.balancer.plan, self.info.rank
        micro_rows, count, offset = self.balancer.micro_batch, plan.counts[rank], plan.offset(rank)
        weight = plan.weight(rank, self.global_batch)
        start = time.perf_counter()
        beat = self.beat
        for micro, sync in self._micro_steps():
            beat.phase = "data"
            fetch = time.perf_counter()
            if self.timed:
                self.clock.start()
            if micro == 0:
                self.telemetry.before_step()
            first = micro * micro_rows + offset
            batch = self.task.train_batch(self.step, first, first + count, self.device)
            times.data_s += time.perf_counter() - fetch
            beat.phase = "compute"  # DDP's gradient all-reduce runs inside backward
            with sync:
                with self.autocast():
                    # The rank's share of the global batch's mean loss, times the world size that DDP divides by
                    loss = self.task.loss(self.ddp, batch)
                    if weight != 1.0:
                        loss = loss * weight
                times.local_s += time.perf_counter() - fetch
                loss.backward()
            if self.timed:
                self.clock.end()  # after the all-reduce hook already marked it, on a synced micro-batch: no-op
            # summed on the device, read once per log line: no host sync on every step
            times.loss_sum = times.loss_sum + loss.detach()
        beat.phase = "optimizer"
        if self.job.trainer.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.job.trainer.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        beat.step = self.step
        self.samples += self.global_batch
        rows = count * self.job.trainer.grad_accum
        times.steps += 1
        times.rows += rows
        self.balance_window.rows += rows
        times.step_s += time.perf_counter() - start

    def fit(self) -> dict[str, Any]:
        """Train to max_steps (resuming if possible); returns the result record (same on all ranks)."""
        cfg = self.job.trainer
        wall_start = time.perf_counter()
        resumed = self.restore()
        self._write(self.balancer.start(self.step, resumed))
        times = StepTimes()
        window_start = time.perf_counter()
        train_s, start_samples = 0.0, self.samples
        evals: dict[str, float] = {}
        start_step, stopped = self.step, False
        self.ddp.train()
        self.trained_from = time.time()
        self.beat.step = self.beat.start_step = self.step
        self.beat.trained_from = self.trained_from
        while self.step < cfg.max_steps:
            self._write(self.balancer.replay_at(self.step))
            self.train_step(times)
            if cfg.log_every and (self.step % cfg.log_every == 0 or self.step == cfg.max_steps):
                elapsed = time.perf_counter() - window_start
                train_s += elapsed
                self._log_window(times, elapsed)
                times.reset()
            if self.balancer.mode == "dynamic" and self.step % cfg.balance_every == 0 and self.step < cfg.max_steps:
                self._rebalance(times)
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.max_steps:
                evals = self._evaluate()
            if self.checkpoints.in_flight is not None:
                self.beat.phase = "checkpoint"
                self._published(self.checkpoints.poll())
            if self.checkpoints.should_save(self.step, cfg.max_steps):
                if self.job.checkpoint.background and self.step < cfg.max_steps:
                    self.save_async()
                else:
                    self.save()
            if times.steps == 0:
                window_start = time.perf_counter()
            # All ranks check at the same steps and agree, so all stop after this same step; not after
            # the last one, where the run completes (a stop there would only requeue a finished run).
            if self.step < cfg.max_steps and self.step % cfg.stop_check_every == 0 and self._should_stop():
                stopped = True
                break
        if times.steps:
            train_s += time.perf_counter() - window_start
        if not stopped:
            evals = self._evaluate()
        self._published(self.checkpoints.wait())
        if self.saved_step != self.step:
            self.save()
        return {
            "status": "preempted" if stopped else "completed",
            "start_step": start_step,
            "saved": self.saved,
            "steps": self.step,
            "world_size": self.info.world_size,
            "samples": self.samples,
            **evals,
            "samples_per_s": round((self.samples - start_samples) / train_s, 2) if train_s > 0 else None,
            "wall_s": round(time.perf_counter() - wall_start, 3),
            "param_digest": param_digest(self.model),
            "resumed_from": self.resumed_from,
            "resume_skipped": self.resume_skipped,
        }

    # ------------------------------------------------------------------ helpers
    def _barrier(self) -> None:
        self.beat.phase = "collective"
        collectives.barrier()

    def _should_stop(self) -> bool:
        self.beat.phase = "collective"
        return self.preemption.should_stop()

    def _write(self, record: Optional[PlanRecord]) -> None:
        """A plan record (or None: nothing changed) to the metrics, on rank 0."""
        if record is not None:
            log.info("split plan from step %d (%s): %s rows per rank", record.step, record.reason, record.counts)
            self.metrics.write(record)

    def _take_compute(self, times: StepTimes) -> None:
        """Move the clock's compute seconds into both windows (the log line's and the balancer's)."""
        seconds = self.clock.read()
        times.compute_s += seconds
        self.balance_window.compute_s += seconds

    def _rebalance(self, times: StepTimes) -> None:
        """dynamic: gather every rank's compute time and rows since the last update; every rank derives
        the same new plan from the same table (one small all-gather every balance_every steps)."""
        self._take_compute(times)
        self.beat.phase = "collective"
        window = self.balance_window
        table = collectives.all_gather_rows(torch.tensor([window.compute_s, float(window.rows)], dtype=torch.float64))
        self.balance_window = StepTimes()
        self._write(self.balancer.update(self.step, table[:, 0].tolist(), table[:, 1].tolist()))

    def _log_window(self, times: StepTimes, elapsed: float) -> None:
        """Gather every rank's timing (one small all-gather per log line) and write the record."""
        self._take_compute(times)
        per_sample = times.compute_s / times.rows if times.rows and self.timed else 0.0
        # The straggler check's signal: the compute clock's where it runs, as it holds the rank's backward
        # too (where a slower GPU, or the emulation, spends its extra time) and, on a GPU, none of the wait
        # for the others that the host clock there holds
        local_s = times.compute_s if self.timed else times.local_s
        mine = torch.tensor(
            [times.step_s, times.data_s, float(times.loss_sum), local_s, per_sample * times.steps]
        ) / times.steps
        self.beat.phase = "collective"
        table = collectives.all_gather_rows(mine)  # world size x 5, on the CPU whatever the backend
        record = self.telemetry.step(TrainRecord(
            step=self.step,
            # each rank's loss is weighted by its share times the world size: their mean is the global batch's
            loss=round(float(table[:, 2].mean()), 6),
            lr=float(self.scheduler.get_last_lr()[0]),
            samples_per_s=round(self.global_batch * times.steps / elapsed, 2),
            step_time_s=[round(float(x), 6) for x in table[:, 0]],
            data_time_s=[round(float(x), 6) for x in table[:, 1]],
            local_time_s=[round(float(x), 6) for x in table[:, 3]],
            compute_s_per_sample=[round(float(x), 9) for x in table[:, 4]] if self.timed else [],
            counts=list(self.balancer.plan.counts),
            balance=self.balancer.mode,
        ))
        self.metrics.write(record)
        self.on_step(self.step, record)

    def _evaluate(self) -> dict[str, float]:
        """Rank 0 evaluates the unwrapped model; the others wait at a barrier."""
        results: dict[str, float] = {}
        if self.info.is_main:
            self.beat.phase = "eval"
            results = {k: round(float(v), 6) for k, v in self.task.evaluate(self.model, self.device).items()}
            record = self.telemetry.step(EvalRecord(self.step, results))
            self.metrics.write(record)
            self.on_step(self.step, record)
        self._barrier()
        return results

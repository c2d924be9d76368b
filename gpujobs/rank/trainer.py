"""The DDP training loop. It reports its step; checkpoint, metrics and progress policy live elsewhere."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import torch

from gpujobs.backends.jobenv import DistInfo
from gpujobs.config.load import JobConfig
from gpujobs.rank import collectives
from gpujobs.rank.balance import Balancer, replay_history
from gpujobs.rank.buckets import settle_buckets
from gpujobs.rank.checkpoint import Checkpointed, CheckpointManager
from gpujobs.rank.compute_clock import ComputeClock, StepTimes
from gpujobs.rank.distributed import device_names
from gpujobs.rank.metrics import GatheringTrainRecord, MetricsLog, peak_rss_mb
from gpujobs.rank.observe.telemetry import Telemetry
from gpujobs.rank.optim import build_optimizer, build_scheduler, schedule_is_flat
from gpujobs.rank.parallel.spread import spread
from gpujobs.rank.precision import job_autocast
from gpujobs.rank.rng import reseed_rank, rng_state, set_rng_state
from gpujobs.rank.stop import PreemptionWatcher
from gpujobs.rank.task import Task
from gpujobs.rundir.heartbeat import NoBeat
from gpujobs.rundir.marker import SavedBalance, SavedRun
from gpujobs.rundir.records import CheckpointRecord, EvalRecord, MetricsRecord, PlanRecord, TrainRecord
from gpujobs.rundir.resume import check_same_run

log = logging.getLogger(__name__)


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
        self.job, self.info, self.device, self.task = job, info, device, task
        self.checkpoints, self.metrics = checkpoints, metrics
        self.on_step = on_step or (lambda step, record: None)
        self.telemetry = telemetry or Telemetry()
        self.preemption = preemption or PreemptionWatcher()
        self.beat = heartbeat or NoBeat()
        """Step and phase for the hang watchdog: two attribute stores per phase, nothing more."""
        cfg = job.trainer
        slowed = job.telemetry.debug_slow_rank == info.rank
        # Compute time is measured where something uses it (dynamic plans, the slow-GPU emulation, the
        # straggler check on a GPU, where the host clock reads the slowest rank's time on every rank): its
        # communication hook costs a Python call per gradient bucket, ~2% of a small model's CPU step.
        self.timed = cfg.balance == "dynamic" or job.telemetry.debug_slow_factor > 1 or device.type == "cuda"
        self.clock = ComputeClock(device, job.telemetry.debug_slow_factor if slowed else 1.0)
        self.spread = spread(job, info, task.model, device, self.clock if self.timed else None,
                             checkpoints.directory.parent)
        self.model, self.ddp = self.spread.model, self.spread.wrapped
        """The model as evaluated and saved; the model as the step runs it (DDP's or TorchRec's wrapper)."""
        self.optimizer = build_optimizer(self.spread.trained_parameters(), job.optim, cuda=device.type == "cuda")
        self.scheduler = build_scheduler(self.optimizer, job.optim, cfg.max_steps)
        self.flat_schedule = schedule_is_flat(job.optim)
        self.autocast = job_autocast(cfg.amp, device, info.is_main)
        self.global_batch = task.global_batch_size
        self.balancer = Balancer(
            cfg, info.world_size, self.global_batch // cfg.grad_accum,
            gpu_names=device_names(device) if cfg.balance == "static" and cfg.balance_gpu_weights else [],
            replay=replay_history(cfg.balance_replay) if cfg.balance == "replay" and cfg.balance_replay else [],
        )
        self.balance_window = StepTimes()
        self.step = 0
        self.samples = 0
        """Global samples trained over the run's whole life (restored from checkpoints)."""
        self.resumed_from: Optional[str] = None
        self.resume_skipped: list[dict[str, Any]] = []
        self.trained_from: Optional[float] = None
        """When the first training step of this attempt began (epoch seconds)."""
        self.gathering: Optional[GatheringTrainRecord] = None
        """The last log step's train record, written at the next step boundary (`_write_logged`)."""
        own = lambda: {"rng": rng_state(device)}  # noqa: E731
        checkpoints.track(Checkpointed(self.state_dict, own, self._saved_run, cfg.max_steps, self.spread.sharded_state))

    @property
    def saved(self) -> Optional[str]:
        """The newest checkpoint published by this attempt (or resumed from)."""
        published = self.checkpoints.published
        return None if published is None else str(published)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What every rank shares: written once, by rank 0."""
        return {
            "model": self.spread.model_state(),
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
        check_same_run(found.marker, self.job, found.path, global_batch=self.global_batch)
        self.spread.load_model_state(found.shared["model"])
        self.spread.load_sharded(Path(found.path))  # collective: every rank found the same checkpoint
        self.optimizer.load_state_dict(found.shared["optimizer"])
        self.scheduler.load_state_dict(found.shared["scheduler"])
        self.step = int(found.shared["step"])
        self.samples = int(found.shared.get("samples", self.step * self.global_batch))
        if "balance" in found.shared:
            self.balancer.load_state_dict(found.shared["balance"])
        saved_world = found.marker.world_size or self.info.world_size
        if found.own:
            set_rng_state(found.own.get("rng", {}), self.device)
        else:
            reseed_rank(self.job.trainer.seed, self.step, self.info.rank)
        self.resumed_from = found.path
        log.info("resumed from %s (step %d, saved at world size %s, now %d)",
                 found.path, self.step, saved_world, self.info.world_size)
        return True

    def _saved_run(self) -> SavedRun:
        """What the marker says of this run."""
        balance = SavedBalance(self.balancer.mode, self.balancer.history)
        return SavedRun(self.job.to_dict(), self.global_batch, self.samples, balance)

    def _checkpoint(self, stop: bool = False) -> None:
        """Report the step boundary to the checkpointer, which saves if its policy says so (collective)."""
        self.beat.phase = "checkpoint"
        taken = self.checkpoints.maybe_save(self.step, stop=stop)
        if taken is not None:
            self._record_save(taken.background, taken.blocking_s)

    def _record_save(self, background: bool, blocking_s: float) -> None:
        self._write_logged()  # the lines stay in step order
        record = self.telemetry.step(CheckpointRecord(self.step, round(blocking_s, 6), background))
        self.metrics.write(record)

    # ------------------------------------------------------------------ loop
    def _micro_steps(self) -> Iterator[tuple[int, contextlib.AbstractContextManager[Any]]]:
        accum = self.job.trainer.grad_accum
        for micro in range(accum):
            # Gradients are all-reduced on the last micro-step only; before it, no_sync
            # keeps them local so accumulation costs one all-reduce per optimizer step.
            last = micro == accum - 1
            sync = contextlib.nullcontext() if last else self.spread.no_sync()
            yield micro, sync

    def train_step(self, times: StepTimes) -> None:
        """One optimizer step over `grad_accum` micro-batches, this rank's rows of each by the split plan."""
        plan, rank = self.balancer.plan, self.info.rank
        micro_rows, count, offset = self.balancer.micro_batch, plan.counts[rank], plan.offset(rank)
        weight = plan.weight(rank, self.global_batch)
        start = time.perf_counter()
        beat, timed = self.beat, self.timed
        for micro, sync in self._micro_steps():
            beat.phase = "data"
            fetch = time.perf_counter()
            if timed:
                self.clock.start()
            if micro == 0 and self.telemetry.slow_s:
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
            if timed:
                self.clock.end()  # after the all-reduce hook already marked it, on a synced micro-batch: no-op
            times.add_loss(loss)  # read once per log line: no host sync, no op on every step
        beat.phase = "optimizer"
        if self.job.trainer.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.spread.trained_parameters(), self.job.trainer.grad_clip)
        self.optimizer.step()
        if not self.flat_schedule:  # a flat schedule's step would only count
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

    def _next_loss(self) -> torch.Tensor:
        """This rank's loss of the next step's first micro-batch, through DDP."""
        plan, rank = self.balancer.plan, self.info.rank
        first = plan.offset(rank)
        batch = self.task.train_batch(self.step, first, first + plan.counts[rank], self.device)
        with self.autocast():
            return self.task.loss(self.ddp, batch)

    def fit(self) -> dict[str, Any]:
        """Train to max_steps (resuming if possible); returns the result record (same on all ranks)."""
        cfg = self.job.trainer
        wall_start = time.perf_counter()
        resumed = self.restore()  # before the plan's start: it starts from the resumed step
        self._write(self.balancer.start(self.step, resumed))
        if resumed and self.spread.replicated and self.ddp is not self.model:  # the straight run's bucket layout
            settle_buckets(self.model, self._next_loss, self.device)
        start_step, start_samples = self.step, self.samples
        times, train_s, stopped = StepTimes(), 0.0, False
        evals: dict[str, float] = {}
        self._begin()
        replaying, window_start = self.balancer.mode == "replay", time.perf_counter()
        while self.step < cfg.max_steps:
            if replaying:
                self._write(self.balancer.replay_at(self.step))
            self.train_step(times)
            self._write_logged()
            if cfg.log_every and (self.step % cfg.log_every == 0 or self.step == cfg.max_steps):
                elapsed = self._device_done() - window_start
                train_s += elapsed
                self._log_window(times, elapsed)
                times.reset()
            evals = self._between_steps(times) or evals
            self._checkpoint()
            if times.steps == 0:
                window_start = time.perf_counter()
            if self._stop_agreed():
                stopped = True
                break
        if times.steps:
            train_s += self._device_done() - window_start
        self._write_logged()
        if not stopped:
            evals = self._evaluate(final=True)
        self._checkpoint(stop=stopped)  # a stop's save, synchronous; after the last step, none is due
        return self._result(stopped, start_step, start_samples, evals, train_s, time.perf_counter() - wall_start)

    def _device_done(self) -> float:
        """The host clock once this rank's device is done with what it was given: on CUDA the host runs ahead
        of the GPU, and a window timed without the wait would leave its queued work out (samples/s too high)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _begin(self) -> None:
        """The first training step of this attempt is next."""
        self.ddp.train()
        self.trained_from = time.time()
        self.beat.step = self.beat.start_step = self.step
        self.beat.trained_from = self.trained_from

    def _between_steps(self, times: StepTimes) -> dict[str, float]:
        """A dynamic plan's update and the periodic eval, at the steps they are due (not after the last);
        the eval's metrics, if it ran."""
        cfg, step = self.job.trainer, self.step
        if step >= cfg.max_steps:
            return {}
        if self.balancer.mode == "dynamic" and step % cfg.balance_every == 0:
            self._rebalance(times)
        return self._evaluate(final=False) if cfg.eval_every and step % cfg.eval_every == 0 else {}

    def _result(
        self, stopped: bool, start_step: int, start_samples: int, evals: dict[str, float], train_s: float, wall_s: float
    ) -> dict[str, Any]:
        """The attempt's result record (the same on every rank)."""
        return {
            "status": "preempted" if stopped else "completed",
            "start_step": start_step,
            "saved": self.saved,
            "steps": self.step,
            "world_size": self.info.world_size,
            "samples": self.samples,
            **evals,
            "samples_per_s": round((self.samples - start_samples) / train_s, 2) if train_s > 0 else None,
            "wall_s": round(wall_s, 3),
            "param_digest": self.spread.digest(),
            "rank_peak_rss_mb": collectives.all_gather_objects(peak_rss_mb()),
            "resumed_from": self.resumed_from,
            "resume_skipped": self.resume_skipped,
        }

    # ------------------------------------------------------------------ helpers
    def _stop_agreed(self) -> bool:
        """Whether the ranks agreed to stop after this step. Every `stop_check_every` steps the ranks
        start a vote on the stop flag that they read one step later, when it has long finished: no step
        waits for the slowest rank to reach the vote. All ranks start and read at the same steps, so all
        stop after the same step; not after the last one, where the run completes (a stop there would
        only requeue a finished run)."""
        cfg, preemption = self.job.trainer, self.preemption
        if preemption.voting:
            self.beat.phase = "collective"
            if preemption.vote() and self.step < cfg.max_steps:
                return True
        if self.step < cfg.max_steps and self.step % cfg.stop_check_every == 0:
            preemption.start_vote()
        return False

    def _write(self, record: Optional[PlanRecord]) -> None:
        """A plan record (or None: nothing changed) to the metrics, on rank 0."""
        if record is not None:
            self._write_logged()
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
        """Start gathering every rank's timing (one small all-gather per log line), not waiting for it:
        the record is written at the next step boundary (`_write_logged`)."""
        self._take_compute(times)
        # The straggler check's signal: the compute clock's where it runs, as it holds the rank's backward
        # too (where a slower GPU, or the emulation, spends its extra time) and, on a GPU, none of the wait
        # for the others that the host clock there holds
        local_s = times.compute_s if self.timed else times.local_s
        head = TrainRecord(
            step=self.step, loss=0.0, lr=float(self.scheduler.get_last_lr()[0]),
            samples_per_s=round(self.global_batch * times.steps / elapsed, 2),
            counts=list(self.balancer.plan.counts), balance=self.balancer.mode,
            time=time.time(),  # the log step's: what reads the lines times the steps by it (`gpujobs cost`)
        )
        self.gathering = GatheringTrainRecord(head, times, local_s, times.compute_s if self.timed else None)

    def _write_logged(self) -> None:
        """Write the train record of the last log step once gathered (waits for the gather, if one is
        under way: at the step after the log step it has finished); before any later line, so the lines
        stay in step order."""
        gathering, self.gathering = self.gathering, None
        if gathering is None:
            return
        self.beat.phase = "collective"
        record = self.telemetry.step(gathering.record())
        self.metrics.write(record)
        self.on_step(gathering.head.step, record)

    def _evaluate(self, final: bool) -> dict[str, float]:
        """Every rank evaluates its share of the eval rows (all of them at the end, at most
        `trainer.eval_max_rows` in between) with the unwrapped model; the task combines the shares, so all
        ranks hold the same metrics. Rank 0 writes the record."""
        self.beat.phase = "eval"  # a rank that waits in the eval's all-reduce is in the eval too
        max_rows = None if final else self.job.trainer.eval_max_rows
        metrics = self.task.evaluate(self.model, self.device, max_rows)
        results = {k: round(float(v), 6) for k, v in metrics.items()}
        self._write_logged()
        if self.info.is_main:
            record = self.telemetry.step(EvalRecord(self.step, results))
            self.metrics.write(record)
            self.on_step(self.step, record)
        return results

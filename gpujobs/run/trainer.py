"""The DDP training loop. It reports its step; checkpoint, metrics and progress policy live elsewhere."""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gpujobs.config import JobConfig
from gpujobs.run import collectives
from gpujobs.run.checkpoint import CheckpointManager
from gpujobs.run.jobenv import DistInfo
from gpujobs.run.metrics import MetricsLog, param_digest
from gpujobs.run.optim import build_optimizer, build_scheduler
from gpujobs.run.preemption import PreemptionWatcher
from gpujobs.run.task import Task
from gpujobs.run.telemetry import Telemetry
from gpujobs.rundir.resume import check_same_run

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices) from one number."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """This rank's random streams, in a form `torch.load(weights_only=True)` accepts."""
    _, numpy_keys, numpy_pos, *_ = cast(tuple[Any, ...], np.random.get_state(legacy=True))
    state: dict[str, Any] = {
        "python": list(random.getstate()),
        "numpy": torch.from_numpy(numpy_keys.astype(np.int64)),
        "numpy_pos": int(numpy_pos),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    if not state:
        return
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class StepTimes:
    """Per-rank timing of the steps since the last log line."""

    steps: int = 0
    step_s: float = 0.0
    data_s: float = 0.0
    local_s: float = 0.0
    """Data wait + forward: the part of the step before the gradient all-reduce makes ranks wait."""
    loss_sum: float | torch.Tensor = 0.0

    def reset(self) -> None:
        """Start a new window."""
        self.steps, self.step_s, self.data_s, self.local_s, self.loss_sum = 0, 0.0, 0.0, 0.0, 0.0


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
        on_step: Optional[Callable[[int, dict[str, Any]], None]] = None,
        telemetry: Optional[Telemetry] = None,
        preemption: Optional[PreemptionWatcher] = None,
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
        cfg = job.trainer
        self.model = task.model.to(device)
        self.ddp: torch.nn.Module = self.model
        if dist.is_initialized():
            ids = [device.index] if device.type == "cuda" else None
            self.ddp = DistributedDataParallel(self.model, device_ids=ids)
        self.optimizer = build_optimizer(list(self.model.parameters()), job.optim)
        self.scheduler = build_scheduler(self.optimizer, job.optim, cfg.max_steps)
        use_bf16 = cfg.amp == "bf16" or (cfg.amp == "auto" and device.type == "cuda")
        self.autocast = (
            (lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16))
            if use_bf16
            else contextlib.nullcontext
        )
        self.step = 0
        self.saved_step = -1  # same on every rank, so the decision to save is collective
        self.saved: Optional[str] = None
        self.resumed_from: Optional[str] = None
        self.resume_skipped: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What every rank shares: written once, by rank 0."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "config": self.job.to_dict(),
        }

    def restore(self) -> None:
        """Continue from the newest checkpoint that verifies on every rank, if resume is on (collective).

        Newer steps that did not verify are logged and kept in `resume_skipped` for the attempt's line;
        a checkpoint of another run (what a step computes differs) is refused.
        """
        if not self.job.checkpoint.resume:
            return
        found, self.resume_skipped = self.checkpoints.load_latest(map_location=self.device)
        if found is None:
            return
        check_same_run(found.meta, self.job, found.path)
        self.model.load_state_dict(found.shared["model"])
        self.optimizer.load_state_dict(found.shared["optimizer"])
        self.scheduler.load_state_dict(found.shared["scheduler"])
        self.step = self.saved_step = int(found.shared["step"])
        set_rng_state(found.own.get("rng", {}))
        self.resumed_from = self.saved = found.path
        log.info("resumed from %s (step %d)", found.path, self.step)

    def save(self) -> None:
        """Collective: every rank writes its part, rank 0 publishes once all are durable.

        Raises CheckpointNotSaved on every rank when any rank failed: nothing was published.
        """
        meta = {"config": self.job.to_dict(), "world_size": self.info.world_size}
        self.saved = str(self.checkpoints.save(self.step, self.state_dict, {"rng": rng_state()}, meta))
        self.saved_step = self.step

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
        """One optimizer step over `grad_accum` micro-batches."""
        accum = self.job.trainer.grad_accum
        start = time.perf_counter()
        for micro, sync in self._micro_steps():
            fetch = time.perf_counter()
            if micro == 0:
                self.telemetry.before_step()
            batch = self.task.train_batch(self.step, micro, self.device)
            times.data_s += time.perf_counter() - fetch
            with sync:
                with self.autocast():
                    loss = self.task.loss(self.ddp, batch)
                    if accum > 1:
                        loss = loss / accum
                times.local_s += time.perf_counter() - fetch
                loss.backward()
            # summed on the device, read once per log line: no host sync on every step
            times.loss_sum = times.loss_sum + loss.detach()
        if self.job.trainer.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.job.trainer.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        times.steps += 1
        times.step_s += time.perf_counter() - start

    def fit(self) -> dict[str, Any]:
        """Train to max_steps (resuming if possible); returns the result record (same on all ranks)."""
        cfg = self.job.trainer
        wall_start = time.perf_counter()
        self.restore()
        times = StepTimes()
        window_start = time.perf_counter()
        train_s, trained_samples = 0.0, 0
        samples_per_step = self.task.samples_per_micro_batch * cfg.grad_accum * self.info.world_size
        evals: dict[str, float] = {}
        start_step, stopped = self.step, False
        self.ddp.train()
        while self.step < cfg.max_steps:
            self.train_step(times)
            trained_samples += samples_per_step
            if cfg.log_every and (self.step % cfg.log_every == 0 or self.step == cfg.max_steps):
                elapsed = time.perf_counter() - window_start
                train_s += elapsed
                self._log_window(times, elapsed, samples_per_step)
                times.reset()
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.max_steps:
                evals = self._evaluate()
            if self.checkpoints.should_save(self.step, cfg.max_steps):
                self.save()
            if times.steps == 0:
                window_start = time.perf_counter()
            # All ranks check at the same steps and agree, so all stop after this same step.
            if self.step % cfg.stop_check_every == 0 and self.preemption.should_stop():
                stopped = True
                break
        if times.steps:
            train_s += time.perf_counter() - window_start
        if not stopped:
            evals = self._evaluate()
        if self.saved_step != self.step:
            self.save()
        return {
            "status": "preempted" if stopped else "completed",
            "start_step": start_step,
            "saved": self.saved,
            "steps": self.step,
            "world_size": self.info.world_size,
            **evals,
            "samples_per_s": round(trained_samples / train_s, 2) if train_s > 0 else None,
            "wall_s": round(time.perf_counter() - wall_start, 3),
            "param_digest": param_digest(self.model),
            "resumed_from": self.resumed_from,
            "resume_skipped": self.resume_skipped,
        }

    # ------------------------------------------------------------------ helpers
    def _barrier(self) -> None:
        collectives.barrier()

    def _log_window(self, times: StepTimes, elapsed: float, samples_per_step: int) -> None:
        """Gather every rank's timing (one small all-gather per log line) and write the record."""
        mine = torch.tensor([times.step_s, times.data_s, float(times.loss_sum), times.local_s]) / times.steps
        table = collectives.all_gather_rows(mine)  # world size x 4, on the CPU whatever the backend
        record = {
            "kind": "train",
            "step": self.step,
            "loss": round(float(table[:, 2].mean()), 6),
            "lr": self.scheduler.get_last_lr()[0],
            "samples_per_s": round(samples_per_step * times.steps / elapsed, 2),
            "step_time_s": [round(float(x), 6) for x in table[:, 0]],
            "data_time_s": [round(float(x), 6) for x in table[:, 1]],
            "local_time_s": [round(float(x), 6) for x in table[:, 3]],
        }
        self.telemetry.step(record)
        self.metrics.write(record)
        self.on_step(self.step, record)

    def _evaluate(self) -> dict[str, float]:
        """Rank 0 evaluates the unwrapped model; the others wait at a barrier."""
        results: dict[str, float] = {}
        if self.info.is_main:
            results = {k: round(float(v), 6) for k, v in self.task.evaluate(self.model, self.device).items()}
            record = {"kind": "eval", "step": self.step, **results}
            self.telemetry.step(record)
            self.metrics.write(record)
            self.on_step(self.step, record)
        self._barrier()
        return results

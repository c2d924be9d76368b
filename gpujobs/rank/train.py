"""The job side's front door: the callable that every rank runs (submitit pickles it).

This module imports torch only inside `__call__`, so the submit side can build and pickle a
`TrainJob` without paying for torch.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from gpujobs.backends import backend_for
from gpujobs.config.load import JobConfig
from gpujobs.rundir import CHECKPOINT_DIR, METRICS_FILE
from gpujobs.rundir.records import write_result_or_say

log = logging.getLogger("gpujobs")



def load_task_builder(path: str) -> Any:
    """Import `module:function` (the job's task builder)."""
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


@dataclass
class TrainJob:
    """Run the DDP trainer of `job` as one rank; returns the result record."""

    job: JobConfig
    run_dir: str
    master_port: Optional[int] = None
    """Rendezvous port chosen by the launcher (local runs); Slurm jobs derive theirs from the job id."""
    show_progress: bool = False
    """Draw progress in this process (the in-process debug executor)."""

    def __call__(self) -> dict[str, Any]:
        from gpujobs.rank.stop import PreemptionWatcher

        watcher = PreemptionWatcher().install()  # first, before torch loads: a USR2 from now on is ours
        started = time.time()
        from gpujobs.backends import jobenv

        logging.basicConfig(level=logging.INFO, format="[%(asctime)s][rank %(rank)s] %(message)s")
        info = jobenv.detect(self.master_port)
        _tag_log_records(info.rank)
        attempt = _Attempt(self.job, self.run_dir, info, started, watcher=watcher)
        attempt.lines_before = _lines(self.run_dir) if info.is_main else 0
        if info.is_main:
            from gpujobs.attempt import orphan

            orphan.record_if_orphaned(self.run_dir, self.job, started, attempt.progress)
        with contextlib.ExitStack() as cleanup:
            cleanup.callback(watcher.uninstall)
            attempt.beat = self._heartbeat(info)
            cleanup.callback(attempt.beat.close)
            try:
                return self._run(info, watcher, attempt, cleanup)
            except Exception as err:  # everything from the process group on is inside the recorded attempt
                attempt.failed(err)
                raise

    def _heartbeat(self, info: Any) -> Any:
        """This rank's heartbeat for the supervisor's hang watchdog (none in-process or with the watchdog off)."""
        from gpujobs.rundir.heartbeat import Heartbeat, NoBeat, interval_for

        hang_timeout_s = self.job.trainer.hang_timeout_s
        if not hang_timeout_s or backend_for(self.job).in_process:
            return NoBeat()
        return Heartbeat(Path(self.run_dir), info.rank, info.node, interval_for(hang_timeout_s)).start()

    def _run(self, info: Any, watcher: Any, attempt: _Attempt, cleanup: contextlib.ExitStack) -> dict[str, Any]:
        from gpujobs.rank.trainer import Trainer

        job, run_dir = self.job, Path(self.run_dir)
        device = self._join(info, watcher, attempt, cleanup)
        metrics, observers = self._observe(info, device, attempt, cleanup)
        checkpoints = self._checkpoints(info, attempt, cleanup)
        attempt.trainer = Trainer(job, info, device, attempt.task, checkpoints, metrics, **observers)
        result = attempt.trainer.fit()
        attempt.beat.phase = "done"  # what follows (a Prometheus linger, the teardown) is no hang
        peaks = result.pop("rank_peak_rss_mb", [])  # every rank's, in rank order, as the places are
        result["ranks"] = [{**place, "peak_rss_mb": peaks[rank] if rank < len(peaks) else None}
                           for rank, place in enumerate(attempt.ranks)]
        self._record(info, watcher, attempt, result, run_dir)
        return result

    def _join(self, info: Any, watcher: Any, attempt: _Attempt, cleanup: contextlib.ExitStack) -> Any:
        """Set torch up for the job, join the process group (left at `cleanup`); this rank's device."""
        import torch

        from gpujobs.rank import distributed

        job, run_dir = self.job, Path(self.run_dir)
        torch.set_num_threads(job.resources.cpus)
        if job.trainer.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        # the flight recorder (its pipe in the heartbeat's node-local dir) and NCCL's monitor
        os.environ.update(distributed.torch_nccl_env(job, run_dir, attempt.beat.pipe_dir))
        backend = distributed.init_process_group(info, job.nccl, job.trainer.pg_timeout_s, run_dir,
                                                 always=job.parallel.name == "torchrec")
        cleanup.callback(distributed.destroy_process_group)
        cleanup.callback(attempt.drop)  # first: no DDP wrapper may outlive the process group
        device = distributed.device_for(info)
        group = f"backend {backend}" if backend else "one rank, no process group"
        log.info("rank %d/%d on %s (%s, %s)", info.rank, info.world_size, info.node, device, group)
        if watcher.flagged:
            log.warning("USR2 came while this rank was starting: it stops at the first agreed step boundary")
        log.info("NCCL environment: %s", {key: os.environ[key] for key in sorted(job.nccl.to_env(run_dir))})
        if job.resources.gpus_per_node and device.type == "cpu":
            log.warning("GPUs were requested but CUDA is not available here: training on the CPU with gloo")
        attempt.ranks = distributed.gather_ranks(info, device)
        return device

    def _observe(
        self, info: Any, device: Any, attempt: _Attempt, cleanup: contextlib.ExitStack
    ) -> tuple[Any, dict[str, Any]]:
        """The metrics log, the health gate, and the trainer's observers (progress, trackers, telemetry,
        the preemption flag, the heartbeat), each closed at `cleanup`."""
        from gpujobs.rank.metrics import MetricsLog
        from gpujobs.rank.observe.telemetry import Telemetry
        from gpujobs.rank.observe.trackers import open_trackers
        from gpujobs.rundir.progress import ProgressView

        job, run_dir = self.job, Path(self.run_dir)
        metrics = MetricsLog(run_dir / METRICS_FILE if info.is_main else None)
        cleanup.callback(metrics.close)
        if job.cluster.health_check:  # before telemetry's NVML, the task and any restore: a sick node costs seconds
            from gpujobs.rank import health

            # an unhealthy node: rank 0 records the attempt, every rank exits as a preempted one does
            attempt.health_s = health.gate(job, self.run_dir, info, device, attempt.ranks, metrics, attempt.started)
        view = ProgressView(job.trainer.max_steps, job.name, enabled=self.show_progress and info.is_main)
        cleanup.callback(view.close)
        # rank 0's TensorBoard/MLflow (`logger`): a queue put per record; ended as the attempt ends
        trackers = cleanup.enter_context(open_trackers(job, run_dir, info.is_main))
        telemetry = Telemetry.start(job, info, attempt.ranks, device.type == "cuda", run_dir)
        cleanup.callback(telemetry.close)
        return metrics, {"on_step": trackers.on_step(view.update), "telemetry": telemetry,
                         "preemption": attempt.watcher, "heartbeat": attempt.beat}

    def _checkpoints(self, info: Any, attempt: _Attempt, cleanup: contextlib.ExitStack) -> Any:
        """Seed, build the task, and make the run's checkpointer (its save in flight ended at `cleanup`)."""
        from gpujobs.rank.checkpoint import CheckpointManager
        from gpujobs.rank.rng import seed_everything

        job = self.job
        seed_everything(job.trainer.seed)
        build = load_task_builder(job.task)
        # the configured world size sizes a per-rank batch's global batch; the real one may differ (elastic)
        sharded = {"parallel": "torchrec"} if job.parallel.name == "torchrec" else {}  # its tables on the meta device
        attempt.task = build(job.model, job.data, job.resources.world_size, job.trainer.grad_accum, **sharded)
        ckpt = job.checkpoint
        checkpoints = CheckpointManager(
            Path(self.run_dir) / CHECKPOINT_DIR, ckpt.every_steps, ckpt.keep, info.rank,
            world_size=info.world_size, background=ckpt.background,
        )
        cleanup.callback(checkpoints.close)
        return checkpoints

    def _record(self, info: Any, watcher: Any, attempt: _Attempt, result: dict[str, Any], run_dir: Path) -> None:
        """Rank 0 records the attempt (and the result, once completed); a stopped rank exits to be requeued."""
        from gpujobs.attempt.preemption import EXIT_REQUEUED, classify_stop, record_attempt

        job, health_s = self.job, attempt.health_s
        line = {
            "start": round(attempt.started, 3), "start_step": result["start_step"], "steps_done": result["steps"],
            "resumed_from": result["resumed_from"], "saved": result["saved"],
            "resume_skipped": result["resume_skipped"], "world_size": info.world_size,
            "trained_from": attempt.trainer.trained_from, "health_s": None if health_s is None else round(health_s, 3),
        }
        if result["status"] == "preempted":
            reason = classify_stop(job, attempt.started, watcher.flagged_at)
            if info.is_main:
                record_attempt(self.run_dir, job, reason, **line)
            log.warning("stopped at step %d (%s): checkpoint saved, exiting", result["steps"], reason)
            raise SystemExit(EXIT_REQUEUED)  # like submitit: no result pickle, the job is not over
        if info.is_main:
            record_attempt(self.run_dir, job, "completed", **line)
            write_result_or_say(run_dir, result)


@dataclass
class _Attempt:
    """What this rank knows of its attempt: rank 0 writes the attempt's line when it fails."""

    job: JobConfig
    run_dir: str
    info: Any
    """This rank's place (`jobenv.DistInfo`)."""
    started: float
    trainer: Any = None
    task: Any = None
    beat: Any = None
    """This rank's heartbeat (`gpujobs.rundir.heartbeat`)."""
    lines_before: int = 0
    """Rank 0: the ledger's lines when the attempt began (one more once it is recorded)."""
    watcher: Any = None
    """The preemption flag (`gpujobs.attempt.preemption.PreemptionWatcher`)."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """Every rank's place and device (`distributed.gather_ranks`)."""
    health_s: Optional[float] = None
    """Seconds the health check at start took (None: not run)."""

    def failed(self, err: Exception) -> None:
        """Every rank: leave this rank's error (`gpujobs.attempt.failures`). Rank 0: record the failed attempt
        with the error that came first, its rank and node (and requeue, if its budget allows), unless
        its line is written already (result.json that cannot be written after the `completed` line, a
        requeue that failed after the line): one line per attempt."""
        from gpujobs.attempt import failures, orphan

        message = str(err).strip().splitlines()
        error = f"{type(err).__name__}: {message[0] if message else ''}"
        info = self.info
        launcher = orphan.gone_launcher()
        if launcher is not None:  # it failed of its launcher's going (a peer ended with it): interrupted
            log.error("failed as the local launcher is gone: %s", error)
            orphan.say_last_words(launcher)
            return
        blamed = failures.fail(Path(self.run_dir), info.rank, info.node, info.world_size, error, raised=err)
        if blamed is None:  # not rank 0
            return
        if _lines(self.run_dir) > self.lines_before:
            log.error("the attempt is recorded already; not recording it again as failed: %s", error)
            return
        from gpujobs.attempt.preemption import record_attempt

        try:
            record_attempt(self.run_dir, self.job, "failed", start=round(self.started, 3), **blamed, **self.progress())
        except Exception as record_err:  # never hide the real failure behind this one
            log.error("could not record the failed attempt: %s", record_err)

    def progress(self) -> dict[str, Any]:
        """How far the attempt got, for its line (nothing before the trainer exists)."""
        trainer = self.trainer
        return {} if trainer is None else {
            "steps_done": trainer.step, "resumed_from": trainer.resumed_from, "resume_skipped": trainer.resume_skipped,
            "world_size": trainer.info.world_size, "trained_from": trainer.trained_from, "saved": trainer.saved,
            # the step it trained from, once it did (a failure while resuming has none)
            "start_step": trainer.beat.start_step if trainer.trained_from is not None else None,
        }

    def drop(self) -> None:
        """Let go of the trainer and the task (and with them the DDP wrapper)."""
        self.trainer = self.task = None


def _lines(run_dir: str) -> int:
    """How many attempts the run dir's ledger holds."""
    from gpujobs.rundir.attempts import AttemptLog

    return len(AttemptLog(Path(run_dir)).read())


def _tag_log_records(rank: int) -> None:
    """Put the rank into every log record, so per-rank logs read well when merged."""
    factory = logging.getLogRecordFactory()

    def make(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        record.rank = rank
        return record

    logging.setLogRecordFactory(make)

"""`cluster=local`: the same job as processes on this machine, through submitit's local executor.

One process per GPU with NCCL where there are GPUs, else `procs_per_node` CPU processes with gloo.
The launcher stays in the foreground, shows rank 0's progress, and restarts the job from its last
checkpoint after a failure, up to `cluster.max_restarts` times.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any, Optional

from gpujobs.config import JobConfig
from gpujobs.errors import ConfigError
from gpujobs.launch.follow import JobFollower
from gpujobs.run import failures
from gpujobs.run.evidence import descendants, kill_tree, process_start
from gpujobs.run.hangs import HangReport, Watchdog
from gpujobs.run.payload import FromRunDir
from gpujobs.run.script import record_completed
from gpujobs.rundir.attempts import AttemptLog, Decision
from gpujobs.rundir.records import read_result


def check_local_resources(job: JobConfig, gpus_here: int) -> None:
    """Refuse what this machine cannot give, before anything starts."""
    res = job.resources
    if res.nodes != 1:
        raise ConfigError("resources.nodes", res.nodes, "1 with cluster=local (use cluster=slurm for more nodes)")
    if res.gpus_per_node > gpus_here:
        listed = os.environ.get("CUDA_VISIBLE_DEVICES")
        if listed is not None:
            hint = f"0..{gpus_here} (the GPUs CUDA_VISIBLE_DEVICES={listed!r} names here)"
        elif gpus_here == 0:
            hint = ("0: this machine has no NVIDIA GPU "
                    "(use resources.gpus_per_node=0 with resources.procs_per_node=N for CPU ranks)")
        else:
            hint = f"0..{gpus_here} (GPUs on this machine)"
        raise ConfigError("resources.gpus_per_node", res.gpus_per_node, hint)


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_local(job: JobConfig, run_dir: Path) -> int:
    """Run the job here (resources already checked by `check_local_resources`); 0 when it completed."""
    import submitit  # lazily: keeps `--help` and validation fast

    from gpujobs.launch.gpus import choose_local_gpus

    res = job.resources
    gpus = choose_local_gpus(res)
    executor = submitit.LocalExecutor(folder=run_dir / job.cluster.folder)
    executor.update_parameters(
        nodes=1,
        tasks_per_node=res.ranks_per_node,
        gpus_per_node=res.gpus_per_node,
        timeout_min=job.cluster.timeout_min,
        signal_delay_s=job.cluster.signal_lead_s,
    )
    # By uuid, which names the same GPU (or MIG slice) in every process whatever CUDA's order; submitit's
    # check takes indices only, but its local executor writes the entries into the ranks' CUDA_VISIBLE_DEVICES.
    executor.parameters["visible_gpus"] = tuple(gpu.uuid for gpu in gpus)
    backend = "nccl" if res.gpus_per_node else "gloo"
    attempts = AttemptLog(run_dir)
    launcher = (os.getpid(), process_start(os.getpid()))
    with JobFollower(run_dir, job) as follower, interrupts_as_keyboard():
        while True:
            before = len(attempts.read())
            started = time.time()
            try:
                sjob = executor.submit(FromRunDir(str(run_dir), master_port=free_port(), launcher=launcher))
            except KeyboardInterrupt:
                print("gpujobs: interrupted before the local job started", flush=True)
                return 130
            # submitit waits up to 15 s per rank for a result file that a slow shared filesystem may
            # not show yet; here the disk is local, and a rank that stopped to be requeued leaves none.
            for task in sjob._sub_jobs or [sjob]:
                task._results_timeout_s = 0
            print(
                f"gpujobs: local job {sjob.job_id} (attempt {before + 1}): {res.ranks_per_node} ranks, "
                f"{backend}{f' on GPUs {[g.index for g in gpus]}' if gpus else ''}, run dir {run_dir}",
                flush=True,
            )
            watchdog = Watchdog.for_job(run_dir, job, res.ranks_per_node, f"local:{sjob.job_id}", before + 1,
                                        kill=functools.partial(_kill_local_job, sjob))
            try:
                error = follower.follow(sjob, tick=watchdog.tick if watchdog else None)
            except KeyboardInterrupt as stop:
                return _record_interrupt(job, attempts, before, sjob, started, stop)
            finally:  # the ranks are gone: a target rank 0 could not withdraw (killed) goes with them
                from gpujobs.run.prometheus import withdraw_left_target

                withdraw_left_target(run_dir)
            if error is None:
                if job.script is not None and len(attempts.read()) == before:  # its ranks left the line to us
                    record_completed(run_dir, job, res.ranks_per_node, started, time.time() - started,
                                     recorded_by="launcher")
                follower.print_result()
                return 0
            if watchdog is not None and watchdog.report is not None:
                reason, decision, error = _record_hang(job, attempts, before, watchdog.report)
                if reason == "completed" and read_result(run_dir) is not None:  # only its end hung: the run is done
                    follower.print_result()
                    return 0
            else:
                reason, decision, error = _judge_attempt(job, attempts, before, error, f"local:{sjob.job_id}", started)
            if not decision.requeue:
                print(f"gpujobs: job ended: {reason}, {decision.why}; last error: {error}")
                print(f"gpujobs: per-rank logs in {executor.folder}")
                return 1
            print(f"gpujobs: attempt {before + 1} {reason} ({decision.why}); restarting from the last checkpoint")


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP to the launcher: handled as Ctrl-C is (the local job goes with its launcher)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def interrupts_as_keyboard() -> Iterator[None]:
    """While the launcher follows a local job, SIGTERM and SIGHUP (a `kill`, a closed terminal) stop it as
    Ctrl-C does: the job is killed and its attempt recorded, never left running without its launcher."""

    def stop(signum: int, frame: Optional[FrameType]) -> None:
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _record_interrupt(job: JobConfig, attempts: AttemptLog, before: int, sjob: Any, started: float,
                      stop: KeyboardInterrupt) -> int:
    """The launcher was interrupted: kill the local job, record its attempt as `cancelled` (unless its
    rank 0 recorded it just before), and say how to go on; returns the exit code (128 + the signal)."""
    signum = stop.signum if isinstance(stop, Interrupted) else signal.SIGINT
    _kill_local_job(sjob)
    name = signal.Signals(signum).name
    if len(attempts.read()) == before:
        attempts.record(job.cluster, "cancelled", recorded_by="launcher", start=round(started, 3),
                        world_size=job.resources.ranks_per_node, error=f"the launcher got {name}",
                        **job.resources.held_per_rank)
    print(f"\ngpujobs: interrupted ({name}): local job {sjob.job_id} killed; its checkpoints stay in "
          f"{attempts.run_dir}, "
          "and the same command resumes from the last one", flush=True)
    return 128 + signum


def _kill_local_job(sjob: Any) -> None:
    """SIGKILL every process of the local job (its controller, the ranks and anything they started)."""
    controller = int(sjob.job_id)
    left = kill_tree([*descendants(controller), controller])
    if left:
        print(f"gpujobs: processes {left} of local job {sjob.job_id} outlived SIGKILL", flush=True)


def _record_hang(job: JobConfig, attempts: AttemptLog, before: int, report: HangReport) -> tuple[str, Decision, str]:
    """The watchdog killed the attempt: the launcher records it as `hung` (nobody else could)."""
    fields = report.attempt_fields()
    if len(attempts.read()) > before:  # rank 0 recorded the attempt before the rest was killed: keep its line
        last = attempts.read()[-1]
        print(f"gpujobs: {fields['error']}; killed after rank 0 recorded the attempt ({last.reason}); stacks in "
              f"{report.evidence_dir}", flush=True)
        return last.reason, Decision(last.requeue, last.why), last.error or fields["error"]
    recorded = attempts.record(job.cluster, "hung", recorded_by="launcher", world_size=job.resources.ranks_per_node,
                               **job.resources.held_per_rank, **fields)
    print(f"gpujobs: {fields['error']}; stacks in {report.evidence_dir}", flush=True)
    return "hung", Decision(recorded.requeue, recorded.why), fields["error"]


def _judge_attempt(job: JobConfig, attempts: AttemptLog, before: int, error: str,
                   attempt: str, started: float) -> tuple[str, Decision, str]:
    """Rank 0 records each attempt it survives; if it died first, or was done before another rank
    failed or was told to stop (a script's), the launcher records it: from what the ranks of `attempt`
    left (`gpujobs.run.failures`), else as failed with submitit's error.

    Returns the attempt's reason, the decision, and its error: rank 0's own words where it recorded
    them (submitit's last line may only name a log file).
    """
    history = attempts.read()
    if len(history) > before:
        last = history[-1]
        return last.reason, Decision(last.requeue, last.why), last.error or error
    ranks = job.resources.ranks_per_node  # a local job's ranks: one node's
    reason, fields = failures.left_outcome(attempts.run_dir, ranks, attempt) or (
        "failed", {"error": failures.silent(attempts.run_dir, ranks, attempt, error) or error})
    recorded = attempts.record(job.cluster, reason, recorded_by="launcher", world_size=ranks,
                               start=round(started, 3), **job.resources.held_per_rank, **fields)
    return reason, Decision(recorded.requeue, recorded.why), fields.get("error", error)

"""`cluster=local`: the same job as processes on this machine, through submitit's local executor.

One process per GPU with NCCL where there are GPUs, else `procs_per_node` CPU processes with gloo.
The launcher stays in the foreground, shows rank 0's progress, and restarts the job from its last
checkpoint after a failure, up to `cluster.max_restarts` times.

A local job is known by its launcher's pid (`local job PID`, as its lease names it): the one process that
takes `kill -USR2 PID` as a preemption (`LauncherSignals`). Each attempt's submitit job (its controller's
pid, which names the ranks' log files) is named `submitit job N`: a USR2 to that controller would kill it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Optional

from gpujobs.attempt import failures
from gpujobs.attempt.evidence import kill_tree, local_job_processes
from gpujobs.attempt.file_sd import withdraw_left_target
from gpujobs.attempt.hangs import HangReport, HangWatchdog
from gpujobs.attempt.image import export_image_id
from gpujobs.attempt.judge import AttemptEnd, Verdict, judge, record_or_say, record_verdict
from gpujobs.attempt.program import FROM_RUN_DIR, RankProgram
from gpujobs.backends.follow import JobFollower
from gpujobs.backends.jobenv import free_port
from gpujobs.backends.local.container import RUNTIME_CLIENTS, rank_python, tasks_are_ranks
from gpujobs.base.process import process_start
from gpujobs.config.load import JobConfig
from gpujobs.config.nccl import GLOO_ON_CUDA_ENV
from gpujobs.rundir.attempts import AttemptLog
from gpujobs.rundir.records import read_result

if TYPE_CHECKING:
    from gpujobs.backends.local.gpus import GpuLoad


def run_local(job: JobConfig, run_dir: Path) -> int:
    """Run the job here (resources already checked by `LocalBackend.preflight`); 0 when it completed."""
    import submitit  # lazily: keeps `--help` and validation fast

    from gpujobs.backends.local.gpus import choose_local_gpus, local_gpu_count

    res = job.resources
    gpus = choose_local_gpus(res)
    if os.environ.get(GLOO_ON_CUDA_ENV) == "1":  # check-only: the ranks share the GPUs there are
        gpus = gpus[:local_gpu_count()]
    # each rank task runs `python` (the runtime's argv and the image's python3 where container= names one);
    # the controller, which follows them, stays this Python, outside
    executor = submitit.LocalExecutor(folder=run_dir / job.cluster.folder, python=rank_python(job, run_dir, Path.cwd()))
    # The controller sends its tasks USR2 at the time limit less the lead. A podman task is podman's client,
    # which passes no signal on (and might die of it): there the controller sends nothing early (its loop
    # never reaches a delay of 0) and the launcher asks the stop itself, as a USR2 to it would (`stop_at`).
    lead = job.cluster.signal_lead_s
    controller_signals = tasks_are_ranks(job.container)
    executor.update_parameters(
        nodes=1,
        tasks_per_node=res.ranks_per_node,
        gpus_per_node=len(gpus),
        timeout_min=job.cluster.timeout_min,
        signal_delay_s=lead if controller_signals else 0,
    )
    # By uuid, which names the same GPU (or MIG slice) in every process whatever CUDA's order; submitit's
    # check takes indices only, but its local executor writes the entries into the ranks' CUDA_VISIBLE_DEVICES.
    executor.parameters["visible_gpus"] = tuple(gpu.uuid for gpu in gpus)
    attempts = AttemptLog(run_dir)
    launcher = (os.getpid(), process_start(os.getpid()))
    print(f"gpujobs: local job {os.getpid()}: `kill -USR2 {os.getpid()}` preempts it (an agreed checkpoint, "
          "then the next attempt), Ctrl-C stops it", flush=True)
    with JobFollower(run_dir, job) as follower, LauncherSignals() as signals:
        sjob: Any = None  # the attempt running now (None: none started yet)
        before, started = 0, 0.0
        try:
            while True:
                before, started, sjob = len(attempts.read()), time.time(), None
                signals.new_attempt(None if controller_signals else started + job.cluster.timeout_min * 60 - lead)
                try:
                    rank = {"run_dir": str(run_dir), "master_port": free_port(), "launcher": launcher}
                    export_image_id(job.container)  # the image this attempt runs in, for its ledger line
                    sjob = executor.submit(RankProgram(FROM_RUN_DIR, rank))
                except OSError as err:  # submitit writes the attempt's files into the run dir first (a full disk)
                    print(f"gpujobs: attempt {before + 1} could not be started in {executor.folder}: "
                          f"{err.strerror or err}", file=sys.stderr, flush=True)
                    return 1
                code = _follow_attempt(job, run_dir, executor, gpus, follower, signals, attempts, sjob, before, started)
                if code is not None:
                    return code
        except KeyboardInterrupt as stop:
            if sjob is None:
                print("gpujobs: interrupted before the local job started", flush=True)
                return 128 + (stop.signum if isinstance(stop, Interrupted) else signal.SIGINT)
            return _record_interrupt(job, attempts, before, sjob, started, stop)


def _follow_attempt(job: JobConfig, run_dir: Path, executor: Any, gpus: list[GpuLoad], follower: JobFollower,
                    signals: LauncherSignals, attempts: AttemptLog, sjob: Any, before: int,
                    started: float) -> Optional[int]:
    """Follow one attempt to its end and record it where its ranks did not; returns the launcher's exit
    code, or None when the job goes again."""
    from gpujobs.backends.submitit_private import skip_results_wait

    res = job.resources
    # submitit waits up to 15 s per rank for a result file that a slow shared filesystem may
    # not show yet; here the disk is local, and a rank that stopped to be requeued leaves none.
    skip_results_wait(sjob)
    print(
        f"gpujobs: local job {os.getpid()} (attempt {before + 1}, submitit job {sjob.job_id}): "
        f"{res.ranks_per_node} ranks, "
        f"{'nccl' if res.gpus_per_node else 'gloo'}{f' on GPUs {[g.index for g in gpus]}' if gpus else ''}, "
        f"run dir {run_dir}",
        flush=True,
    )
    watchdog = HangWatchdog.for_job(run_dir, job, res.ranks_per_node, f"local:{sjob.job_id}", before + 1,
                                    kill=functools.partial(_kill_local_job, sjob))

    def tick() -> None:
        signals.forward_stop(int(sjob.job_id), res.ranks_per_node)
        if watchdog is not None:
            watchdog.tick()

    try:
        error = follower.follow(sjob, tick=tick)
    finally:  # the ranks are gone: a target rank 0 could not withdraw (killed) goes with them
        _kill_left(sjob)
        withdraw_left_target(run_dir)
    hang = watchdog.report if watchdog is not None else None
    verdict = judge(_attempt_end(job, attempts, before, started, error, hang, f"local:{sjob.job_id}"))
    decision = record_verdict(attempts, job, verdict, recorded_by="launcher")
    if hang is not None:
        _say_hang(verdict, hang)
    # a hang of only its end (rank 0 recorded it completed, and its result) leaves the run done
    if error is None or (hang is not None and verdict.reason == "completed" and read_result(run_dir) is not None):
        follower.print_result()
        return 0
    if not decision.requeue:
        print(f"gpujobs: job ended: {verdict.reason}, {decision.why}; last error: {verdict.error}")
        print(f"gpujobs: per-rank logs in {executor.folder}")
        return 1
    print(f"gpujobs: attempt {before + 1} {verdict.reason} ({decision.why}); restarting from the last checkpoint")
    return None


def _attempt_end(job: JobConfig, attempts: AttemptLog, before: int, started: float, error: Optional[str],
                 hang: Optional[HangReport], attempt: str) -> AttemptEnd:
    """What the launcher knows of local attempt `attempt` once its ranks are gone (submitit's `error`:
    None when every rank exited 0); for the judge."""
    ranks = job.resources.ranks_per_node  # a local job's ranks: one node's
    history = attempts.read()
    failed = error is not None
    return AttemptEnd(
        ranks=ranks, started=started, exited_ok=not failed, recorded=history[-1] if len(history) > before else None,
        hang=hang, left=failures.left_outcome(attempts.run_dir, ranks, attempt) if failed else None,
        # submitit's last line may only name a log file: say which ranks left no word of their end
        error=(failures.silent(attempts.run_dir, ranks, attempt, error) or error) if error is not None else "",
        script=job.script is not None,
    )


def _say_hang(verdict: Verdict, hang: HangReport) -> None:
    """The watchdog killed the attempt: say so, and where its evidence is."""
    error = hang.attempt_fields()["error"]
    if verdict.recorded is not None:  # rank 0 recorded the attempt before the rest was killed: its line stands
        print(f"gpujobs: {error}; killed after rank 0 recorded the attempt ({verdict.reason}); stacks in "
              f"{hang.evidence_dir}", flush=True)
    else:
        print(f"gpujobs: {error}; stacks in {hang.evidence_dir}", flush=True)


class Interrupted(KeyboardInterrupt):
    """SIGTERM, SIGHUP or SIGINT to the launcher: the local job goes with its launcher."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


#: What stops the launcher (a `kill`, a closed terminal, Ctrl-C), and what asks the job to stop and go again.
_STOPS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_STOP_AND_REQUEUE = signal.SIGUSR2


class LauncherSignals:
    """The launcher's signals while it follows a local job.

    SIGTERM, SIGHUP and SIGINT stop it: the first raises `Interrupted` (once: the job is killed and its
    attempt recorded, then the launcher exits 128 + that signal); any that follow are ignored, so a
    second `kill` cannot tear the handling of the first. USR2 means what it means on Slurm: the ranks
    get it (`forward_stop`, from the follower's poll), save an agreed checkpoint and record the attempt
    `preempted`, and the launcher starts the next one within `cluster.max_preemptions`. An attempt's
    `stop_at` asks the same stop at that time, which its ranks record as `timeout` near the time limit.
    """

    def __init__(self) -> None:
        self.stopping: Optional[int] = None
        self.stop_asked = False
        self._stop_at: Optional[float] = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> LauncherSignals:
        for signum in (*_STOPS, _STOP_AND_REQUEUE):
            if signal.getsignal(signum) is signal.SIG_IGN:
                continue  # ignored where we were started (`nohup`, a background job): it stays so
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            # once stopping, the launcher only exits: a late signal must not cut its last words short
            stay = self.stopping is not None and signum in _STOPS
            signal.signal(signum, signal.SIG_IGN if stay else handler)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if signum == _STOP_AND_REQUEUE:
            self.stop_asked = True  # only a flag: the follower's next poll passes it on
            return
        if self.stopping is None:
            self.stopping = signum
            raise Interrupted(signum)

    def new_attempt(self, stop_at: Optional[float]) -> None:
        """An attempt starts: a USR2 between attempts asked nothing of it; from `stop_at` (a time.time(), or
        None: never) its ranks are asked to stop, as by a USR2 to the launcher."""
        self.stop_asked, self._stop_at = False, stop_at

    def forward_stop(self, controller: int, ranks: int) -> None:
        """Pass an asked-for stop to the processes of local job `controller` that handle USR2, as Slurm
        signals every process of a step: its `ranks` (one still starting would die of USR2: it gets it at
        a later poll) and a script that installed a handler of its own. The flag drops once all ranks have it."""
        if self._stop_at is not None and time.time() >= self._stop_at:
            self.stop_asked, self._stop_at = True, None  # asked once, like the controller's USR2
        if not self.stop_asked:
            return
        job = local_job_processes(controller)
        ready = {pid: parent for pid in job
                 if not _runtime_client(pid) and (parent := parent_if_catching(pid, _STOP_AND_REQUEUE)) is not None}
        for pid in ready:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, _STOP_AND_REQUEUE)
        # a rank is its task's first process: the controller's child, or in podman conmon's (neither is the job's)
        if sum(parent not in job for parent in ready.values()) >= ranks:
            self.stop_asked = False


def _runtime_client(pid: int) -> bool:
    """Whether `pid` is a container runtime's client that waits for a rank running elsewhere (podman's)."""
    try:
        return Path(os.readlink(f"/proc/{pid}/exe")).name in RUNTIME_CLIENTS
    except OSError:
        return False


def parent_if_catching(pid: int, signum: int) -> Optional[int]:
    """The parent of process `pid` where it has a handler for `signum` (/proc/PID/status), else None."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        catches = int(status["SigCgt"], 16) >> (signum - 1) & 1
        return int(status["PPid"]) if catches else None
    except (OSError, ValueError, KeyError):
        return None


def _record_interrupt(job: JobConfig, attempts: AttemptLog, before: int, sjob: Any, started: float,
                      stop: KeyboardInterrupt) -> int:
    """The launcher was interrupted: kill the local job, record its attempt as `cancelled` (unless its
    rank 0 recorded it just before), and say how to go on; returns the exit code (128 + the signal)."""
    signum = stop.signum if isinstance(stop, Interrupted) else signal.SIGINT
    _kill_local_job(sjob)
    name = signal.Signals(signum).name
    if len(attempts.read()) == before:
        record_or_say(attempts, job, "cancelled", recorded_by="launcher", start=round(started, 3),
                      world_size=job.resources.ranks_per_node, error=f"the launcher got {name}")
    print(f"\ngpujobs: interrupted ({name}): local job {os.getpid()} killed; its checkpoints stay in "
          f"{attempts.run_dir}, "
          "and the same command resumes from the last one", flush=True)
    return 128 + signum


def _kill_local_job(sjob: Any) -> None:
    """SIGKILL every process of the local job (its controller, the ranks and anything they started)."""
    controller = int(sjob.job_id)
    left = kill_tree([*local_job_processes(controller), controller])
    if left:
        print(f"gpujobs: processes {left} of submitit job {sjob.job_id} outlived SIGKILL", flush=True)


def _kill_left(sjob: Any) -> None:
    """After an attempt's controller is gone, SIGKILL what is left of its job: a rank in a podman container
    outlives its controller, which can only kill podman's client (conmon parents the rank), and would go on
    until gloo timed out. Not the controller's pid: it is free for reuse once it has exited."""
    if not sjob.done():
        return  # the launcher was interrupted: `_kill_local_job` takes the whole job
    left = kill_tree(local_job_processes(int(sjob.job_id), below=False))
    if left:
        print(f"gpujobs: processes {left} of submitit job {sjob.job_id} outlived SIGKILL", flush=True)

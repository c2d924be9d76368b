"""`python -m gpujobs.attempt.pod --folder F RUN_DIR`: the per-node supervisor in each pod of a JobSet.

It is to a pod what the sbatch script's batch step and `srun` are to a Slurm node (`cluster=kubernetes`,
`gpujobs.backends.kubernetes.jobset` renders the pods that run it). It reads its place from what the JobSet
and Job controllers give the pod (`PodPlace`): the node index JOB_COMPLETION_INDEX, GPUJOBS_NNODES nodes of
GPUJOBS_RANKS_PER_NODE ranks, the rendezvous MASTER_ADDR:MASTER_PORT (pod 0's DNS name), the JobSet's name
and restart attempt; a missing or bad one is refused in one line, exit 2 (the JobSet fails at once).

It then starts the node's ranks, each under submitit's job-side runner with the payload every local rank
runs (`RankProgram(FROM_RUN_DIR)`, built from the run dir's config.yaml in the rank), with submitit's local
environment and torchrun's variables saying where it stands: global rank = index * ranks a node + local
rank, world = nodes * ranks a node. Each rank sees the pod's GPUs and takes the one of its local rank
(`gpujobs.rank.distributed.gpu_index_for`), as a local job's ranks do. Their output goes to the pod's own
(`kubectl logs`) and, appended, to `<folder>/<jobset>_<global rank>_log.out|.err`, where `gpujobs logs
RUN_DIR --rank N` finds it once the pod is gone (`gpujobs.attempt.rank_output`: a log file that cannot be
written costs the file, never the rank).

SIGTERM (a Kubernetes eviction, a Kueue preemption; only the container's first process gets it) takes the
path USR2 takes on Slurm: every rank gets USR2 (once it catches it), they agree on a stop, save one
checkpoint and exit; rank 0 records the attempt (`preempted`). Pod 0's supervisor then judges the attempt
as the batch step does on Slurm (`gpujobs.attempt.judge`): it writes the line the ranks could not. The
other pods' supervisors record nothing: one line per attempt. A pod that got no SIGTERM itself but stopped
with an evicted one exits a few seconds after it, so that the evicted pod's Job fails first: the JobSet's
failure policy judges that Job, and restarts for an eviction uncounted.

It holds the run dir's lease for the JobSet (every pod and restart of one JobSet is one holder): a run dir
that another JobSet or a local job holds is left alone, exit 2. Exit codes: 0 the ranks completed;
`EXIT_REQUEUED` (75) the ranks stopped to go again; 2 refused input or a busy run dir; 1 anything else
(the JobSet restarts for anything but 2, counted against `maxRestarts` unless the pod was evicted).
The attempt's time limit is `cluster.time`: `cluster.signal_lead_s` before it, the supervisor stops the ranks
as SIGTERM does, and they record `timeout`; ranks that still run when it is up (one stopped or stuck short of
the stop's vote) are killed, as Slurm kills a job at its limit, and pod 0 records `timeout` for them. Where
the ledger says no attempt may follow (the budget of its reason spent: `cluster.max_preemptions`,
`max_timeouts`, `max_restarts`), every pod that knows it exits 2, so the JobSet fails at once instead of
restarting. Pod 0's supervisor runs the hang watchdog over every rank
(`pod_hangs`): a hung attempt's evidence is kept, its ranks killed in every pod, and it is recorded `hung`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Optional

from gpujobs.attempt import failures
from gpujobs.attempt import slurm_task as task
from gpujobs.attempt.evidence import kill_tree
from gpujobs.attempt.file_sd import withdraw_left_target
from gpujobs.attempt.hangs import HangReport
from gpujobs.attempt.judge import AttemptEnd, judge, record_verdict
from gpujobs.attempt.local import parent_if_catching
from gpujobs.attempt.pod_hangs import PodWatch
from gpujobs.attempt.pod_place import PodPlace, check_shape, read_place
from gpujobs.attempt.preemption import EXIT_REQUEUED, JOB_ID_ENV
from gpujobs.attempt.program import FROM_RUN_DIR, RankProgram
from gpujobs.attempt.rank_output import RankOutput
from gpujobs.backends.kubernetes import LEASE_HOLDER
from gpujobs.backends.kubernetes import jobset as js
from gpujobs.backends.kubernetes.jobs import job_id_of
from gpujobs.base.errors import ConfigError, GpujobsError
from gpujobs.config.load import JobConfig
from gpujobs.rundir import lease
from gpujobs.rundir.attempts import AttemptLog
from gpujobs.rundir.files import read_config
from gpujobs.rundir.heartbeat import instance
from gpujobs.rundir.trust import check_run_dir

#: Exit code of refused input and of a busy run dir: the rendered failure policy fails the JobSet on it.
EXIT_BAD_INPUT = js.BAD_INPUT_EXIT
#: submitit's job-side runner, which each rank runs (as the local executor's tasks do).
RUNNER = ("-u", "-m", "submitit.core._submit")
_POLL_S = 0.2
#: How long the node's other ranks may go on after one failed, before they are killed: their peers' errors
#: reach them through the collectives within this, and each leaves how it ended.
_FAIL_GRACE_S = 30.0
#: How long the copies of the ranks' output may take to reach their end once the ranks exited (a process
#: the ranks left behind may hold it open: the pod does not wait for that one).
_OUTPUT_TAIL_S = 10.0
#: How long a pod but pod 0 waits for the ended attempt's ledger line (it says whether another may follow).
_VERDICT_WAIT_S = 15.0
#: How long a pod that got no SIGTERM of its own waits before it exits to go again (75): the JobSet's failure
#: policy judges the Job that failed first (its condition's time, to the second), so the evicted pod's Job, which
#: the eviction rule restarts uncounted, must fail before the Jobs of the pods that only stopped with it.
_SPARED_EXIT_LAG_S = 5.0


class StopSignals:
    """SIGTERM (and USR2) to the supervisor: only a flag, which `forward` passes to the ranks as USR2; and the
    attempt's time limit (`limit_at`), which asks the same stop `cluster.signal_lead_s` before `cluster.time`
    is up, as Slurm's `--signal` does (the ranks then record `timeout`: `preemption.classify_stop`)."""

    def __init__(self) -> None:
        self.asked = False
        self.signalled = False
        """This pod got SIGTERM or USR2 itself (an eviction, a Kueue preemption), not only its ranks' stop."""
        self.limit_at: Optional[float] = None
        self.deadline: Optional[float] = None
        """The time limit itself (`cluster.time` after the start): ranks still running then are killed, as Slurm
        kills a job at its limit (a rank that never reaches the stop's vote, stopped or stuck, would run on)."""
        self.killed_at_limit = False
        self._told: set[int] = set()

    def install(self) -> StopSignals:
        for signum in (signal.SIGTERM, signal.SIGUSR2):
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        self.signalled = True
        if not self.asked:
            print(f"gpujobs: the pod got {signal.Signals(signum).name}: its ranks stop at the next step, after an "
                  "agreed checkpoint", file=sys.stderr, flush=True)
        self.asked = True

    def forward(self, ranks: list[subprocess.Popen[bytes]]) -> None:
        """USR2 once to each live rank that catches it (one still starting would die of it: a later poll)."""
        if not self.asked and self.limit_at is not None and time.time() >= self.limit_at:
            print("gpujobs: the attempt reached its time limit (cluster.time less cluster.signal_lead_s): its ranks "
                  "stop at the next step, after an agreed checkpoint", file=sys.stderr, flush=True)
            self.asked = True
        if not self.asked:
            return
        for proc in ranks:
            if proc.pid in self._told or proc.poll() is not None:
                continue
            if parent_if_catching(proc.pid, signal.SIGUSR2) is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGUSR2)
                self._told.add(proc.pid)


def take_run_dir(train_dir: Path, place: PodPlace, namespace: str) -> None:
    """Take the run dir's lease for the JobSet (`NAMESPACE/NAME`, as the submit handed it over), or exit 2
    when another live job holds it."""
    me = dataclasses.replace(lease.here(job_id_of(namespace, place.jobset)), holder=LEASE_HOLDER)
    try:
        lease.acquire(train_dir, me, wait_s=0)
    except lease.LeaseHeld as err:
        print(f"gpujobs: {err}; this pod (JobSet {place.jobset}) stands down and leaves the run dir as it is",
              file=sys.stderr, flush=True)
        raise SystemExit(EXIT_BAD_INPUT) from None


def write_payload(folder: Path, job: JobConfig, train_dir: Path, place: PodPlace) -> None:
    """The ranks' payload where submitit's runner looks for it; every pod writes the same one (rename keeps
    it whole)."""
    from gpujobs.backends.submitit_private import DelayedSubmission, cloudpickle_dump, submitted_pickle

    delayed = DelayedSubmission(RankProgram(FROM_RUN_DIR, {"run_dir": str(train_dir)}))
    delayed.set_timeout(job.cluster.timeout_min, max_num_timeout=3)
    pickle = submitted_pickle(folder, place.attempt_id)
    pickle.parent.mkdir(parents=True, exist_ok=True)
    tmp = pickle.with_name(f".{pickle.name}.{uuid.uuid4().hex}")
    cloudpickle_dump(delayed, tmp)
    os.replace(tmp, pickle)


def start_ranks(folder: Path, place: PodPlace, output: RankOutput) -> list[subprocess.Popen[bytes]]:
    """The node's ranks, each under submitit's job-side runner; their output goes through `output`."""
    ranks = []
    for local in range(place.per_node):
        with output.pipes(place.global_rank(local)) as (stdout, stderr):
            ranks.append(subprocess.Popen([sys.executable, *RUNNER, str(folder)], stdout=stdout, stderr=stderr,
                                          env={**os.environ, "SUBMITIT_FOLDER": str(folder), **place.rank_env(local)}))
    return ranks


def wait_ranks(ranks: list[subprocess.Popen[bytes]], stop: StopSignals, watch: PodWatch) -> list[int]:
    """Wait for every rank, passing a stop on and ticking the hang watch; once one failed, the rest get
    `_FAIL_GRACE_S`, then SIGKILL, as do all at the time limit (`stop.deadline`). Returns their exit codes
    (negative: the signal that killed one)."""
    failed_at: Optional[float] = None
    while any(proc.poll() is None for proc in ranks):
        stop.forward(ranks)
        watch.tick()
        if stop.deadline is not None and time.time() >= stop.deadline:
            print("gpujobs: the attempt's time limit (cluster.time) is up and ranks of this pod still run: killed",
                  file=sys.stderr, flush=True)
            stop.killed_at_limit = True
            kill_tree([proc.pid for proc in ranks if proc.poll() is None])
            break
        if failed_at is None and any(proc.returncode not in (None, 0, EXIT_REQUEUED) for proc in ranks):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > _FAIL_GRACE_S:
            left = kill_tree([proc.pid for proc in ranks if proc.poll() is None])
            if left:
                print(f"gpujobs: ranks {left} of this pod outlived SIGKILL", file=sys.stderr, flush=True)
            break
        time.sleep(_POLL_S)
    return [proc.wait() for proc in ranks]


def describe(codes: list[int], place: PodPlace) -> str:
    """How the node's ranks ended, for an attempt's error."""
    said = []
    for local, code in enumerate(codes):
        if code != 0:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            said.append(f"rank {place.global_rank(local)}: {how}")
    return ", ".join(said) or "every rank of node 0 exited 0"


def pod_exit(codes: list[int]) -> int:
    """The pod's exit code from its ranks': 0 all completed, EXIT_REQUEUED all stopped or done, else 1."""
    if all(code == 0 for code in codes):
        return 0
    return EXIT_REQUEUED if all(code in (0, EXIT_REQUEUED) for code in codes) else 1


def record_node0(job: JobConfig, ledger: AttemptLog, before: int, started: float, codes: list[int],
                 place: PodPlace, hang: Optional[HangReport] = None, *, timed_out: bool = False) -> int:
    """Pod 0 judges the attempt as the Slurm batch step does, and writes its line where rank 0 wrote none
    (`timed_out`: this pod killed its ranks at the time limit); returns the pod's exit code."""
    history = ledger.read()
    ok = all(code == 0 for code in codes)
    said = (f"ranks still ran when the time limit (cluster.time) was up and were killed: {describe(codes, place)}"
            if timed_out else f"the ranks recorded nothing: {describe(codes, place)}")
    end = AttemptEnd(
        ranks=place.world, started=started, exited_ok=ok, recorded=history[-1] if len(history) > before else None,
        hang=hang, left=failures.left_outcome(ledger.run_dir, place.world, instance()) if not ok else None,
        error=said, node=socket.gethostname() if any(code < 0 for code in codes) and not timed_out else None,
        script=job.script is not None, timed_out=timed_out,
    )
    verdict = judge(end)
    decision = record_verdict(ledger, job, verdict, recorded_by="supervisor")
    if verdict.reason == "completed":
        return 0
    print(f"gpujobs: attempt ended: {verdict.reason} ({decision.why})", file=sys.stderr, flush=True)
    if not decision.requeue:  # the ledger's budget for it is spent: the JobSet fails now, not after maxRestarts
        return EXIT_BAD_INPUT
    return EXIT_REQUEUED if verdict.reason in ("preempted", "timeout") else pod_exit(codes) or 1


def other_pod_exit(ledger: AttemptLog, before: int, codes: list[int]) -> int:
    """A pod but pod 0's exit code: its ranks', or `EXIT_BAD_INPUT` where the attempt's ledger line says no
    attempt may follow: the JobSet must fail, not restart, whichever pod's failure its controller reads first;
    0 where the line says `completed` (a rank that crashed at its exit, say in NCCL's teardown, after it).
    The line is rank 0's or pod 0's supervisor's, written about when this pod's ranks end: it is waited for
    up to `_VERDICT_WAIT_S` (a line that comes later leaves pod 0 alone to fail the JobSet)."""
    code = pod_exit(codes)
    if code == 0:
        return 0
    deadline = time.monotonic() + _VERDICT_WAIT_S
    history = ledger.read()
    while len(history) <= before and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        history = ledger.read()
    if len(history) > before and history[-1].reason == "completed":  # a rank's crash at its exit, after it
        print(f"gpujobs: the attempt completed; this pod's ranks then exited with {codes}",
              file=sys.stderr, flush=True)
        return 0  # a restart would train the completed run again
    if len(history) > before and not history[-1].requeue:
        print(f"gpujobs: attempt ended: {history[-1].reason} ({history[-1].why})", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    return code


@dataclass(frozen=True)
class Attempt:
    """One attempt of this pod, ready to start its ranks."""

    job: JobConfig
    folder: Path
    train_dir: Path
    place: PodPlace
    before: int
    """Lines in the ledger before it."""


def prepare(folder: Path, run_dir: Path, place: PodPlace) -> Attempt:
    """Read the run dir's config, take its lease, write the ranks' payload (GpujobsError: refused)."""
    check_run_dir(run_dir)
    check_run_dir(folder)
    job = read_config(run_dir)
    check_shape(job, place)
    train_dir = task.training_dir(run_dir, place.jobset)
    take_run_dir(train_dir, place, job.cluster.namespace)
    os.environ["SUBMITIT_LOCAL_JOB_ID"] = place.attempt_id  # `instance()`: the attempt's files are this one's
    os.environ[JOB_ID_ENV] = job_id_of(job.cluster.namespace, place.jobset)  # what the attempts' lines name
    write_payload(folder, job, train_dir, place)
    return Attempt(job, folder, train_dir, place, len(AttemptLog(train_dir).read()))


def supervise(attempt: Attempt, stop: StopSignals) -> int:
    """Run this pod's ranks of one attempt; returns the pod's exit code."""
    place = attempt.place
    if stop.asked:  # stopped before any rank started: nothing ran, nothing to record
        return EXIT_REQUEUED
    print(f"gpujobs: pod {place.index} of JobSet {place.jobset} (restart {place.restart}): ranks "
          f"{place.index * place.per_node}-{(place.index + 1) * place.per_node - 1} of {place.world}, "
          f"rendezvous {place.master_addr}:{place.master_port}, run dir {attempt.train_dir}", flush=True)
    started = time.time()
    stop.deadline = started + attempt.job.cluster.timeout_min * 60
    stop.limit_at = stop.deadline - attempt.job.cluster.signal_lead_s
    output = RankOutput(attempt.folder, place.jobset)
    ranks = start_ranks(attempt.folder, place, output)
    watch = PodWatch.for_pod(attempt.train_dir, attempt.job, place.world, instance(), attempt.before + 1,
                             {place.global_rank(local): proc.pid for local, proc in enumerate(ranks)},
                             first=place.index == 0)
    codes = wait_ranks(ranks, stop, watch)
    output.join(_OUTPUT_TAIL_S)  # the ranks' last lines are in their files before the attempt is judged
    if place.index != 0:
        code = other_pod_exit(AttemptLog(attempt.train_dir), attempt.before, codes)
    else:
        withdraw_left_target(attempt.train_dir)  # the ranks are gone: a target rank 0 could not withdraw goes too
        hang = watch.watchdog.report if watch.watchdog is not None else None
        code = record_node0(attempt.job, AttemptLog(attempt.train_dir), attempt.before, started, codes, place,
                            hang, timed_out=stop.killed_at_limit)
    if code == EXIT_REQUEUED and not stop.signalled:  # stopped with an evicted pod, perhaps: it fails first
        time.sleep(_SPARED_EXIT_LAG_S)
    return code


def main(argv: Optional[list[str]] = None) -> None:
    """Read the pod's place and its run dir (exit 2 on anything refused), then supervise its ranks."""
    stop = StopSignals().install()
    args = task.parse_args(argv)
    try:
        if args.points is not None:
            raise ConfigError("--points", str(args.points), "none: a JobSet runs one run dir")
        attempt = prepare(args.folder, args.run_dir, read_place(dict(os.environ)))
    except GpujobsError as err:  # a bad value, an untrusted or unreadable run dir: retrying cannot help
        print(f"gpujobs: {err}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_BAD_INPUT) from None
    raise SystemExit(supervise(attempt, stop))


if __name__ == "__main__":
    main()

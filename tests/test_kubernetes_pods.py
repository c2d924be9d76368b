"""The pod contract of `cluster=kubernetes`, for real: the rendered pods' command run as local processes.

No Kubernetes cluster can run here, so no pod of these tests ran on one. Each emulated pod is the rendered
JobSet's container as it would start: its `command`, its `env` and its `workingDir` read from the dry run's
YAML, plus what the controllers add (the Job controller's JOB_COMPLETION_INDEX; JobSet's restart attempt,
which the rendered env reads from the pod's annotation) and what the image has (PATH, gpujobs importable).
Each pod has its own hostname, `<jobset>-node-0-<index>` (a UTS namespace: `unshare --uts --mount`), and an
/etc/hosts of its own (bind-mounted in its mount namespace) that maps every pod's name, and so MASTER_ADDR
`<jobset>-node-0-0.<jobset>`, to 127.0.0.1, as the kubelet's hosts file and JobSet's headless service would
resolve them. The pods of one JobSet share a network namespace of their own (loopback only), where the
rendered MASTER_PORT 29500 is free whatever runs on this host. SIGTERM goes to the pod's first process
only, as the container runtime sends it. The run dir lies under the volume's mount path (`tmp_path`), and
its config.yaml is written as a submit writes it before it would create the JobSet (the dry run writes
nothing). Needs root and util-linux's `unshare`/`nsenter` (skipped without, failed under CI).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import pytest
import yaml
from conftest import REPO, compose_job, missing, read_result, submit

from gpujobs.attempt.pod import StopSignals, other_pod_exit, record_node0, wait_ranks
from gpujobs.attempt.pod_hangs import PodWatch, request_path
from gpujobs.attempt.pod_place import read_place
from gpujobs.base.process import alive
from gpujobs.rundir import HEARTBEAT_DIR, lease
from gpujobs.rundir.attempts import AttemptLog
from gpujobs.rundir.files import write_config
from gpujobs.rundir.heartbeat import instance

#: 60 slowed steps on 2 nodes x 2 gloo ranks: long enough to interrupt mid-run, short enough for 2 shared cores.
#: The ranks vote on a stop every 30 steps and read the vote a step later: a signal after step 12
#: (`SIGNAL_AFTER`) stops them all at step 31.
TRAIN = ("+experiment=rec", "+debug=tiny", "trainer.max_steps=60", "checkpoint.every_steps=10",
         "telemetry.debug_slow_rank=0", "telemetry.debug_slow_ms=40", "trainer.stop_check_every=30")
SIGNAL_AFTER, STOP_AT = 12, 31
NODES, PER_NODE = 2, 2
#: The JobSet's shape and what cluster=kubernetes needs besides (the image is never pulled here).
KUBE = ("cluster=kubernetes", "cluster.dry_run=true", "cluster.volume.claim=team-runs", "container=podman",
        "container.image=registry.example.com/team/rec:1", f"resources.nodes={NODES}",
        f"resources.procs_per_node={PER_NODE}")
#: The rendered failure policy's codes (gpujobs.backends.kubernetes.jobset): 2 fails the JobSet at once.
EXIT_BAD_INPUT, EXIT_REQUEUED = 2, 75


def _can_emulate() -> None:
    """Skip (fail under CI) where this host cannot give a process its own hostname and hosts file."""
    if shutil.which("unshare") is None or shutil.which("nsenter") is None or os.geteuid() != 0:
        missing("emulated pods need util-linux's `unshare` and `nsenter` as root")


class JobSet:
    """A rendered JobSet of a run dir on the volume at `mount`, and its pods as local processes."""

    def __init__(self, mount: Path, *overrides: str) -> None:
        self.run_dir = mount / "run"
        args = (*TRAIN, *KUBE, f"cluster.volume.mount_path={mount}", *overrides)
        proc = submit(self.run_dir, *args)
        assert proc.returncode == 0, proc.stderr
        self.manifest: dict[str, Any] = yaml.safe_load(proc.stdout)
        write_config(self.run_dir, compose_job(*args))  # what the submit writes before it creates the JobSet
        self.name = self.manifest["metadata"]["name"]
        self.hosts = mount / "hosts"
        names = [f"{self.name}-node-0-{index}" for index in range(NODES)]
        self.network: Network | None = None  # made by the first start
        self.hosts.write_text("127.0.0.1 localhost\n" + "".join(f"127.0.0.1 {n}.{self.name} {n}\n" for n in names))

    @property
    def container(self) -> dict[str, Any]:
        """The pods' one container, as rendered."""
        spec = self.manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        return dict(spec["containers"][0])

    def pod_env(self, index: int, restart: int) -> dict[str, str]:
        """Pod `index`'s environment: the rendered env, the controllers' additions, the image's own."""
        env = {item["name"]: item["value"] for item in self.container["env"] if "value" in item}
        from_annotation = [item["name"] for item in self.container["env"] if "valueFrom" in item]
        assert from_annotation == ["GPUJOBS_RESTART_ATTEMPT"], self.container["env"]
        env.update(JOB_COMPLETION_INDEX=str(index), GPUJOBS_RESTART_ATTEMPT=str(restart))
        env.update(PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin", HOME="/root", PYTHONPATH=str(REPO))
        return env

    def start(self, started: list[subprocess.Popen[str]], restart: int = 0) -> list[Pod]:
        """Every pod of restart attempt `restart` (their processes, and the network's, go into `started`)."""
        if self.network is None:
            self.network = Network(self.run_dir.parent / "net-ready")
            started.append(self.network.proc)
        network = self.network.path
        pods = [Pod(self, index, restart, network) for index in range(NODES)]
        started.extend(pod.proc for pod in pods)
        return pods

    def attempts(self) -> list[dict[str, Any]]:
        """The run's attempts.jsonl."""
        return [json.loads(line) for line in (self.run_dir / "attempts.jsonl").read_text().splitlines()]

    def wait_for_step(self, step: int, pods: list[Pod], timeout: float = 80) -> None:
        """Until rank 0 logged `step` or later (metrics.jsonl)."""
        deadline = time.monotonic() + timeout
        metrics = self.run_dir / "metrics.jsonl"
        while time.monotonic() < deadline:
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            if any(json.loads(line).get("step", -1) >= step for line in lines if line.endswith("}")):
                return
            assert all(pod.proc.poll() is None for pod in pods), [pod.output() for pod in pods]
            time.sleep(0.1)
        raise AssertionError(f"no step {step} within {timeout} s: {[pod.output() for pod in pods]}")


def kept_output(jobset: JobSet, rank: int, stream: str = "out") -> str:
    """Global rank `rank`'s stdout (`stream` "err": stderr) as the pods keep it in the run dir, where
    `gpujobs logs RUN_DIR --rank N` reads it."""
    return (jobset.run_dir / "submitit" / f"{jobset.name}_{rank}_log.{stream}").read_text()


def child_of(pid: int, timeout: float = 20) -> int:
    """The first child of process `pid` (`unshare --fork`'s), once it has one."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = children.read_text().split()
        if pids:
            return int(pids[0])
        time.sleep(0.05)
    raise AssertionError(f"process {pid} started no child within {timeout} s")


class Network:
    """A network namespace with its loopback up, held by a sleeping process: the pods' network."""

    def __init__(self, ready: Path) -> None:
        setup = f'ip link set lo up && touch {ready} && exec sleep 600'
        self.proc = subprocess.Popen(["unshare", "--net", "--fork", "sh", "-c", setup], text=True)
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, "no network namespace"
            time.sleep(0.05)
        self.path = f"/proc/{child_of(self.proc.pid)}/ns/net"


class Pod:
    """One pod: the rendered command in its own hostname and hosts file, its output in a file."""

    def __init__(self, jobset: JobSet, index: int, restart: int, network: str) -> None:
        container = jobset.container
        env = jobset.pod_env(index, restart)
        self.log_path = jobset.run_dir.parent / f"pod{index}.r{restart}.log"
        self._log: IO[str] = open(self.log_path, "w")  # noqa: SIM115 (closed in wait)
        # sh sets the hostname and the hosts file, then execs the container's command: the pod's first process
        setup = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
        argv = ["nsenter", f"--net={network}", "unshare", "--uts", "--mount", "--fork", "sh", "-c", setup, "sh",
                f"{jobset.name}-node-0-{index}", str(jobset.hosts), *container["command"]]
        self.proc = subprocess.Popen(argv, cwd=container["workingDir"], env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, text=True)

    def first_process(self) -> int:
        """The pod's first process (unshare's child, nsenter having exec'd unshare): what SIGTERM goes to."""
        pid = child_of(self.proc.pid)
        deadline = time.monotonic() + 20
        while b"gpujobs.attempt.pod" not in Path(f"/proc/{pid}/cmdline").read_bytes():  # sh, until it execs
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.05)
        return pid

    def terminate(self) -> None:
        """What the kubelet does to an evicted pod: SIGTERM to its first process."""
        os.kill(self.first_process(), signal.SIGTERM)

    def output(self) -> str:
        return self.log_path.read_text()

    def wait(self, timeout: float = 80) -> int:
        """The pod's exit code (its command's: unshare passes it on)."""
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close()


@pytest.fixture
def started() -> Any:
    """The processes a test started (pods, their network): killed with theirs when the test ends."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    from gpujobs.attempt.evidence import descendants, kill_tree

    for proc in procs:
        if proc.poll() is None:
            kill_tree([*descendants(proc.pid), proc.pid])


@pytest.fixture(scope="module")
def local_digest(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The `param_digest` of the same training as `cluster=local` with 4 ranks on one machine."""
    run_dir = tmp_path_factory.mktemp("local4") / "run"
    proc = submit(run_dir, *TRAIN, "cluster=local", f"resources.procs_per_node={NODES * PER_NODE}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(read_result(run_dir)["param_digest"])


def test_two_pods_train_to_the_local_digest(tmp_path: Path, local_digest: str,
                                            started: list[subprocess.Popen[str]]) -> None:
    """2 pods x 2 gloo ranks, as rendered, train to the digest of a local 4-rank run; one `completed` line.
    Each rank's stdout and stderr are the pod's and, whole, its own log file's in the run dir; a symlink planted
    in rank 3's stderr file's place is not followed: that file is given up, said once, and training goes on."""
    _can_emulate()
    jobset = JobSet(tmp_path)
    (jobset.run_dir / "submitit").mkdir()  # the pods' folder, as the first pod would make it
    planted = jobset.run_dir / "submitit" / f"{jobset.name}_3_log.err"
    (tmp_path / "not-a-log").write_text("mine\n")
    planted.symlink_to(tmp_path / "not-a-log")
    # the lease as a submit hands it to the JobSet it created (`NAMESPACE/NAME`): its pods are that holder
    handed = f"{jobset.manifest['metadata']['namespace']}/{jobset.name}"
    lease.acquire(jobset.run_dir, lease.Lease("kubernetes", "submit-host", 1, handed, time.time()))
    pods = jobset.start(started)
    codes = [pod.wait() for pod in pods]
    assert codes == [0, 0], [pod.output() for pod in pods]
    result = read_result(jobset.run_dir)
    assert (result["world_size"], result["param_digest"]) == (NODES * PER_NODE, local_digest)
    assert [line["reason"] for line in jobset.attempts()] == ["completed"]
    assert f"rendezvous {jobset.name}-node-0-0.{jobset.name}:29500" in pods[0].output()

    world = NODES * PER_NODE
    for rank in range(world):  # submitit's first line names the rank; its last one ends the rank's output
        kept, pod = kept_output(jobset, rank), pods[rank // PER_NODE].output()
        assert [f"global_rank={other}({world})" in kept for other in range(world)] == [r == rank for r in range(world)]
        assert kept.endswith("Exiting after successful completion\n"), kept
        assert f"global_rank={rank}({world})" in pod and f"[rank {rank}] rank {rank}/{world} on" in pod, pod
        if rank != 3:
            assert f"[rank {rank}] rank {rank}/{world} on" in kept_output(jobset, rank, "err")
    assert planted.is_symlink() and (tmp_path / "not-a-log").read_text() == "mine\n"
    gave_up = [line for line in pods[1].output().splitlines() if "could not be written" in line]
    assert len(gave_up) == 1 and str(planted) in gave_up[0], pods[1].output()


def test_sigterm_to_every_pod_checkpoints_and_the_rerun_resumes(tmp_path: Path, local_digest: str,
                                                                started: list[subprocess.Popen[str]]) -> None:
    """An eviction (SIGTERM to both pods mid-run): an agreed checkpoint, the attempt `preempted` once, the pods
    exit for a restart; the restarted pods resume from it and end with the digest of the local 4-rank run that
    never stopped."""
    _can_emulate()
    jobset = JobSet(tmp_path)
    pods = jobset.start(started)
    jobset.wait_for_step(SIGNAL_AFTER, pods)
    for pod in pods:
        pod.terminate()
    codes = [pod.wait() for pod in pods]
    assert codes == [EXIT_REQUEUED, EXIT_REQUEUED], [pod.output() for pod in pods]
    (stopped,) = jobset.attempts()
    assert (stopped["reason"], stopped["world_size"], stopped["steps_done"]) == ("preempted", 4, STOP_AT), stopped
    saved = Path(stopped["saved"])  # the agreed checkpoint of the step the ranks stopped at
    assert saved == jobset.run_dir / "checkpoints" / f"step_{STOP_AT:08d}" and saved.is_dir(), stopped
    assert not (jobset.run_dir / "result.json").exists()

    again = jobset.start(started, restart=1)
    assert [pod.wait() for pod in again] == [0, 0], [pod.output() for pod in again]
    result = read_result(jobset.run_dir)
    assert (result["resumed_from"], result["param_digest"]) == (str(saved), local_digest)
    assert [line["reason"] for line in jobset.attempts()] == ["preempted", "completed"]
    job_id = f"{jobset.manifest['metadata']['namespace']}/{jobset.name}"  # as the submissions name the JobSet
    assert [line["job_id"] for line in jobset.attempts()] == [job_id, job_id]
    for rank in range(NODES * PER_NODE):  # the restart's output follows the first attempt's in the rank's files
        kept = kept_output(jobset, rank)
        first, second = (kept.find(f"job_id={jobset.name}-1-{restart},") for restart in (0, 1))
        assert 0 <= first < second and kept.endswith("Exiting after successful completion\n"), kept
        err = kept_output(jobset, rank, "err").split(f"[rank {rank}] rank {rank}/{NODES * PER_NODE} on")
        assert len(err) == 3 and "resumed from" in err[2] and "resumed from" not in err[1], err

    # `gpujobs status` reads the pods' run dir from the same records as a Slurm job's (no API asked)
    status = subprocess.run([sys.executable, "-m", "gpujobs", "status", str(jobset.run_dir)], capture_output=True,
                            text=True, env={**os.environ, "COLUMNS": "200"}, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "completed (files)" in status.stdout and "2 (completed) world 4→4" in status.stdout, status.stdout


def test_an_evicted_pod_exits_before_the_pod_that_only_stopped_with_it(tmp_path: Path,
                                                                       started: list[subprocess.Popen[str]]) -> None:
    """SIGTERM to pod 1 alone (an eviction): every rank stops at an agreed checkpoint, both pods exit 75, and
    pod 0, which got no SIGTERM, exits seconds after pod 1. The JobSet's failure policy judges the Job that
    failed first (to the second), and only the evicted pod's restarts the set uncounted. (No JobSet controller
    runs here: the order is what this test holds.)"""
    _can_emulate()
    jobset = JobSet(tmp_path)
    pods = jobset.start(started)
    jobset.wait_for_step(SIGNAL_AFTER, pods)
    pods[1].terminate()
    ended: dict[int, float] = {}
    deadline = time.monotonic() + 120
    while len(ended) < len(pods) and time.monotonic() < deadline:
        for index, pod in enumerate(pods):
            if index not in ended and pod.proc.poll() is not None:
                ended[index] = time.monotonic()
        time.sleep(0.05)
    assert [pod.wait(timeout=1) for pod in pods] == [EXIT_REQUEUED, EXIT_REQUEUED], [pod.output() for pod in pods]
    assert ended[0] - ended[1] >= 4.0, ended  # _SPARED_EXIT_LAG_S, less the poll
    (stopped,) = jobset.attempts()
    assert (stopped["reason"], stopped["requeue"]) == ("preempted", True), stopped


def test_the_time_limit_stops_the_pods_and_a_spent_budget_fails_the_jobset(
        tmp_path: Path, started: list[subprocess.Popen[str]]) -> None:
    """`cluster.time` holds in pods as on Slurm: `signal_lead_s` before it, the supervisors stop the ranks (an
    agreed checkpoint) and rank 0 records `timeout`; with `cluster.max_timeouts=0` that budget is spent, so
    both pods exit 2 (the JobSet fails at once, whichever pod its controller reads first), not 75 (a restart)."""
    _can_emulate()
    jobset = JobSet(tmp_path, "cluster.time=00:01:00", "cluster.signal_lead_s=25", "cluster.max_timeouts=0",
                    "trainer.max_steps=5000")
    pods = jobset.start(started)
    codes = [pod.wait() for pod in pods]
    assert codes == [EXIT_BAD_INPUT, EXIT_BAD_INPUT], [pod.output() for pod in pods]
    (line,) = jobset.attempts()
    assert (line["reason"], line["requeue"], line["world_size"]) == ("timeout", False, 4), line
    assert "timeout budget exhausted" in line["why"], line
    assert line["end"] - line["start"] < 60, line  # stopped before the limit
    assert Path(line["saved"]).is_dir() and line["steps_done"] < 5000, line  # the agreed checkpoint
    for pod in pods:
        assert "reached its time limit" in pod.output() and "timeout budget exhausted" in pod.output(), pod.output()


def test_a_rank_killed_in_one_pod_fails_the_attempt_once(tmp_path: Path,
                                                         started: list[subprocess.Popen[str]]) -> None:
    """A rank of pod 1 killed mid-run (the OOM killer): the attempt is recorded `failed` once, and, with the
    failure budget not spent (`cluster.max_restarts=2`), every pod exits with a code that the JobSet counts
    as a failure and restarts for (neither 0 nor 2)."""
    _can_emulate()
    jobset = JobSet(tmp_path, "cluster.max_restarts=2")
    pods = jobset.start(started)
    jobset.wait_for_step(SIGNAL_AFTER, pods)
    os.kill(child_of(pods[1].first_process()), signal.SIGKILL)  # pod 1's first rank: global rank 2
    codes = [pod.wait(timeout=120) for pod in pods]
    assert all(code not in (0, EXIT_BAD_INPUT) for code in codes), (codes, [pod.output() for pod in pods])
    (failed,) = jobset.attempts()
    assert (failed["reason"], failed["world_size"], failed["requeue"]) == ("failed", NODES * PER_NODE, True), failed
    assert failed["job_id"] == f"{jobset.manifest['metadata']['namespace']}/{jobset.name}", failed
    assert not (jobset.run_dir / "result.json").exists()


def test_a_rank_stopped_in_one_pod_is_found_hung_by_pod_0(tmp_path: Path,
                                                         started: list[subprocess.Popen[str]]) -> None:
    """Global rank 2 (pod 1's first) stopped mid-run: pod 0's watchdog reads every rank's heartbeat on the volume,
    blames rank 2, keeps every rank's stacks (pod 1's supervisor has its own ranks write theirs: the stopped
    one continued alone), kills the attempt in both pods, and records it `hung` once; both pods exit for a
    counted restart, no rank left behind."""
    _can_emulate()
    jobset = JobSet(tmp_path, "trainer.hang_timeout_s=8", "cluster.max_restarts=1", "trainer.max_steps=5000")
    pods = jobset.start(started)
    jobset.wait_for_step(SIGNAL_AFTER, pods)
    culprit = child_of(pods[1].first_process())  # pod 1's first rank: global rank 2
    os.kill(culprit, signal.SIGSTOP)
    codes = [pod.wait(timeout=120) for pod in pods]
    assert codes == [1, 1], (codes, [pod.output() for pod in pods])
    (hung,) = jobset.attempts()
    assert (hung["reason"], hung["culprit_rank"], hung["requeue"]) == ("hung", 2, True), hung
    assert "stopped running" in hung["error"], hung
    evidence = Path(hung["evidence"])
    assert evidence == jobset.run_dir / "hangs" / "1"
    for rank in range(NODES * PER_NODE):  # py-spy's frame of the loop (pod 0 may have it), or faulthandler's
        text = (evidence / f"rank_{rank}.txt").read_text()
        assert "Trainer.fit" in text or " in fit" in text, (rank, text)
    how = json.loads((evidence / "hang.json").read_text())["stacks"]
    assert how["2"].startswith("faulthandler (asked on its node)"), how
    assert not alive(culprit)  # killed (a stopped process lives on)


#: A pod's supervisor in small: one "rank" printing LINES lines through `RankOutput` into the folder argv[1].
SUPERVISOR = """
import subprocess, sys
from pathlib import Path
from gpujobs.attempt.rank_output import RankOutput
output = RankOutput(Path(sys.argv[1]), "js")
with output.pipes(0) as (out, err):
    rank = subprocess.Popen([sys.executable, "-c", "for i in range(LINES): print(f'line {i:05d}', 'x' * 40)"],
                            stdout=out, stderr=err)
code = rank.wait()
output.join(60)
sys.exit(code)
"""


def test_a_full_disk_costs_the_log_file_not_the_rank(tmp_path: Path) -> None:
    """A rank's log file on a full disk (a 64 KiB tmpfs, in a mount namespace of its own): the rank runs to
    its end, the pod's stdout gets every line, the file keeps what fitted, and one line says it was given up."""
    _can_emulate()
    lines = 4000  # 200 KB
    folder, kept = tmp_path / "folder", tmp_path / "kept"
    folder.mkdir()
    # the tmpfs on `folder` lives as long as the namespace: what fitted in the file is copied out before it goes
    mount = ('mount -t tmpfs -o size=64k,mode=0755 none "$1" && "$2" -c "$3" "$1"; code=$?; '
             'cp "$1/js_0_log.out" "$4"; exit $code')
    proc = subprocess.run(["unshare", "--mount", "sh", "-c", mount, "sh", str(folder), sys.executable,
                           SUPERVISOR.replace("LINES", str(lines)), str(kept)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    expected = "".join(f"line {i:05d} {'x' * 40}\n" for i in range(lines))
    assert proc.stdout == expected
    assert 0 < len(kept.read_text()) < len(expected) and expected.startswith(kept.read_text())
    (said,) = proc.stderr.splitlines()
    assert "js_0_log.out could not be written (No space left on device)" in said, proc.stderr


@pytest.mark.parametrize(("drop", "set_", "said"), [
    (("JOB_COMPLETION_INDEX",), {}, "JOB_COMPLETION_INDEX=None is invalid"),
    ((), {"JOB_COMPLETION_INDEX": "2"}, "JOB_COMPLETION_INDEX='2' is invalid: allowed an integer from 0 to 1"),
    ((), {"GPUJOBS_RANKS_PER_NODE": "3"}, "GPUJOBS_RANKS_PER_NODE='3' is invalid: allowed 2, the run dir's"),
])
def test_bad_pod_environment_exits_2(tmp_path: Path, drop: tuple[str, ...], set_: dict[str, str], said: str) -> None:
    """A pod whose environment is missing or bad says so in one line and exits 2 (the JobSet fails at once)."""
    jobset = JobSet(tmp_path)
    env = {k: v for k, v in {**jobset.pod_env(0, 0), **set_}.items() if k not in drop}
    proc = subprocess.run(jobset.container["command"], cwd=jobset.container["workingDir"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_BAD_INPUT, proc.stdout + proc.stderr
    assert said in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (jobset.run_dir / "attempts.jsonl").exists()


def test_a_resubmitted_jobset_s_attempt_is_not_its_predecessor_s(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A resubmitted JobSet has the old one's name and restarts from 0 again: its attempt differs by the
    submission number, so the `hung.` file of the old JobSet's hung attempt 0 does not kill the new one's ranks."""
    env = {"GPUJOBS_NNODES": "2", "JOB_COMPLETION_INDEX": "1", "GPUJOBS_RANKS_PER_NODE": "1", "MASTER_PORT": "29500",
           "MASTER_ADDR": "rec-0a1b2c3d-node-0-0.rec-0a1b2c3d", "GPUJOBS_JOBSET": "rec-0a1b2c3d"}
    attempts = []
    for submission in ("1", "2"):  # what the pods of the first JobSet and of its resubmission run as
        monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", read_place({**env, "GPUJOBS_SUBMISSION": submission}).attempt_id)
        attempts.append(instance())
    old, new = attempts
    assert old != new and read_place(env).attempt_id == "rec-0a1b2c3d-1-0"  # a JobSet rendered before: the first
    (tmp_path / HEARTBEAT_DIR).mkdir()
    request_path(tmp_path, old, "hung").write_text("hung\n")  # pod 0 of the old JobSet found its attempt 0 hung
    rank = subprocess.Popen(["sleep", "60"])
    try:
        PodWatch(tmp_path, new, {1: rank.pid}).tick()  # pod 1 of the new JobSet, attempt 0
        with pytest.raises(subprocess.TimeoutExpired):
            rank.wait(timeout=1)
        PodWatch(tmp_path, old, {1: rank.pid}).tick()  # the old attempt's own pod obeys it
        assert rank.wait(timeout=10) == -signal.SIGKILL
    finally:
        rank.kill()
        rank.wait()


def test_ranks_still_running_at_the_time_limit_are_killed_and_the_attempt_is_a_timeout(tmp_path: Path) -> None:
    """A rank that never reaches the stop's vote (here: stopped) would run on past `cluster.time` in a pod, where
    nothing else ends it: the supervisor kills the pod's ranks when the limit is up, and pod 0 records
    `timeout` (its budget), not a failure of the node."""
    stop = StopSignals()
    stop.deadline = time.time() + 1.5
    ranks = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    os.kill(ranks[1].pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        codes = wait_ranks(ranks, stop, PodWatch(tmp_path, "local:js-1-0", {}))
        assert codes == [-signal.SIGKILL, -signal.SIGKILL] and stop.killed_at_limit
        assert 1.0 < time.monotonic() - started < 20
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    job = compose_job("+experiment=rec", "cluster=kubernetes", "cluster.volume.claim=c",
                      f"cluster.volume.mount_path={tmp_path}", "container=podman", "container.image=x",
                      "cluster.max_timeouts=1")
    place = read_place({"GPUJOBS_NNODES": "1", "JOB_COMPLETION_INDEX": "0", "GPUJOBS_RANKS_PER_NODE": "2",
                        "MASTER_PORT": "29500", "MASTER_ADDR": "js-node-0-0.js", "GPUJOBS_JOBSET": "js"})
    code = record_node0(job, AttemptLog(tmp_path), 0, time.time() - 2, codes, place, timed_out=True)
    (line,) = AttemptLog(tmp_path).read()
    assert (line.reason, line.requeue, code) == ("timeout", True, EXIT_REQUEUED), line
    assert "time limit (cluster.time) was up" in (line.error or "") and line.node is None, line


def test_run_dir_held_by_another_jobset_stands_down(tmp_path: Path) -> None:
    """A second JobSet on a run dir that another one holds leaves it alone: one line, exit 2, no rank started."""
    jobset = JobSet(tmp_path)
    other = lease.Lease("kubernetes", "elsewhere", 1, "default/rec-00000000", time.time())
    lease.acquire(jobset.run_dir, other)
    proc = subprocess.run(jobset.container["command"], cwd=jobset.container["workingDir"], env=jobset.pod_env(1, 0),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_BAD_INPUT, proc.stdout + proc.stderr
    assert "in use by JobSet default/rec-00000000" in proc.stderr and "stands down" in proc.stderr, proc.stderr
    assert lease.read(jobset.run_dir) == other
    assert not list((jobset.run_dir / "submitit").glob("*"))


@pytest.mark.parametrize(("reason", "max_restarts", "exit_code"), [
    ("completed", 1, 0),  # a rank that crashed at its exit after rank 0 recorded the run complete
    ("failed", 1, 1),  # a counted restart
    ("failed", 0, EXIT_BAD_INPUT),  # the failure budget is spent: the JobSet fails at once
])
def test_a_pod_s_exit_follows_the_attempt_s_ledger_line(tmp_path: Path, reason: str, max_restarts: int,
                                                       exit_code: int) -> None:
    """A pod other than pod 0 whose rank exited 1 exits as the attempt's line says: 0 once the run completed
    (a restart would train it again), else a counted restart, or 2 where no attempt may follow."""
    job = compose_job(f"cluster.max_restarts={max_restarts}")
    ledger = AttemptLog(tmp_path)
    ledger.record(job.cluster, reason, recorded_by="rank 0", world_size=4, start=round(time.time() - 5, 3))
    assert other_pod_exit(ledger, 0, [0, 1]) == exit_code

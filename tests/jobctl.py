"""Drive a running job from a test the way an operator would: watch its metrics, signal its ranks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, ClassVar


class RunningJob:
    """`python -m gpujobs.submit ...` started in the background, its output going to a file.

    A job still running when its test ends is killed with its processes, and its Slurm job cancelled
    (tests/conftest.py): a test that failed or timed out never leaves the shared cluster busy.
    """

    started: ClassVar[list[RunningJob]] = []

    def __init__(self, run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> None:
        RunningJob.started.append(self)
        self.env = {**os.environ, **(env or {})}
        self.run_dir = run_dir
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = run_dir.parent / f"{run_dir.name}.submit.log"
        self._log: IO[str] = open(self.log_path, "w")  # noqa: SIM115 (closed in wait)
        cmd = [sys.executable, "-m", "gpujobs.submit", f"hydra.run.dir={run_dir}", *overrides]
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, text=True,
            env={**self.env, "PYTHONUNBUFFERED": "1"}, preexec_fn=_as_from_a_terminal,
        )

    def output(self) -> str:
        """Everything the submitter printed so far."""
        return self.log_path.read_text()

    def wait_for_step(self, step: int, timeout: float = 120) -> int:
        """Block until rank 0 has logged `step` or later; returns the step seen."""
        deadline = time.monotonic() + timeout
        metrics = self.run_dir / "metrics.jsonl"
        while time.monotonic() < deadline:
            if metrics.exists():
                lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]
                steps = [line["step"] for line in lines if isinstance(line.get("step"), int)]
                if steps and max(steps) >= step:
                    return max(steps)
            if self.proc.poll() is not None:
                raise AssertionError(f"job ended before step {step}:\n{self.output()}")
            time.sleep(0.05)
        raise AssertionError(f"no step {step} within {timeout}s:\n{self.output()}")

    def local_rank_pids(self) -> dict[int, int]:
        """rank → pid of the ranks of the local job's current attempt (children of its controller)."""
        controllers = re.findall(r"submitit job (\d+)", self.output())
        assert controllers, self.output()
        controller = controllers[-1]
        ranks = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if stat.read_text().rsplit(")", 1)[1].split()[1] != controller:
                    continue
                environ = (stat.parent / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError):
                continue
            for item in environ:
                if item.startswith(b"SUBMITIT_LOCAL_GLOBALID="):
                    ranks[int(item.split(b"=", 1)[1])] = int(stat.parent.name)
        return ranks

    def signal_rank(self, rank: int, signum: int = signal.SIGKILL) -> None:
        """Send `signum` to one rank of the local job."""
        pids = self.local_rank_pids()
        assert rank in pids, pids
        os.kill(pids[rank], signum)

    def wait(self, timeout: float = 240) -> int:
        """The submitter's exit code."""
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close()

    def freeze(self) -> list[int]:
        """SIGSTOP every rank of the local job (its training stops where it is); returns their pids."""
        pids = list(self.local_rank_pids().values())
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return pids

    @staticmethod
    def thaw(pids: list[int]) -> None:
        """SIGCONT the ranks that `freeze` stopped."""
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def kill(self) -> None:
        """End the submitter and everything it started, and cancel the Slurm jobs it queued."""
        from gpujobs.attempt.evidence import descendants, kill_tree

        if self.proc.poll() is None:
            kill_tree([*descendants(self.proc.pid), self.proc.pid])
        for job_id in set(re.findall(r"submitted Slurm job (\d+)", self.output())):
            subprocess.run(["scancel", job_id], env=self.env, capture_output=True, timeout=30, check=False)
        self._log.close()


def _as_from_a_terminal() -> None:
    """SIGINT as a user's shell leaves it: a test run in the background (`pytest &`, as scripts/test.sh
    runs one) inherits it ignored, and so would every job it starts."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def attempts(run_dir: Path) -> list[dict[str, Any]]:
    """The run's attempts.jsonl."""
    return [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]


def killed_and_resumed(run_dir: Path, *overrides: str, step: int, steps: int) -> dict[str, Any]:
    """A local run of `overrides` (`steps` steps, a checkpoint at `step`) whose rank 1 is SIGKILLed once it
    logged the step after `step`, restarted once from that checkpoint: it ends 0 with a failed attempt and a
    completed one that resumed from the first's save; its result."""
    job = RunningJob(run_dir, *overrides, "cluster.max_restarts=1")
    job.wait_for_step(step + 1)  # logged after checkpoint `step` is complete
    job.signal_rank(1, signal.SIGKILL)
    assert job.wait() == 0, job.output()
    ledger = attempts(run_dir)
    assert [a["reason"] for a in ledger] == ["failed", "completed"], ledger
    assert ledger[1]["resumed_from"] == ledger[0]["saved"] and step <= ledger[1]["start_step"] < steps, ledger
    result: dict[str, Any] = json.loads((run_dir / "result.json").read_text())
    return result


def slurm_rank_pids(job_id: str) -> dict[int, int]:
    """rank → pid of the job's ranks (`python -m gpujobs.rank.srun`; this cluster's nodes are this machine)."""
    ranks = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
            # a rank runs `python -u -m gpujobs.rank.srun`; the supervisor names it only after its own module
            module = args[args.index(b"-m") + 1] if b"-m" in args else b""
            if not (Path(args[0].decode()).name.startswith("python") and module == b"gpujobs.rank.srun"):
                continue
            environ = dict(item.split(b"=", 1) for item in (proc / "environ").read_bytes().split(b"\0") if b"=" in item)
        except (OSError, IndexError, UnicodeDecodeError):
            continue
        if environ.get(b"SLURM_JOB_ID") == job_id.encode() and b"SLURM_PROCID" in environ:
            ranks[int(environ[b"SLURM_PROCID"])] = int(proc.name)
    return ranks

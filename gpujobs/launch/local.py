"""`cluster=local`: the same job as processes on this machine, through submitit's local executor.

One process per GPU with NCCL where there are GPUs, else `procs_per_node` CPU processes with gloo.
The launcher stays in the foreground, shows rank 0's progress, and restarts the job from its last
checkpoint after a failure, up to `cluster.max_restarts` times.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from gpujobs.config import JobConfig
from gpujobs.errors import ConfigError
from gpujobs.progress import ProgressView
from gpujobs.run.entry import METRICS_FILE, RESULT_FILE, TrainJob

_POLL_S = 0.25


def check_local_resources(job: JobConfig, gpus_here: int) -> None:
    """Refuse what this machine cannot give, before anything starts."""
    res = job.resources
    if res.nodes != 1:
        raise ConfigError("resources.nodes", res.nodes, "1 with cluster=local (use cluster=slurm for more nodes)")
    if res.gpus_per_node > gpus_here:
        hint = (
            "0: this machine has no NVIDIA GPU "
            "(use resources.gpus_per_node=0 with resources.procs_per_node=N for CPU ranks)"
            if gpus_here == 0
            else f"0..{gpus_here} (GPUs on this machine)"
        )
        raise ConfigError("resources.gpus_per_node", res.gpus_per_node, hint)


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class MetricsFollower:
    """Reads the records rank 0 appends to metrics.jsonl, as they arrive."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def poll(self) -> Iterator[dict[str, Any]]:
        """New complete lines since the last call."""
        if not self.path.exists():
            return
        with open(self.path) as handle:
            handle.seek(self._offset)
            while True:
                line = handle.readline()
                if not line.endswith("\n"):  # a half-written line: read it next time
                    break
                self._offset += len(line.encode())
                yield json.loads(line)


def run_local(job: JobConfig, run_dir: Path) -> int:
    """Run the job here (resources already checked by `check_local_resources`); 0 when it completed."""
    import submitit  # lazily: keeps `--help` and validation fast

    res = job.resources
    executor = submitit.LocalExecutor(folder=run_dir / job.cluster.folder)
    executor.update_parameters(
        nodes=1,
        tasks_per_node=res.ranks_per_node,
        gpus_per_node=res.gpus_per_node,
        timeout_min=job.cluster.timeout_min,
        signal_delay_s=job.cluster.signal_lead_s,
    )
    backend = "nccl" if res.gpus_per_node else "gloo"
    view = ProgressView(job.trainer.max_steps, job.name, enabled=job.trainer.progress)
    follower = MetricsFollower(run_dir / METRICS_FILE)
    try:
        for attempt in range(job.cluster.max_restarts + 1):
            sjob = executor.submit(TrainJob(job, str(run_dir), master_port=free_port()))
            print(
                f"gpujobs: local job {sjob.job_id} (attempt {attempt + 1}): {res.ranks_per_node} ranks, "
                f"{backend}, run dir {run_dir}",
                flush=True,
            )
            error = _follow(sjob, follower, view)
            if error is None:
                _print_result(run_dir)
                return 0
            if attempt < job.cluster.max_restarts:
                print(f"gpujobs: attempt {attempt + 1} failed ({error}); restarting from the last checkpoint")
            else:
                print(f"gpujobs: job failed: {error}\ngpujobs: per-rank logs in {executor.folder}")
        return 1
    finally:
        view.close()


def _follow(sjob: Any, follower: MetricsFollower, view: ProgressView) -> Optional[str]:
    """Show progress until the job ends; None on success, else the first line of the failure."""
    import submitit

    try:
        while not sjob.done():
            for record in follower.poll():
                view.update(record)
            time.sleep(_POLL_S)
        for record in follower.poll():
            view.update(record)
        sjob.results()
        return None
    except KeyboardInterrupt:
        sjob.cancel()
        raise
    except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as err:
        lines = [line for line in str(err).splitlines() if line.strip()]
        return lines[-1] if lines else type(err).__name__


def _print_result(run_dir: Path) -> None:
    path = run_dir / RESULT_FILE
    result = json.loads(path.read_text())
    keys = ("status", "steps", "world_size", "auc", "oracle_auc", "samples_per_s")
    shown = {k: result[k] for k in keys if k in result}
    print("gpujobs: " + " ".join(f"{k}={v}" for k, v in shown.items()))
    print(f"gpujobs: result in {path}")

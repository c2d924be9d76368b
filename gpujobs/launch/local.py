"""`cluster=local`: the same job as processes on this machine, through submitit's local executor.

One process per GPU with NCCL where there are GPUs, else `procs_per_node` CPU processes with gloo.
The launcher stays in the foreground, shows rank 0's progress, and restarts the job from its last
checkpoint after a failure, up to `cluster.max_restarts` times.
"""

from __future__ import annotations

import socket
from pathlib import Path

from gpujobs.config import JobConfig
from gpujobs.errors import ConfigError
from gpujobs.launch.follow import JobFollower
from gpujobs.launch.payload import make_payload


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
        visible_gpus=gpus,
        timeout_min=job.cluster.timeout_min,
        signal_delay_s=job.cluster.signal_lead_s,
    )
    backend = "nccl" if res.gpus_per_node else "gloo"
    with JobFollower(run_dir, job) as follower:
        for attempt in range(job.cluster.max_restarts + 1):
            sjob = executor.submit(make_payload(job, run_dir, master_port=free_port()))
            print(
                f"gpujobs: local job {sjob.job_id} (attempt {attempt + 1}): {res.ranks_per_node} ranks, "
                f"{backend}{f' on GPUs {gpus}' if gpus else ''}, run dir {run_dir}",
                flush=True,
            )
            error = follower.follow(sjob)
            if error is None:
                return 0
            if attempt < job.cluster.max_restarts:
                print(f"gpujobs: attempt {attempt + 1} failed ({error}); restarting from the last checkpoint")
            else:
                print(f"gpujobs: job failed: {error}\ngpujobs: per-rank logs in {executor.folder}")
        return 1

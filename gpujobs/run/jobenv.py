"""Who am I in the job: rank, world and rendezvous from torchrun's, submitit's or Slurm's environment.

On Slurm the world is what the allocation gave, never what the config asked for: an elastic job
(`--nodes=MIN-MAX`) may start on any node count in its range. Seen on Slurm 22.05 for `--nodes=1-2
--ntasks-per-node=2` with one node free: SLURM_NTASKS=2, SLURM_JOB_NUM_NODES=1, SLURM_STEP_TASKS_PER_NODE=2
in each task (and 4, 2, `2(x2)` with both free); the batch step sees SLURM_NTASKS=2 (4) as well.

Torch-free, so that a bring-your-own-script job (which leaves torch to the user's script), the batch
step's supervisor and the submit side can use it.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Optional

# Ports a Slurm job's rendezvous may use; derived from the job id so that two jobs sharing
# a node do not pick the same one (ids differ, so their ports differ unless ids collide mod range).
_PORT_BASE, _PORT_RANGE = 20000, 30000


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    node: str

    @property
    def is_main(self) -> bool:
        """Rank 0 writes every shared file."""
        return self.rank == 0


def port_for_job(job_id: str) -> int:
    """A rendezvous port that is a pure function of the job id."""
    digits = "".join(ch for ch in job_id if ch.isdigit()) or "0"
    return _PORT_BASE + int(digits) % _PORT_RANGE


def node_name() -> str:
    """The node's name; SLURMD_NODENAME first, since several fake nodes may share one host."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def in_slurm_task(env: Optional[dict[str, str]] = None) -> bool:
    """Whether this process is a task of a gpujobs Slurm job's step (the sbatch script exports
    SUBMITIT_EXECUTOR=slurm; srun gives each task its SLURM_PROCID)."""
    env = dict(os.environ) if env is None else env
    return env.get("SUBMITIT_EXECUTOR") == "slurm" and "SLURM_PROCID" in env and "SLURM_STEP_ID" in env


def tasks_per_node(value: str) -> list[int]:
    """The per-node task counts of a Slurm `*_TASKS_PER_NODE` value such as `2(x3),1` (`(xN)` repeats a
    count for N nodes)."""
    counts: list[int] = []
    for item in value.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise ValueError(f"not a Slurm tasks-per-node value: {value!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def tasks_on_node(value: str, node_id: int) -> int:
    """Tasks on node `node_id` of a Slurm `*_TASKS_PER_NODE` value."""
    counts = tasks_per_node(value)
    if not 0 <= node_id < len(counts):
        raise ValueError(f"node {node_id} is not among the {len(counts)} nodes of {value!r}")
    return counts[node_id]


def allocated_world_size(env: Optional[dict[str, str]] = None) -> Optional[int]:
    """Ranks of the job this process belongs to, as its environment says, or None where it cannot say.

    In a Slurm job (a task, or the batch step beside them) what the allocation gave (an elastic job's
    varies between attempts): SLURM_NTASKS, or the sum of SLURM_TASKS_PER_NODE where a batch step has
    no SLURM_NTASKS (a job that set no task count: one task per node); elsewhere torchrun's WORLD_SIZE,
    then submitit's local one.
    """
    env = dict(os.environ) if env is None else env
    if "SLURM_JOB_ID" in env and env.get("SUBMITIT_EXECUTOR") != "local":
        if env.get("SLURM_NTASKS", "").isdigit():
            return int(env["SLURM_NTASKS"])
        if env.get("SLURM_TASKS_PER_NODE"):
            return sum(tasks_per_node(env["SLURM_TASKS_PER_NODE"]))
    for key in ("WORLD_SIZE", "SUBMITIT_LOCAL_NTASKS"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return None


def detect(master_port: Optional[int] = None) -> DistInfo:
    """Read the job environment: a gpujobs Slurm task takes its place from the allocation (a stray
    RANK/WORLD_SIZE exported by the submitting shell must not override it); otherwise torchrun-style
    variables win, then submitit's, else one process."""
    env = os.environ
    if in_slurm_task(dict(env)):
        return _from_submitit(master_port, local=False)
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return DistInfo(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=world,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", str(master_port or 29500))),
            node=node_name(),
        )
    if "SUBMITIT_LOCAL_JOB_ID" in env or "SLURM_JOB_ID" in env:
        return _from_submitit(master_port, local="SUBMITIT_LOCAL_JOB_ID" in env)
    return DistInfo(0, 0, 1, 1, "127.0.0.1", master_port or 29500, node_name())


def _from_submitit(master_port: Optional[int], *, local: bool) -> DistInfo:
    """The place submitit's JobEnvironment reads (Slurm: SLURM_PROCID, SLURM_NTASKS, SLURM_JOB_NODELIST)."""
    import submitit

    job_env = submitit.JobEnvironment()
    return DistInfo(
        rank=job_env.global_rank,
        local_rank=job_env.local_rank,
        world_size=job_env.num_tasks,
        local_world_size=_local_world_size(job_env.num_tasks, job_env.num_nodes, job_env.node),
        master_addr="127.0.0.1" if local else job_env.hostnames[0],
        master_port=master_port if master_port else port_for_job(job_env.job_id),
        node=node_name(),
    )


def _local_world_size(num_tasks: int, num_nodes: int, node_id: int) -> int:
    """Tasks on this node: Slurm's per-node counts of the step where it gives them (a step need not
    spread evenly), else an even share."""
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if os.environ.get(key):
            return tasks_on_node(os.environ[key], node_id)
    return num_tasks // max(num_nodes, 1)


def export_torchrun_env(info: DistInfo) -> None:
    """Set RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* so code written for torchrun runs unchanged."""
    os.environ.update(
        RANK=str(info.rank),
        LOCAL_RANK=str(info.local_rank),
        WORLD_SIZE=str(info.world_size),
        LOCAL_WORLD_SIZE=str(info.local_world_size),
        MASTER_ADDR=info.master_addr,
        MASTER_PORT=str(info.master_port),
    )

"""Who am I in the job: rank, world and rendezvous from torchrun's, submitit's or Slurm's environment.

Torch-free, so that a bring-your-own-script job (which leaves torch to the user's script) and the
submit side can use it.
"""

from __future__ import annotations

import os
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


def detect(master_port: Optional[int] = None) -> DistInfo:
    """Read the job environment: torchrun-style variables win, then submitit's, else one process."""
    env = os.environ
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
        import submitit

        job_env = submitit.JobEnvironment()
        local = "SUBMITIT_LOCAL_JOB_ID" in env
        return DistInfo(
            rank=job_env.global_rank,
            local_rank=job_env.local_rank,
            world_size=job_env.num_tasks,
            local_world_size=job_env.num_tasks // job_env.num_nodes,
            master_addr="127.0.0.1" if local else job_env.hostnames[0],
            master_port=master_port if master_port else port_for_job(job_env.job_id),
            node=node_name(),
        )
    return DistInfo(0, 0, 1, 1, "127.0.0.1", master_port or 29500, node_name())


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

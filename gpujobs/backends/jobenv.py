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
import random
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# A Slurm job's rendezvous ports, derived from its job id: rank 0 listens on the first unless its node
# has it taken, then on the second; the other ranks, which cannot ask, look at both. Both ranges lie
# outside Linux's default ephemeral range (32768-60999), where a connection going out could take the port
# before rank 0 listens on it; the second range is no job's first choice, so a retry takes no job's port.
# Ranges of prime size: two plain jobs share a first port only when their ids are a multiple of it apart.
_FIRST_BASE, _FIRST_RANGE = 20000, 12763  # 20000-32762
_SECOND_BASE, _SECOND_RANGE = 61000, 4523  # 61000-65522
# An array task's port moves by this much per array id and by one per task id: chosen (by search) so that
# the tasks of arrays whose ids are close together stay apart: 10 consecutive ids with up to 878 tasks
# each, or 100 with up to 107 tasks each, never share a first port (tests/test_rendezvous.py counts them).
_ARRAY_STRIDE = 2377
# A local job's port (`free_port`): a range of its own, below the Slurm ranges and the ephemeral range, so a
# local job on a node never takes the port a Slurm job there derives, nor a Slurm job the local job's.
_LOCAL_BASE, _LOCAL_RANGE = 10000, 10000  # 10000-19999
EPHEMERAL_PORTS_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


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
    rendezvous: Optional[Rendezvous] = None
    """How the ranks meet when gpujobs runs them; None under torchrun, whose agent (or torch's env://) does it."""

    @property
    def is_main(self) -> bool:
        """Rank 0 writes every shared file."""
        return self.rank == 0


@dataclass(frozen=True)
class Rendezvous:
    """Where a gpujobs job's ranks meet: rank 0 hosts the store, the others find it."""

    ports: tuple[int, ...]
    """Rank 0 listens on the first of these it can bind; the others try each in turn."""
    listen_addr: str
    """The address rank 0's store listens on: 127.0.0.1 for a local job, so that no other host reaches it;
    "" (every interface) where ranks on other nodes must."""
    key: str
    """What rank 0 sets in its store first: a store on one of the ports without it is another job's."""


def rendezvous_ports(job_id: str) -> tuple[int, int]:
    """A Slurm job's first and second rendezvous ports, pure functions of its submitit id ("JOB" or
    "ARRAY_TASK"), so that every rank derives them without asking (see `_FIRST_BASE`)."""
    match = re.fullmatch(r"(\d+)(?:_(\d+))?", job_id)
    if match is None:
        raise ValueError(f"not a Slurm job id (JOB or ARRAY_TASK): {job_id!r}")
    spread = int(match.group(1)) * _ARRAY_STRIDE + int(match.group(2) or 0)
    return _FIRST_BASE + spread % _FIRST_RANGE, _SECOND_BASE + spread % _SECOND_RANGE


def port_for_job(job_id: str) -> int:
    """The rendezvous port a Slurm job's rank 0 tries first (`rendezvous_ports`)."""
    return rendezvous_ports(job_id)[0]


def ephemeral_ports() -> range:
    """The ports this node's kernel hands to connections going out (ip_local_port_range)."""
    low, high = EPHEMERAL_PORTS_FILE.read_text().split()
    return range(int(low), int(high) + 1)


def free_port() -> int:
    """A port nobody listens on right now, for a local job's ranks, from the local range: outside the ephemeral
    range, a connection going out cannot take it before the rank that was handed it listens on it, and outside
    the Slurm ranges, no Slurm job on this node derives it."""
    for port in random.sample(range(_LOCAL_BASE, _LOCAL_BASE + _LOCAL_RANGE), 64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port among 64 tried in {_LOCAL_BASE}-{_LOCAL_BASE + _LOCAL_RANGE - 1}")


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
    ports = (master_port,) if master_port else rendezvous_ports(job_env.job_id)
    # a requeued Slurm job keeps its id: the attempt in the key keeps its ranks off a store left by the last
    attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
    return DistInfo(
        rank=job_env.global_rank,
        local_rank=job_env.local_rank,
        world_size=job_env.num_tasks,
        local_world_size=_local_world_size(job_env.num_tasks, job_env.num_nodes, job_env.node),
        master_addr="127.0.0.1" if local else job_env.hostnames[0],
        master_port=ports[0],
        node=node_name(),
        rendezvous=Rendezvous(ports, "127.0.0.1" if local else "", f"gpujobs/{job_env.job_id}/{attempt}"),
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

"""Sick nodes leave the job: the node a hang or a failed health check is blamed on is excluded from the
requeued Slurm job (torch-free: rank 0 and the batch-step supervisor both use it).

How Slurm 22.05 takes it (seen on the test cluster): `scontrol update JobId=J ExcNodeList=...` on the
running job is refused ("Job is no longer pending execution"); right after `scontrol requeue`, while
the job completes, it is taken, and the requeued job starts on the other nodes (it cannot start again
before cred_expire has passed, so it never starts with the old list). The list given replaces the
job's: it holds `cluster.exclude`, every node earlier attempts of the job excluded, and this one.

It never excludes so many nodes that the job no longer fits its partition (`resources.least_nodes`
nodes must be left): then the job is not requeued and says why in one line (`plan`). A node that
cannot be excluded (Slurm's commands fail) is said in the attempt's line; the job still goes again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from gpujobs.backends.slurm.commands import SlurmCommandError, slurm_output

#: What each blaming reason is called in the refusal line.
_AFTER = {"hung": "a hang", "unhealthy": "a failed health check", "failed": "a crash"}


@dataclass(frozen=True)
class Exclusion:
    """What to do with the node an attempt blamed: the job's whole exclude list from now on, or why not."""

    excluded: list[str]
    """Every node the job excludes: the earlier ones, then this attempt's node."""
    refused: Optional[str] = None
    """Why the node may not be excluded (the job would no longer fit): then the job stops."""


def plan(
    node: str, reason: str, partition: str, partition_nodes: Sequence[str], excluded: Sequence[str], least_nodes: int
) -> Exclusion:
    """Exclude `node` (blamed for `reason`) on top of `excluded`, unless fewer than `least_nodes` nodes
    of `partition` (whose nodes are `partition_nodes`) would be left. A pure function."""
    whole = [*dict.fromkeys([*excluded, node])]
    left = [n for n in dict.fromkeys(partition_nodes) if n not in whole]
    if len(left) >= least_nodes:
        return Exclusion(whole)
    rest = f"only {', '.join(left)} {'is' if len(left) == 1 else 'are'} left" if left else "no node is left"
    needs = f"{least_nodes} node{'s' if least_nodes != 1 else ''}"
    why = f"{node} excluded after {_AFTER.get(reason, reason)}: {rest} in partition {partition}, the job needs {needs}"
    return Exclusion(list(dict.fromkeys(excluded)), refused=why)


def partition_nodes(partition: str) -> list[str]:
    """Every node of `partition`, by name (sinfo expands the host list); raises SlurmCommandError."""
    out = slurm_output(["sinfo", "--noheader", "--Node", "--format=%N", f"--partition={partition}"])
    return [*dict.fromkeys(line.strip() for line in out.splitlines() if line.strip())]


def expand_hostlist(hostlist: Optional[str]) -> list[str]:
    """The node names of a Slurm host list such as `node[3-4],gpu7` (`cluster.exclude`); raises SlurmCommandError."""
    if not hostlist:
        return []
    out = slurm_output(["scontrol", "show", "hostnames", hostlist])
    return [line.strip() for line in out.splitlines() if line.strip()]


def exclude(job_id: str, nodes: Sequence[str]) -> Optional[str]:
    """Set the job's exclude list to `nodes` (call it right after `scontrol requeue`, see above); None
    once done, else what went wrong."""
    try:
        slurm_output(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"])
    except SlurmCommandError as err:
        return str(err)
    return None

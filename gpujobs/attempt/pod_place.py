"""Where a pod stands in its JobSet, from the environment the JobSet renders (`jobset.pod_env`) and the Job
controller adds (the pod's index); a missing or bad value is refused in one line naming it (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gpujobs.backends.kubernetes import jobset as js
from gpujobs.base.errors import ConfigError
from gpujobs.config.load import JobConfig

#: What the Job controller sets in every pod of an Indexed Job: the pod's index (here: its node rank).
INDEX_ENV = "JOB_COMPLETION_INDEX"


@dataclass(frozen=True)
class PodPlace:
    """Where this pod stands in its JobSet, from its environment."""

    index: int
    nodes: int
    per_node: int
    master_addr: str
    master_port: int
    jobset: str
    restart: int
    submission: int

    @property
    def world(self) -> int:
        """Ranks of the job: every pod's."""
        return self.nodes * self.per_node

    @property
    def attempt_id(self) -> str:
        """This attempt's submitit job id, the same in every pod of it and in no other attempt of the run dir:
        the JobSet, its submission (a resubmitted JobSet has the same name) and its restart."""
        return f"{self.jobset}-{self.submission}-{self.restart}"

    def global_rank(self, local: int) -> int:
        """Local rank `local`'s rank in the job."""
        return self.index * self.per_node + local

    def rank_env(self, local: int) -> dict[str, str]:
        """Local rank `local`'s place, for submitit's local environment and torchrun's variables."""
        rank = self.global_rank(local)
        return {
            "SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": self.attempt_id,
            "SUBMITIT_LOCAL_NTASKS": str(self.world), "SUBMITIT_LOCAL_JOB_NUM_NODES": str(self.nodes),
            "SUBMITIT_LOCAL_NODEID": str(self.index), "SUBMITIT_LOCAL_GLOBALID": str(rank),
            "SUBMITIT_LOCAL_LOCALID": str(local),
            "RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(self.world),
            "LOCAL_WORLD_SIZE": str(self.per_node), "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def _count(env: dict[str, str], key: str, least: int, most: Optional[int] = None, default: Optional[str] = None) -> int:
    """Integer `env[key]` in [least, most]; ConfigError naming the key, the value and what is allowed."""
    value = env.get(key, default)
    allowed = f"an integer from {least}{f' to {most}' if most is not None else ''} (the pod's environment)"
    if value is None or not value.strip().isdigit():
        raise ConfigError(key, value, allowed)
    number = int(value)
    if number < least or (most is not None and number > most):
        raise ConfigError(key, value, allowed)
    return number


def read_place(env: dict[str, str]) -> PodPlace:
    """The pod's place from `env`; ConfigError (one line) for the first value missing or out of range."""
    nodes = _count(env, js.NNODES_ENV, 1)
    index = _count(env, INDEX_ENV, 0, nodes - 1)
    per_node = _count(env, js.RANKS_PER_NODE_ENV, 1)
    port = _count(env, "MASTER_PORT", 1, 65535)
    restart = _count(env, js.RESTART_ENV, 0, default="0")
    submission = _count(env, js.SUBMISSION_ENV, 1, default="1")  # a JobSet rendered before it was said
    for key in ("MASTER_ADDR", js.JOBSET_ENV):
        if not env.get(key, "").strip():
            raise ConfigError(key, env.get(key), "a host name (the pod's environment, as the JobSet renders it)")
    name = env[js.JOBSET_ENV]
    if not all(c.isalnum() or c == "-" for c in name):
        raise ConfigError(js.JOBSET_ENV, name, "a JobSet's name: a DNS label")
    return PodPlace(index, nodes, per_node, env["MASTER_ADDR"], port, name, restart, submission)


def check_shape(job: JobConfig, place: PodPlace) -> None:
    """The pod's environment and the run dir's config say the same allocation (a JobSet edited by hand, or
    rendered for another run dir, would train another world size)."""
    res = job.resources
    for key, value, config_key, wanted in ((js.NNODES_ENV, place.nodes, "resources.nodes", res.nodes),
                                           (js.RANKS_PER_NODE_ENV, place.per_node, "ranks a node", res.ranks_per_node)):
        if value != wanted:
            raise ConfigError(key, str(value), f"{wanted}, the run dir's {config_key}")

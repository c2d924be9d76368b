"""Slurm's own accounting of the jobs that ran a run dir (submit side, torch-free): their states for
`gpujobs status` (`job_states`) and their allocations for `gpujobs cost` (`allocations`).

One `sacct` call covers every Slurm job of every point (`run_sacct`). For the allocations: allocations
only (`-X`), every requeued instance of a job (`--duplicates`: a requeued job keeps its id and gets one
record per instance), each with its start and end (epoch seconds, through `SLURM_TIME_FORMAT=%s`, so no
local-time parsing), its elapsed seconds and its allocated TRES. Slurm keeps these times in whole
seconds, truncated: each is taken at the middle of its second, so that what is measured against them
(the launch before the ranks, the teardown after) is not biased.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Optional

from gpujobs.backends.base import Allocation
from gpujobs.backends.slurm.commands import slurm_output

#: States after which a job will not run again by itself.
FINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                   "DEADLINE", "PREEMPTED"})
#: States `resubmit --failed` brings back (CANCELLED only with --cancelled: cancelling was a choice).
FAILED = frozenset({"FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"})
#: A pending (or never started) part of an array, as sacct lists it: `JOBID_[4-999]`, `JOBID_[1,3,5-7%2]`.
_ARRAY_RANGE = re.compile(r"^(\d+)_\[([0-9,\-]+)(?:%\d+)?\]$")
#: What `allocations` asks sacct for, in this order.
FIELDS = ("JobID", "State", "Start", "End", "ElapsedRaw", "AllocTRES")


def tres_counts(tres: str) -> tuple[int, int]:
    """(GPUs, CPUs) of an AllocTRES string such as `billing=2,cpu=2,gres/gpu=2,mem=4000M,node=1`.

    Typed GPUs (`gres/gpu:a100=2`) count where no untyped total is given (Slurm lists both when it
    tracks the types).
    """
    values: dict[str, str] = {}
    for item in tres.split(","):
        key, sep, value = item.partition("=")
        if sep and value.isdigit():
            values[key] = value
    if "gres/gpu" in values:
        gpus = int(values["gres/gpu"])
    else:
        gpus = sum(int(value) for key, value in values.items() if key.startswith("gres/gpu:"))
    return gpus, int(values.get("cpu", "0"))


def parse_allocations(text: str) -> list[Allocation]:
    """`sacct -P -o JobID,State,Start,End,ElapsedRaw,AllocTRES` lines (times as epoch seconds) to
    allocations; an instance that never started (pending, cancelled while pending) holds nothing and
    is left out."""
    found = []
    for line in text.splitlines():
        cells = line.split("|")
        if len(cells) != len(FIELDS):
            continue
        job_id, state, start, end, elapsed, tres = cells
        if not (start.isdigit() and elapsed.isdigit()):  # Start "Unknown" / "None": never ran
            continue
        gpus, cpus = tres_counts(tres)
        began, held = float(start) + 0.5, float(elapsed)
        found.append(Allocation(
            job_id, state.split()[0] if state.strip() else "?", began,
            float(end) + 0.5 if end.isdigit() else began + held, held, gpus, cpus,
        ))
    return found


def allocations(job_ids: Sequence[str], timeout_s: float) -> dict[str, list[Allocation]]:
    """Every instance of every job in `job_ids`, oldest first, from one sacct call.

    Raises SlurmCommandError when sacct cannot be asked.
    """
    if not job_ids:
        return {}
    options = ["-X", "--duplicates", "-n", "-P", "-o", ",".join(FIELDS)]
    text = run_sacct(options, job_ids, timeout_s, env={"SLURM_TIME_FORMAT": "%s"})
    wanted = set(job_ids)
    found: dict[str, list[Allocation]] = {}
    for allocation in parse_allocations(text):
        if allocation.job_id in wanted:
            found.setdefault(allocation.job_id, []).append(allocation)
    return {job_id: sorted(items, key=lambda a: a.start) for job_id, items in found.items()}


def run_sacct(options: list[str], job_ids: Sequence[str], timeout_s: float,
              env: Optional[Mapping[str, str]] = None) -> str:
    """One `sacct OPTIONS -j ...` call over the jobs of `job_ids` (an array task's whole array); its
    output ("" without ids). `env` is added to this process's. Raises SlurmCommandError when sacct
    fails or is too slow."""
    mains = sorted({job_id.split("_")[0] for job_id in job_ids})
    if not mains:
        return ""
    return slurm_output(["sacct", *options, "-j", ",".join(mains)], timeout_s=timeout_s, env=env)


def parse_sacct(text: str) -> dict[str, str]:
    """`sacct -X -n -P -o JobID,State` lines to {job id: state}; pending array ranges are expanded.

    An array that never started may also be one bare `JOBID` record (seen when its tasks were cancelled
    one by one before accounting listed them): `sacct_state_of` gives its state to every task.
    """
    states: dict[str, str] = {}
    for line in text.splitlines():
        if "|" not in line:
            continue
        job_id, state = line.split("|", 1)
        state = state.split()[0] if state.strip() else "?"  # "CANCELLED by 0" -> CANCELLED
        match = _ARRAY_RANGE.match(job_id)
        if match is None:
            states[job_id] = state
            continue
        for part in match.group(2).split(","):
            low, _, high = part.partition("-")
            for index in range(int(low), int(high or low) + 1):
                states[f"{match.group(1)}_{index}"] = state
    return states


def sacct_state_of(job_id: str, states: dict[str, str]) -> Optional[str]:
    """What `parse_sacct`'s `states` say of `job_id`, or None when sacct has no record of it.

    A task `JOBID_i` without a record of its own takes the state of a bare `JOBID` record: that
    record stands for the whole array (a started array lists its tasks as `JOBID_i`, never bare).
    """
    if job_id in states:
        return states[job_id]
    array, sep, _ = job_id.partition("_")
    return states.get(array) if sep else None


def job_states(job_ids: Sequence[str], timeout_s: float) -> dict[str, str]:
    """The state of every job of `job_ids` that sacct has a record of, from one call.

    Raises SlurmCommandError when sacct fails or is too slow."""
    states = parse_sacct(run_sacct(["-X", "-n", "-P", "-o", "JobID,State"], job_ids, timeout_s))
    found = {job_id: sacct_state_of(job_id, states) for job_id in job_ids}
    return {job_id: state for job_id, state in found.items() if state is not None}

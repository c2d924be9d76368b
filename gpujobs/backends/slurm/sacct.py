"""Slurm's own accounting of the allocations that ran a run dir (submit side, torch-free).

One `sacct` call covers every Slurm job of every point (`manage.run_sacct`, the call `status` makes
too): allocations only (`-X`), every requeued instance of a job (`--duplicates`: a requeued job keeps
its id and gets one record per instance), each with its start and end (epoch seconds, through
`SLURM_TIME_FORMAT=%s`, so no local-time parsing), its elapsed seconds and its allocated TRES.
Slurm keeps these times in whole seconds, truncated: each is taken at the middle of its second, so
that what is measured against them (the launch before the ranks, the teardown after) is not biased.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpujobs.launch.manage import run_sacct

#: What `allocations` asks sacct for, in this order.
FIELDS = ("JobID", "State", "Start", "End", "ElapsedRaw", "AllocTRES")


@dataclass(frozen=True)
class Allocation:
    """One instance of a Slurm job as accounting records it."""

    job_id: str
    """`JOBID`, or `ARRAYID_TASK` for a task of a job array (as gpujobs records them)."""
    state: str
    """Its state: REQUEUED for every instance but a requeued job's last."""
    start: float
    end: float
    """Epoch seconds (the middle of Slurm's second); for an instance still running, start + elapsed so far."""
    elapsed_s: float
    gpus: int
    """`gres/gpu` of the allocation (0: none)."""
    cpus: int

    @property
    def unit(self) -> str:
        """What the allocation is counted in: `gpu` when it held GPUs, else `cpu`."""
        return "gpu" if self.gpus else "cpu"

    @property
    def units(self) -> int:
        """How many of `unit` it held (over all its nodes)."""
        return self.gpus or self.cpus


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


def allocations(job_ids: list[str], timeout_s: float) -> dict[str, list[Allocation]]:
    """Every instance of every job in `job_ids`, oldest first, from one sacct call.

    Raises `manage.SlurmCommandError` when sacct cannot be asked.
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

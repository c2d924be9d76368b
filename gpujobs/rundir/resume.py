"""Resume only the same run: a checkpoint's config must match the run's in what a step computes (torch-free).

Both sides ask: the submit side before anything starts (exit 2), the job side when it loads a checkpoint
(a recorded failed attempt). Changing how long to train, the cadences, telemetry or placement is fine;
changing the model, the data, the optimizer, the seed, the gradient accumulation or the numerics would
silently continue another run's parameters, so it is refused with the keys named.

The world size may change (elastic resume): the samples of a step are a function of the seed and the
global batch size only. What must stay is the global batch, whether the config states it
(`data.global_batch_size`) or derives it from a per-rank `data.batch_size`; the marker records it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from gpujobs.base.errors import GpujobsError
from gpujobs.config.load import JobConfig
from gpujobs.rundir.marker import Marker, newest_marker

log = logging.getLogger(__name__)

#: Config sections and keys that decide what a training step computes.
COMPUTE_KEYS = (
    "task", "model", "data", "optim",
    "trainer.seed", "trainer.grad_accum", "trainer.grad_clip", "trainer.amp",
)


class ResumeMismatch(GpujobsError):
    """The run dir's checkpoint belongs to a run that computes something else."""


def _leaves(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, inner in value.items():
            out.update(_leaves(inner, f"{prefix}.{key}"))
        return out
    return {prefix: value}


def _pick(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


#: Keys that only size the global batch: compared through the global batch they give, not one by one.
BATCH_KEYS = ("data.batch_size", "data.global_batch_size")


def global_batch_of(job: JobConfig, world_size: Optional[int] = None) -> Optional[int]:
    """The global batch (samples per step) of `job` at `world_size` (default: the configured one), when
    its data config can say (`global_batch(world_size, micro_batches)`, as the rec job's does)."""
    sizer = getattr(job.data, "global_batch", None)
    if sizer is None:
        return None
    return int(sizer(world_size or job.resources.world_size, job.trainer.grad_accum))


def differences(saved: dict[str, Any], current: dict[str, Any], skip: tuple[str, ...] = ()) -> list[str]:
    """The compute keys whose values differ, as `key (saved -> current)`, sorted (`skip`: leaves not compared)."""
    changed = []
    for key in COMPUTE_KEYS:
        old, new = _leaves(_pick(saved, key), key), _leaves(_pick(current, key), key)
        for leaf in sorted(set(old) | set(new)):
            if leaf in skip:
                continue
            if old.get(leaf) != new.get(leaf):
                changed.append(f"{leaf} ({old.get(leaf)!r} -> {new.get(leaf)!r})")
    return changed


def check_same_run(marker: Marker, job: JobConfig, where: str, global_batch: Optional[int] = None) -> None:
    """Raise ResumeMismatch when the checkpoint of `marker` is of another run.

    `global_batch`: the resuming run's samples per step (the job side knows it from its task; the submit
    side derives it from the data config where it can).
    """
    saved = marker.run.config
    if saved is None:
        return  # a marker of an older gpujobs: nothing to compare
    # what the data config says changes no step (how many processes prepare its store, say)
    ignored = tuple(f"data.{key}" for key in getattr(job.data, "SAME_RUN_IGNORES", ()))
    saved_batch = marker.run.global_batch_size
    if saved_batch is None:  # an older marker: the world size and the per-rank batch must match as they were
        changed = differences(saved, job.to_dict(), skip=ignored)
        saved_world = marker.world_size
        if saved_world is not None and saved_world != job.resources.world_size:
            changed.append(f"world size ({saved_world} -> {job.resources.world_size})")
    else:
        changed = differences(saved, job.to_dict(), skip=BATCH_KEYS + ignored)
        batch = global_batch if global_batch is not None else global_batch_of(job)
        if batch is not None and batch != saved_batch:
            changed.append(
                f"the global batch ({saved_batch} -> {batch} samples per step; to resume at another world size "
                f"keep it with data.global_batch_size={saved_batch})"
            )
    if changed:
        raise ResumeMismatch(
            f"{where} was trained with other values of {', '.join(changed)}: a run dir resumes only the same run; "
            "use a new run dir (hydra.run.dir=...) or set the keys back"
        )


class NoPlanHistory(GpujobsError):
    """`trainer.balance_replay` names a run dir whose checkpoints record no split-plan history to replay."""


def plan_history(run_dir: Path) -> list[dict[str, Any]]:
    """The split-plan history that the finished `trainer.balance=dynamic` run in `run_dir` recorded in its newest
    checkpoint's marker: what `trainer.balance=replay` follows, read here without torch so that the submit side
    refuses a run dir without one before anything is queued (`NoPlanHistory`, saying why), and the job side
    reads it the same way."""
    found = newest_marker(run_dir)
    if found is None:
        raise NoPlanHistory("it holds no checkpoint with a plan history")
    path, marker = found
    history = marker.run.balance.history if marker.run.balance is not None else []
    entries = [entry for entry in history if _is_plan(entry)]
    if not entries:
        raise NoPlanHistory(f"its newest checkpoint {path.name} records no plan history (was it trained with "
                            "trainer.balance=dynamic?)")
    return entries


def _is_plan(entry: Any) -> bool:
    """An entry of a plan history as the balancer writes it: the step, each rank's share and row count."""
    if not isinstance(entry, dict):
        return False
    step, shares, counts = entry.get("step"), entry.get("shares"), entry.get("counts")
    return (isinstance(step, int) and isinstance(shares, list) and isinstance(counts, list)
            and len(shares) == len(counts) and all(isinstance(c, int) and not isinstance(c, bool) for c in counts)
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in shares))


def plan_misfit(history: list[dict[str, Any]], world: int, rows: Optional[int]) -> Optional[dict[str, Any]]:
    """The first entry of a plan history that a run of `world` ranks and `rows` rows per micro-batch (None:
    not known here) cannot follow, else None. A replay follows every entry, so one that fits no more (the
    recorded run was resumed at another world size) would fail at its step, mid-run: both sides ask first."""
    for entry in history:
        counts = [int(c) for c in entry["counts"]]
        if len(counts) != world or (rows is not None and sum(counts) != rows):
            return entry
    return None


def check_run_dir(job: JobConfig, run_dir: Path) -> None:
    """Submit side: refuse a start that would resume another run, or throw a run's checkpoints away."""
    found = newest_marker(run_dir)
    if found is None:
        return
    path, marker = found
    if not job.checkpoint.resume:
        raise ResumeMismatch(
            f"checkpoint.resume=false but {path.parent} holds checkpoints (newest: {path.name}), which the new "
            "saves would prune: use a new run dir, or remove them"
        )
    check_same_run(marker, job, str(path))
    _warn_of_a_new_horizon(marker, job, path)


def _warn_of_a_new_horizon(marker: Marker, job: JobConfig, path: Path) -> None:
    """A longer (or shorter) run may resume, but a decaying learning rate is a function of max_steps:
    say that the steps to come follow another schedule than the steps done (no uninterrupted run of
    the new length trained those)."""
    saved = marker.run.config
    trainer = saved.get("trainer") if saved is not None else None
    before = trainer.get("max_steps") if isinstance(trainer, dict) else None
    now = job.trainer.max_steps
    if job.optim.schedule == "constant" or not isinstance(before, int) or before == now:
        return
    log.warning(
        "trainer.max_steps %d -> %d with optim.schedule=%s: the steps after %s follow the learning-rate "
        "schedule of a %d-step run, the steps before them that of a %d-step run (the result is not the one "
        "an uninterrupted %d-step run gives)", before, now, job.optim.schedule, path.name, now, before, now,
    )

"""Resume only the same run: a checkpoint's config must match the run's in what a step computes (torch-free).

Both sides ask: the submit side before anything starts (exit 2), the job side when it loads a checkpoint
(a recorded failed attempt). Changing how long to train, the cadences, telemetry or placement is fine;
changing the model, the data, the optimizer, the seed, the gradient accumulation, the numerics or the
world size would silently continue another run's parameters, so it is refused with the keys named.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from gpujobs.config import JobConfig
from gpujobs.errors import GpujobsError
from gpujobs.rundir import CHECKPOINT_DIR, MARKER, STEP_PREFIX

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


def differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The compute keys whose values differ, as `key (saved -> current)`, sorted."""
    changed = []
    for key in COMPUTE_KEYS:
        old, new = _leaves(_pick(saved, key), key), _leaves(_pick(current, key), key)
        for leaf in sorted(set(old) | set(new)):
            if old.get(leaf) != new.get(leaf):
                changed.append(f"{leaf} ({old.get(leaf)!r} -> {new.get(leaf)!r})")
    return changed


def check_same_run(meta: dict[str, Any], job: JobConfig, where: str) -> None:
    """Raise ResumeMismatch when the checkpoint described by `meta` (its marker) is of another run."""
    saved = meta.get("config")
    if not isinstance(saved, dict):
        return  # a marker of an older gpujobs: nothing to compare
    changed = differences(saved, job.to_dict())
    saved_world = meta.get("world_size")
    if saved_world is not None and saved_world != job.resources.world_size:
        changed.append(f"world size ({saved_world} -> {job.resources.world_size})")
    if changed:
        raise ResumeMismatch(
            f"{where} was trained with other values of {', '.join(changed)}: a run dir resumes only the same run; "
            "use a new run dir (hydra.run.dir=...) or set the keys back"
        )


def newest_marker(run_dir: Path) -> Optional[tuple[Path, dict[str, Any]]]:
    """The newest published checkpoint of `run_dir` and its marker, read without torch (None if none)."""
    directory = run_dir / CHECKPOINT_DIR
    if not directory.is_dir():
        return None
    for entry in sorted(directory.glob(f"{STEP_PREFIX}*"), reverse=True):
        try:
            return entry, json.loads((entry / MARKER).read_text())
        except (OSError, ValueError):
            continue
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

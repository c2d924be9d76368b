"""Split plans: how each step's global batch is shared among the ranks (torch-free).

Every rank derives the same plan from the same inputs (the config, the gathered timings, the plan
history of a checkpoint), so no plan is ever sent around. A plan is one row count per rank for each
micro-batch; rank r reads the contiguous rows `offset(r) .. offset(r) + counts[r]` of it, and weights
its mean loss by `counts[r] * world / global_batch` so that the gradient DDP averages is exactly the
gradient of the whole global batch's mean loss, whatever the split.

Modes (`trainer.balance`):
- off: equal shares (the remainder of an uneven division goes to the first ranks);
- static: shares from `balance_shares` (per rank) or `balance_gpu_weights` (per GPU model name);
- dynamic: every `balance_every` steps the shares move toward each rank's measured speed (samples per
  second of compute: data + forward + backward, the part of a step before the gradient all-reduce makes
  ranks wait), smoothed, by at most `balance_max_change`, never below `balance_min_share / world`;
- replay: the plan history a finished dynamic run recorded in its checkpoints, step for step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from gpujobs.base.errors import GpujobsError
from gpujobs.config.load import Balance, TrainerConfig
from gpujobs.rundir.records import PlanRecord
from gpujobs.rundir.resume import NoPlanHistory, plan_history, plan_misfit

log = logging.getLogger(__name__)


class BalanceError(GpujobsError):
    """A plan that cannot be made: a replay history that does not fit, a GPU without a weight."""


def counts_from_shares(shares: Sequence[float], total: int, least: int = 1) -> list[int]:
    """Row counts summing to `total`, proportional to `shares` (largest remainder), each at least `least`.

    Deterministic: ties go to the lower rank, so every rank computes the same counts.
    """
    world = len(shares)
    if total < world * least:
        raise BalanceError(f"a micro-batch of {total} rows cannot give {world} ranks {least} row(s) each")
    weight = sum(shares)
    exact = [total * share / weight for share in shares]
    counts = [int(value) for value in exact]
    by_remainder = sorted(range(world), key=lambda r: (-(exact[r] - counts[r]), r))
    for rank in by_remainder[: total - sum(counts)]:
        counts[rank] += 1
    for rank in range(world):  # a rank below `least` takes rows from the largest slice
        while counts[rank] < least:
            donor = max(range(world), key=lambda r: (counts[r], -r))
            counts[donor] -= 1
            counts[rank] += 1
    return counts


def equal_shares(world: int) -> list[float]:
    """1/world each."""
    return [1.0 / world] * world


def _normalized(weights: Sequence[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


def _with_floor(shares: Sequence[float], floor: float) -> list[float]:
    """Shares summing to 1 with none below `floor`: floored ranks are pinned, the rest rescaled."""
    shares = _normalized(shares)
    pinned: set[int] = set()
    while True:
        free = [r for r in range(len(shares)) if r not in pinned]
        left = 1.0 - floor * len(pinned)
        scale = left / sum(shares[r] for r in free)
        out = [floor if r in pinned else shares[r] * scale for r in range(len(shares))]
        low = [r for r in free if out[r] < floor]
        if not low:
            return out
        pinned.update(low)


@dataclass
class SplitPlan:
    """Rows per rank of every micro-batch of a step (the same for each micro-batch)."""

    counts: list[int]

    def offset(self, rank: int) -> int:
        """First row of `rank`'s slice within a micro-batch."""
        return sum(self.counts[:rank])

    def weight(self, rank: int, global_batch: int) -> float:
        """What `rank`'s mean loss is multiplied by: its share of the global batch, times the world size
        (DDP divides the summed gradients by the world size)."""
        return self.counts[rank] * len(self.counts) / global_batch


@dataclass
class Balancer:
    """The plan of every step for one world, and its history (what checkpoints and metrics record)."""

    cfg: TrainerConfig
    world: int
    micro_batch: int
    """Rows of one micro-batch of the global batch (global batch / grad_accum)."""
    gpu_names: list[str] = field(default_factory=list)
    """Each rank's GPU model name ("cpu" for CPU ranks), for static balancing by GPU model."""
    replay: list[dict[str, Any]] = field(default_factory=list)
    """replay: the recorded plan history to follow."""
    shares: list[float] = field(init=False)
    plan: SplitPlan = field(init=False)
    history: list[dict[str, Any]] = field(init=False, default_factory=list)
    resume_reason: str = field(init=False, default="resume")
    """The reason of the plan record after a resume: `resume, replanned` where a static plan recomputed from
    this run's config and GPUs differs from the saved one."""

    def __post_init__(self) -> None:
        self.shares = self._initial_shares()
        self.plan = SplitPlan(self._counts(self.shares))
        misfit = plan_misfit(self.replay, self.world, self.micro_batch) if self.mode == Balance.replay else None
        if misfit is not None:  # refused as the run starts, not at the misfit's step (the submit side asked too)
            counts = [int(c) for c in misfit["counts"]]
            raise BalanceError(
                f"the replayed plan of step {misfit['step']} splits {sum(counts)} rows over {len(counts)} ranks; "
                f"this run has {self.micro_batch} rows per micro-batch over {self.world} ranks"
            )

    @property
    def mode(self) -> str:
        """off | static | dynamic | replay, as plain text (what checkpoints and metrics keep)."""
        return self.cfg.balance.value

    # ------------------------------------------------------------------ plans
    def _floor(self) -> float:
        return self.cfg.balance_min_share / self.world

    def _counts(self, shares: Sequence[float]) -> list[int]:
        return counts_from_shares(shares, self.micro_batch)

    def _initial_shares(self) -> list[float]:
        if self.mode != Balance.static:
            return equal_shares(self.world)
        if self.cfg.balance_shares:
            if len(self.cfg.balance_shares) != self.world:
                raise BalanceError(
                    f"trainer.balance_shares has {len(self.cfg.balance_shares)} weights for {self.world} ranks"
                )
            weights = list(self.cfg.balance_shares)
        else:
            missing = sorted({name for name in self.gpu_names if name not in self.cfg.balance_gpu_weights})
            if missing:
                known = ", ".join(sorted(self.cfg.balance_gpu_weights))
                raise BalanceError(f"trainer.balance_gpu_weights has no weight for {missing} (it has: {known})")
            weights = [self.cfg.balance_gpu_weights[name] for name in self.gpu_names]
        return _with_floor(weights, self._floor())

    def _change(
        self, step: int, shares: list[float], reason: str, counts: Optional[list[int]] = None
    ) -> PlanRecord:
        self.shares = shares
        self.plan = SplitPlan(counts if counts is not None else self._counts(shares))
        record = PlanRecord(step=step, mode=self.mode, reason=reason, shares=[round(s, 6) for s in shares],
                            counts=list(self.plan.counts))
        # the checkpoint's history: the plan without its mode, which the history states once
        self.history.append({"step": step, "reason": reason, "shares": record.shares, "counts": record.counts})
        return record

    def start(self, step: int, resumed: bool) -> PlanRecord:
        """The plan record of a start (from scratch, or after a resume that restored the state)."""
        if self.mode == Balance.replay:
            found = self.replay_at(step)
            if found is not None:
                return found
        return self._change(step, self.shares, self.resume_reason if resumed else "start", self.plan.counts)

    def replay_at(self, step: int) -> Optional[PlanRecord]:
        """replay: the recorded plan that applies from `step` on, if it differs from the current one."""
        if self.mode != Balance.replay:
            return None
        applicable = [entry for entry in self.replay if entry["step"] <= step]
        if not applicable:
            return None
        entry = applicable[-1]
        counts = [int(c) for c in entry["counts"]]  # each fits this run: __post_init__ checked
        if counts == self.plan.counts and self.history:
            return None
        return self._change(step, [float(s) for s in entry["shares"]], "replay", counts)

    def update(self, step: int, compute_s: Sequence[float], samples: Sequence[float]) -> Optional[PlanRecord]:
        """dynamic: move the shares toward the measured speeds (the gathered window, same on every rank).

        Returns the plan record when the counts change, else None.
        """
        if self.mode != Balance.dynamic or self.world < 2:
            return None
        if any(t <= 0 for t in compute_s) or any(n <= 0 for n in samples):
            return None
        speeds = [n / t for n, t in zip(samples, compute_s, strict=True)]
        target = _normalized(speeds)
        alpha, limit = self.cfg.balance_smoothing, self.cfg.balance_max_change
        moved = []
        for old, new in zip(self.shares, target, strict=True):
            wanted = (1 - alpha) * old + alpha * new
            moved.append(min(old + limit, max(old - limit, wanted)))
        shares = _with_floor(moved, self._floor())
        counts = self._counts(shares)
        if counts == self.plan.counts:
            self.shares = shares  # keep the smoothed estimate; the plan itself is unchanged
            return None
        return self._change(step, shares, "update", counts)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (plain JSON values): the shares, the plan and its history."""
        return {"mode": self.mode, "world": self.world, "micro_batch": self.micro_batch,
                "shares": list(self.shares), "counts": list(self.plan.counts), "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Continue a saved plan; True when it applied as saved. A plan of another world (elastic resume),
        another micro-batch or another mode starts over from this mode's initial plan, keeping the history.

        A static plan is a function of this run's config and GPUs, not state: it stays as recomputed (new
        `balance_shares`, or a requeue onto GPUs in another order, change it), and a change is logged and
        recorded (`resume_reason`). A dynamic plan is what the run learned, so it carries over."""
        self.history = list(state.get("history", []))
        same = (state.get("world") == self.world and state.get("micro_batch") == self.micro_batch
                and state.get("mode") == self.mode)
        if same and self.mode == Balance.static:
            saved = [int(c) for c in state["counts"]]
            if saved == self.plan.counts:
                return True
            self.resume_reason = "resume, replanned"
            log.info("trainer.balance=static: the saved split plan %s rows per rank is now %s (recomputed from "
                     "this run's balance_shares or balance_gpu_weights and its GPUs)", saved, self.plan.counts)
            return False
        if same:
            self.shares = [float(s) for s in state["shares"]]
            self.plan = SplitPlan([int(c) for c in state["counts"]])
        else:
            log.info("the saved split plan (%s ranks, %s) does not carry over to %d ranks (%s): starting over",
                     state.get("world"), state.get("mode"), self.world, self.mode)
        return same


def replay_history(run_dir: str) -> list[dict[str, Any]]:
    """The plan history of the finished dynamic run in `run_dir` (`gpujobs.rundir.resume.plan_history`, which the
    submit side has checked already: the run dir may have changed since)."""
    try:
        return plan_history(Path(run_dir))
    except NoPlanHistory as err:
        raise BalanceError(f"trainer.balance_replay={run_dir!r} cannot be replayed: {err}") from None

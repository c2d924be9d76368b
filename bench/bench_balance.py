"""Balancing a slow rank: `trainer.balance=off` against `dynamic`, side by side in one invocation.

    python bench/bench_balance.py [--steps 300] [--warmup 100] [--rounds 1] [--keep DIR] [overrides...]

Two gloo ranks of the rec job (4096 rows per rank per step) run locally, rank 1 slowed 3x
(`telemetry.debug_slow_factor=3`: it spends three times its own compute time on every micro-batch, so its
cost grows with its share the way a slower GPU's does). Each run is the real CLI (`python -m gpujobs.submit`),
and every figure is read back from its run dir through the typed records (metrics.jsonl, result.json), so
the bench measures what a user would see:

- samples/s of each run: the median train window after the warm-up (dynamic needs a few plan updates to
  settle; the whole run's figure from result.json is shown beside it);
- the ideal the two ranks' speeds allow: the sum over ranks of 1 / compute time per sample, measured in the
  `off` run, where each rank's compute per sample is clean (equal shares, nothing moved);
- the same ideal with the part of each step that no split moves added back (the off run's step time less
  its slowest rank's compute: the gradient all-reduce, the optimizer step, the loop), which is the best
  any split can reach; the compute-only ideal is the one issue 12 states;
- both runs' steps, global samples and final AUC.

Acceptance (issue 12): dynamic/off >= 1.6, dynamic/ideal >= 0.85, the same steps and global samples, and
final AUCs within 0.005. Exit 1 when an acceptance line fails, 2 when a run fails or its records lack what
the contract promises. Rounds alternate the order (off, dynamic; dynamic, off; ...) and rates are medians
(this machine may be shared: ratios mean more than absolute rates).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gpujobs.rundir.records import PlanRecord, TrainRecord, read_metrics, read_result

REPO = Path(__file__).resolve().parent.parent
SLOW_RANK, SLOW_FACTOR = 1, 3
LOG_EVERY = 10
JOB = (
    "+experiment=rec", "cluster=local", "resources.procs_per_node=2", "resources.gpus_per_node=0",
    f"telemetry.debug_slow_rank={SLOW_RANK}", f"telemetry.debug_slow_factor={SLOW_FACTOR}",
    "trainer.balance_every=10", f"trainer.log_every={LOG_EVERY}", "trainer.progress=false",
    # 4096 rows per rank (a global batch of 8192): at the rec default of 256 the per-step costs that no split
    # moves (the gradient all-reduce, the optimizer step) are as large as the compute, and no plan nears the ideal;
    # at 2048 they are still a fifth of a step, and a micro-batch's fixed compute shows in the slowed rank's rate
    "data.batch_size=4096",
    # the timed windows hold training only: no periodic eval or save (the final ones come after them)
    "trainer.eval_every=0", "checkpoint.every_steps=0",
)
MIN_VS_OFF, MIN_VS_IDEAL, MAX_AUC_DIFF = 1.6, 0.85, 0.005


class BenchError(Exception):
    """A run failed, or its records lack what the record contract promises."""


@dataclass(frozen=True)
class Measured:
    """One run, as its run dir tells it."""

    run_dir: Path
    steps: int
    samples: int
    auc: float
    samples_per_s: float
    """Median train window after the warm-up."""
    whole_run_samples_per_s: float
    """result.json's: every step, the settling ones included."""
    compute_s_per_sample: list[float]
    """Each rank's median over the windows after the warm-up."""
    final_shares: list[float]
    fixed_step_s: float
    """The part of a step no split moves (all-reduce, optimizer step, loop): the median window's step time
    less its slowest rank's compute."""


def run_job(run_dir: Path, balance: str, steps: int, overrides: list[str]) -> None:
    """Run the rec job to its end with `trainer.balance=balance`; its output goes to RUN_DIR.log."""
    cmd = [sys.executable, "-m", "gpujobs.submit", f"hydra.run.dir={run_dir}", *JOB,
           f"trainer.max_steps={steps}", f"trainer.balance={balance}", *overrides]
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise BenchError(f"balance={balance}: the run exited {proc.returncode} (log {log}):\n{tail}")


def measure(run_dir: Path, balance: str, warmup: int) -> Measured:
    """Read one finished run back: its rates after `warmup` steps, per-rank compute, samples and AUC."""
    result = read_result(run_dir)
    if result is None or not result.completed:
        raise BenchError(f"balance={balance}: {run_dir} has no completed result.json")
    records = read_metrics(run_dir)
    windows = [r for r in records if isinstance(r, TrainRecord) and r.step > warmup]
    plans = [r for r in records if isinstance(r, PlanRecord)]
    missing = [name for name, absent in (
        ("train windows after the warm-up", not windows),
        ("compute_s_per_sample in the train records", not all(r.compute_s_per_sample for r in windows)),
        ("plan records", not plans),
        ("result.json steps", result.steps is None),
        ("result.json samples", result.samples is None),
        ("result.json auc", "auc" not in result.metrics),
        ("result.json samples_per_s", result.samples_per_s is None),
    ) if absent]
    if missing:
        raise BenchError(f"balance={balance}: {run_dir} lacks {', '.join(missing)} (does the trainer write the "
                         "plan/balance records yet?)")
    world = len(windows[0].compute_s_per_sample)
    compute = [statistics.median(r.compute_s_per_sample[rank] for r in windows) for rank in range(world)]
    assert result.steps is not None and result.samples is not None and result.samples_per_s is not None  # above
    accum = result.samples / result.steps / sum(windows[0].counts or [1])
    fixed = statistics.median(
        statistics.median(r.step_time_s)
        - max(t * n * accum for t, n in zip(r.compute_s_per_sample, r.counts or [], strict=True))
        for r in windows
    )
    return Measured(run_dir, result.steps, result.samples, result.metrics["auc"],
                    statistics.median(r.samples_per_s for r in windows), result.samples_per_s, compute,
                    plans[-1].shares, max(0.0, fixed))


def ideal_samples_per_s(off: Measured) -> float:
    """What the ranks' own speeds allow when none waits for another: sum over ranks of samples per second."""
    return sum(1.0 / seconds for seconds in off.compute_s_per_sample)


def ideal_with_fixed_step(off: Measured) -> float:
    """The same ideal with the part of a step that no split moves added back to every step (the best any
    split can do: only the compute is shared out)."""
    batch = off.samples / off.steps
    return batch / (batch / ideal_samples_per_s(off) + off.fixed_step_s)


def acceptance(off: list[Measured], dynamic: list[Measured]) -> list[tuple[str, str, bool]]:
    """(line, figure, passed) for each acceptance line of issue 12, over every round."""
    rate_off = statistics.median(m.samples_per_s for m in off)
    rate_dyn = statistics.median(m.samples_per_s for m in dynamic)
    ideal = statistics.median(ideal_samples_per_s(m) for m in off)
    fixed = statistics.median(ideal_with_fixed_step(m) for m in off)
    auc_diff = max(abs(a.auc - b.auc) for a, b in zip(off, dynamic, strict=True))
    same_steps = all(a.steps == b.steps for a, b in zip(off, dynamic, strict=True))
    same_samples = all(a.samples == b.samples for a, b in zip(off, dynamic, strict=True))
    return [
        (f"dynamic / off >= {MIN_VS_OFF}", f"{rate_dyn / rate_off:.3f}", rate_dyn / rate_off >= MIN_VS_OFF),
        (f"dynamic / ideal >= {MIN_VS_IDEAL}", f"{rate_dyn / ideal:.3f}", rate_dyn / ideal >= MIN_VS_IDEAL),
        (f"dynamic / ideal+fixed >= {MIN_VS_IDEAL}", f"{rate_dyn / fixed:.3f}", rate_dyn / fixed >= MIN_VS_IDEAL),
        ("same steps", "yes" if same_steps else "no", same_steps),
        ("same global samples", "yes" if same_samples else "no", same_samples),
        (f"|AUC dynamic - off| <= {MAX_AUC_DIFF}", f"{auc_diff:.4f}", auc_diff <= MAX_AUC_DIFF),
    ]


def table(off: list[Measured], dynamic: list[Measured]) -> list[str]:
    """The runs side by side (medians over rounds; the last round's steps, samples, AUC and shares)."""
    ideal = statistics.median(ideal_samples_per_s(m) for m in off)
    compute = off[-1].compute_s_per_sample
    lines = [f"rank {SLOW_RANK} slowed {SLOW_FACTOR}x; off run's compute per sample: "
             + ", ".join(f"rank {rank} {seconds * 1e6:.1f} us" for rank, seconds in enumerate(compute)),
             f"{'run':8s} {'samples/s':>10s} {'whole run':>10s} {'steps':>6s} {'samples':>9s} {'auc':>7s}  shares"]
    for name, runs in (("off", off), ("dynamic", dynamic)):
        last = runs[-1]
        shares = "/".join(f"{share:.3f}" for share in last.final_shares)
        lines.append(f"{name:8s} {statistics.median(m.samples_per_s for m in runs):10.0f} "
                     f"{statistics.median(m.whole_run_samples_per_s for m in runs):10.0f} {last.steps:6d} "
                     f"{last.samples:9d} {last.auc:7.4f}  {shares}")
    lines.append(f"{'ideal':8s} {ideal:10.0f}   (compute only: sum over ranks of 1 / compute per sample)")
    fixed = statistics.median(ideal_with_fixed_step(m) for m in off)
    lines.append(f"{'ideal+fixed':8s} {fixed:7.0f}   (with the off run's {off[-1].fixed_step_s * 1e3:.1f} ms per step "
                 "that no split moves)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=100, help="steps left out of the rates (dynamic settles)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--keep", type=Path, default=None, help="keep the run dirs here (for gpujobs.report)")
    parser.add_argument("overrides", nargs="*", help="more config overrides for both runs")
    args = parser.parse_args()
    if not 0 <= args.warmup <= args.steps - LOG_EVERY:
        parser.error(f"--warmup {args.warmup}: 0..{args.steps - LOG_EVERY} (a train window must follow it)")
    with tempfile.TemporaryDirectory(prefix="bench_balance_") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        runs: dict[str, list[Measured]] = {"off": [], "dynamic": []}
        try:
            for round_ in range(args.rounds):
                for balance in ("off", "dynamic") if round_ % 2 == 0 else ("dynamic", "off"):
                    run_dir = root / f"{balance}{round_}"
                    run_job(run_dir, balance, args.steps, args.overrides)
                    runs[balance].append(measure(run_dir, balance, args.warmup))
                    print(f"round {round_}: {balance:8s} {runs[balance][-1].samples_per_s:10.0f} samples/s "
                          f"({run_dir})", file=sys.stderr)
        except BenchError as err:
            print(f"bench_balance: {err}", file=sys.stderr)
            return 2
        print("\n".join(table(runs["off"], runs["dynamic"])))
        lines = acceptance(runs["off"], runs["dynamic"])
        for line, figure, passed in lines:
            print(f"{'PASS' if passed else 'FAIL'}  {line:32s} {figure}")
    return 0 if all(passed for _, _, passed in lines) else 1


if __name__ == "__main__":
    raise SystemExit(main())

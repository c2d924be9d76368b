"""`python -m gpujobs.report RUN_DIR`: PNG plots of a run and a short text summary (torch-free).

Reads metrics.jsonl, every node's gpu.<node>.jsonl (when the run had GPU telemetry) and result.json; writes
{loss,throughput,step_time}.png, gpu.png (GPU telemetry), shares.png (each rank's share of the global batch,
when the run recorded split plans) and checkpoints.png (when it recorded saves) into RUN_DIR/report/, or
into `--out DIR` (for a run dir this user may read but not write), and prints the summary.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Optional

from gpujobs.base.errors import GpujobsError
from gpujobs.rundir import METRICS_FILE
from gpujobs.rundir.gpu_files import read_gpu_samples
from gpujobs.rundir.records import (
    CheckpointRecord,
    EvalRecord,
    HealthRecord,
    MetricsRecord,
    PlanRecord,
    Result,
    TrainRecord,
    read_metrics,
    read_result,
)

REPORT_DIR = "report"


def _split(metrics: list[MetricsRecord]) -> tuple[list[TrainRecord], list[EvalRecord]]:
    return [r for r in metrics if isinstance(r, TrainRecord)], [r for r in metrics if isinstance(r, EvalRecord)]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _plans(metrics: list[MetricsRecord]) -> list[PlanRecord]:
    return [r for r in metrics if isinstance(r, PlanRecord)]


def _saves(metrics: list[MetricsRecord]) -> list[CheckpointRecord]:
    return [r for r in metrics if isinstance(r, CheckpointRecord)]


def plan_history(plans: list[PlanRecord]) -> list[PlanRecord]:
    """The plans the run's final lineage trained with, by step: an attempt that resumed from an older
    checkpoint redid some steps, so its plans replace those the earlier attempt recorded from that step on."""
    kept: list[PlanRecord] = []
    for plan in plans:
        while kept and kept[-1].step >= plan.step:
            kept.pop()
        kept.append(plan)
    return kept


def balance_mode(metrics: list[MetricsRecord]) -> Optional[str]:
    """The run's balance mode: its last plan's, else its last train record's; None for a run that predates
    balancing (it recorded neither)."""
    plans = _plans(metrics)
    if plans:
        return plans[-1].mode
    modes = [r.balance for r in metrics if isinstance(r, TrainRecord) and r.balance is not None]
    return modes[-1] if modes else None


def _balance_lines(metrics: list[MetricsRecord]) -> list[str]:
    mode, plans = balance_mode(metrics), _plans(metrics)
    if mode is None:
        return []
    if not plans:
        return [f"balance: {mode} (no plan records)"]
    last = plans[-1]
    shares = ", ".join(f"rank {rank} {share:.3f}" for rank, share in enumerate(last.shares))
    counts = f" ({'/'.join(str(c) for c in last.counts)} rows per micro-batch)" if last.counts else ""
    updates = sum(1 for plan in plans if plan.reason == "update")
    return [f"balance: {mode}, {_count(len(plans), 'plan')} ({_count(updates, 'update')}); "
            f"final shares from step {last.step}: {shares}{counts}"]


def _checkpoint_lines(metrics: list[MetricsRecord]) -> list[str]:
    saves = _saves(metrics)
    if not saves:
        return []
    blocking = [save.blocking_s for save in saves]
    background = sum(1 for save in saves if save.background)
    return [f"checkpoints: {_count(len(saves), 'save')} ({background} async), blocking training median "
            f"{statistics.median(blocking):.3f} s, max {max(blocking):.3f} s, total {sum(blocking):.3f} s"]


def summarize(metrics: list[MetricsRecord], gpus: list[dict[str, Any]], result: Optional[Result]) -> list[str]:
    """The text summary: final metrics, throughput, imbalance, balance mode and final shares, checkpoint
    blocking, GPU use."""
    train, evals = _split(metrics)
    if result is None:
        lines = ["status running or failed (no result.json)"]
    else:
        lines = [f"status {result.status}, {result.steps} steps, {result.world_size} ranks, wall {result.wall_s} s"
                 + (f", {result.samples} global samples" if result.samples is not None else "")]
    if evals:
        last = {"step": evals[-1].step, **evals[-1].metrics}
        lines.append("final eval: " + ", ".join(f"{k}={v:g}" for k, v in last.items()))
    if train:
        rates = [r.samples_per_s for r in train]
        lines.append(f"throughput: median {statistics.median(rates):.0f} samples/s (last {rates[-1]:.0f}), "
                     f"final loss {train[-1].loss:.4f}")
        ratios = [r.imbalance for r in train if r.imbalance is not None]
        if ratios:
            slowest = Counter(r.slowest_rank for r in train if r.slowest_rank is not None).most_common(1)[0][0]
            lines.append(f"imbalance (slowest/median local step time): median {statistics.median(ratios):.2f}, "
                         f"max {max(ratios):.2f}; most often slowest: rank {slowest}")
    lines += _balance_lines(metrics) + _checkpoint_lines(metrics)
    if gpus:
        for name, samples in sorted(_by_gpu(gpus).items()):
            util = [s["util_pct"] for s in samples if "util_pct" in s]
            mem = [s["mem_used_mib"] for s in samples if "mem_used_mib" in s]
            total = samples[-1].get("mem_total_mib")
            parts = [f"{name}: {len(samples)} samples"]
            if util:
                parts.append(f"util mean {statistics.mean(util):.0f}% (max {max(util)}%)")
            if mem:
                parts.append(f"memory peak {max(mem) / 1024:.1f}" + (f"/{total / 1024:.1f} GiB" if total else " GiB"))
            lines.append(", ".join(parts))
    else:
        lines.append("GPU use: no gpu.<node>.jsonl (no NVML, or a CPU run): GPU plots skipped")
    return lines


def _gpu_name(sample: dict[str, Any]) -> str:
    rank = sample.get("rank")
    return f"{sample.get('node')}/GPU {sample.get('gpu')}" + (f" (rank {rank})" if rank is not None else "")


def _by_gpu(gpus: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The GPU samples of each GPU, by its name."""
    by_gpu: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for sample in gpus:
        by_gpu[_gpu_name(sample)].append(sample)
    return by_gpu


class _Figures:
    """pyplot, drawing into files in `out` (no display on compute nodes), and the files written so far."""

    def __init__(self, out: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on compute nodes
        import matplotlib.pyplot as plt

        self.plt: Any = plt
        self.out = out
        self.written: list[Path] = []
        out.mkdir(parents=True, exist_ok=True)

    def save(self, fig: Any, name: str) -> None:
        """Write `fig` as `name` and close it."""
        fig.tight_layout()
        fig.savefig(self.out / name, dpi=110)
        self.plt.close(fig)
        self.written.append(self.out / name)


def plot(metrics: list[MetricsRecord], gpus: list[dict[str, Any]], out: Path) -> list[Path]:
    """Write the PNGs into `out`; returns their paths."""
    figures = _Figures(out)
    train, evals = _split(metrics)
    _plot_loss(figures, train, evals)
    _plot_throughput(figures, train)
    _plot_step_time(figures, train)
    if _plans(metrics):
        _plot_balance(figures, metrics, train)
    if _saves(metrics):
        _plot_saves(figures, _saves(metrics))
    if gpus:
        _plot_gpus(figures, gpus)
    return figures.written


#: Eval keys that count (rows seen), not score: said in the summary, never plotted beside the scores.
_COUNT_SUFFIXES = ("_rows", "_samples", "_count")


def eval_scores(evals: list[EvalRecord]) -> list[str]:
    """The eval metrics to plot, in name order: every key but the counts (`eval_rows`: 50,000 on AUC's axis
    would flatten AUC and log-loss to a line)."""
    return sorted({k for r in evals for k in r.metrics if not k.endswith(_COUNT_SUFFIXES)})


def loss_figure(plt: Any, train: list[TrainRecord], evals: list[EvalRecord]) -> Any:
    """The training loss, then each eval score on an axis of its own (AUC near 0.8 and log-loss near 0.45
    move by hundredths: on one axis, either would hide the other's change)."""
    scores = eval_scores(evals)
    fig, axes = plt.subplots(1, 1 + len(scores), figsize=(4 * (1 + len(scores)), 3.6), squeeze=False)
    ax_loss = axes[0][0]
    ax_loss.plot([r.step for r in train], [r.loss for r in train], marker=".")
    ax_loss.set(title="training loss", xlabel="step", ylabel="loss")
    for ax, key in zip(axes[0][1:], scores, strict=True):
        shown = [r for r in evals if key in r.metrics]
        ax.plot([r.step for r in shown], [r.metrics[key] for r in shown], marker="o")
        ax.set(title=f"eval {key}", xlabel="step", ylabel=key)
    return fig


def _plot_loss(figures: _Figures, train: list[TrainRecord], evals: list[EvalRecord]) -> None:
    figures.save(loss_figure(figures.plt, train, evals), "loss.png")


def _plot_throughput(figures: _Figures, train: list[TrainRecord]) -> None:
    fig, ax = figures.plt.subplots(figsize=(6, 3.8))
    ax.plot([r.step for r in train], [r.samples_per_s for r in train], marker=".")
    ax.set(title="throughput (all ranks)", xlabel="step", ylabel="samples/s")
    ax.set_ylim(bottom=0)
    figures.save(fig, "throughput.png")


def _plot_step_time(figures: _Figures, train: list[TrainRecord]) -> None:
    fig, (ax_step, ax_local) = figures.plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    steps = [r.step for r in train]
    world = min((len(r.step_time_s) for r in train), default=0)
    for rank in range(world):
        ax_step.plot(steps, [r.step_time_s[rank] for r in train], marker=".", label=f"rank {rank}")
        if all(len(r.local_time_s) > rank for r in train):
            ax_local.plot(steps, [r.local_time_s[rank] for r in train], marker=".", label=f"rank {rank}")
    ax_step.set(title="step time per rank", xlabel="step", ylabel="seconds")
    ax_local.set(title="local time (data + forward) per rank", xlabel="step")
    ax_step.legend()
    figures.save(fig, "step_time.png")


def _plot_balance(figures: _Figures, metrics: list[MetricsRecord], train: list[TrainRecord]) -> None:
    """Each rank's share, and (where the run measured it) its compute time per sample."""
    timed = [r for r in train if r.compute_s_per_sample]
    fig, axes = figures.plt.subplots(1, 2 if timed else 1, figsize=(10 if timed else 6, 3.8), squeeze=False)
    end = max(r.step for r in metrics if not isinstance(r, HealthRecord))  # a health check has no step
    _plot_shares(axes[0][0], _plans(metrics), end, balance_mode(metrics))
    if timed:
        ax = axes[0][1]
        for rank in range(max(len(r.compute_s_per_sample) for r in timed)):
            ranked = [r for r in timed if len(r.compute_s_per_sample) > rank]
            ax.plot([r.step for r in ranked], [r.compute_s_per_sample[rank] * 1e6 for r in ranked],
                    marker=".", label=f"rank {rank}")
        ax.set(title="compute time per sample", xlabel="step", ylabel="µs")
        ax.set_ylim(bottom=0)
        ax.legend()
    figures.save(fig, "shares.png")


def _plot_saves(figures: _Figures, saves: list[CheckpointRecord]) -> None:
    fig, ax = figures.plt.subplots(figsize=(6, 3.8))
    for background, label, marker in ((False, "synchronous", "o"), (True, "async", "^")):
        kind = [r for r in saves if r.background is background]
        if kind:
            ax.plot([r.step for r in kind], [r.blocking_s for r in kind], marker, label=label)
    ax.set(title="checkpoint: time training was blocked", xlabel="step", ylabel="seconds")
    ax.set_ylim(bottom=0)
    ax.legend()
    figures.save(fig, "checkpoints.png")


def _plot_gpus(figures: _Figures, gpus: list[dict[str, Any]]) -> None:
    start = min(s["time"] for s in gpus)
    fig, (ax_util, ax_mem) = figures.plt.subplots(1, 2, figsize=(10, 3.8))
    for name, samples in sorted(_by_gpu(gpus).items()):
        ax_util.plot([s["time"] - start for s in samples if "util_pct" in s],
                     [s["util_pct"] for s in samples if "util_pct" in s], label=name)
        ax_mem.plot([s["time"] - start for s in samples if "mem_used_mib" in s],
                    [s["mem_used_mib"] / 1024 for s in samples if "mem_used_mib" in s], label=name)
    ax_util.set(title="GPU utilization", xlabel="seconds", ylabel="%", ylim=(0, 105))
    ax_mem.set(title="GPU memory used", xlabel="seconds", ylabel="GiB")
    ax_util.legend(fontsize="small")
    figures.save(fig, "gpu.png")


def _plot_shares(ax: Any, plans: list[PlanRecord], end: int, mode: Optional[str]) -> None:
    """Each rank's share as a step plot: a plan holds from its step to the next plan's (the last to `end`);
    a rank missing from a plan (an elastic resume at fewer ranks) leaves a gap."""
    plans = plan_history(plans)
    steps = [plan.step for plan in plans] + [max(end, plans[-1].step)]
    for rank in range(max(len(plan.shares) for plan in plans)):
        shares = [plan.shares[rank] if rank < len(plan.shares) else math.nan for plan in plans]
        ax.step(steps, [*shares, shares[-1]], where="post", label=f"rank {rank}")
    ax.set(title=f"share of the global batch (balance={mode})", xlabel="step", ylabel="share")
    ax.set_ylim(0, 1)
    ax.legend()


def report(run_dir: Path, out: Optional[Path] = None) -> list[str]:
    """Plot the run into `out` (RUN_DIR/report/ by default) and return the summary lines.

    Raises GpujobsError (one line) for a RUN_DIR that is no run dir or whose files cannot be read, and
    for an `out` the plots cannot be written into (a colleague's run dir: `--out` puts them elsewhere).
    """
    if not run_dir.is_dir():
        what = "does not exist" if not run_dir.exists() else "is not a directory"
        raise GpujobsError(f"{run_dir} {what}: RUN_DIR is a gpujobs run dir")
    metrics = read_metrics(run_dir)
    if not metrics:
        raise GpujobsError(f"{run_dir / METRICS_FILE}: missing or empty (is this a gpujobs run dir?)")
    gpus = read_gpu_samples(run_dir)
    result = read_result(run_dir)
    out = run_dir / REPORT_DIR if out is None else out
    _check_writable(out)
    written = plot(metrics, gpus, out)
    return [*summarize(metrics, gpus, result), "plots: " + ", ".join(str(p) for p in written)]


def _check_writable(out: Path) -> None:
    """Make `out` and write a file in it, before any plot is drawn: a folder this user may not write
    (another user's run dir) or cannot make (a file in its way) is one line, not a traceback halfway."""
    if out.exists() and not out.is_dir():
        raise GpujobsError(f"cannot write the plots into {out}: a file is in the way; `--out DIR` writes them "
                           "elsewhere")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise GpujobsError(f"cannot write the plots into {out}: {err.strerror}; "
                           "`--out DIR` writes them elsewhere") from None


def main(argv: list[str] | None = None, prog: str = "python -m gpujobs.report") -> int:
    """CLI entry: 0 on success, 2 (one line) when RUN_DIR holds no metrics, cannot be read, or the plots
    cannot be written."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help=f"write the plots into DIR (default: RUN_DIR/{REPORT_DIR}/)")
    args = parser.parse_args(argv)
    try:
        lines = report(args.run_dir, args.out)
    except GpujobsError as err:
        print(f"gpujobs: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

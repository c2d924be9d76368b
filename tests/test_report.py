"""`python -m gpujobs.report RUN_DIR` on the run dir of a real tiny 2-rank local run, and on a balanced
run's records (split plans, checkpoint blocking times) as the trainer writes them to metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, submit
from fake_nvml import FakeGpu, install

from gpujobs.cli.report import loss_figure, plan_history
from gpujobs.rank.observe.gpu_sampler import GpuSampler
from gpujobs.rundir.gpu_files import gpu_file
from gpujobs.rundir.records import CheckpointRecord, EvalRecord, PlanRecord, TrainRecord, read_metrics

TINY = ("+experiment=rec", "+debug=tiny", "cluster=local")


def report(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpujobs.report", str(run_dir), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_each_eval_score_has_its_own_axis_and_counts_are_not_plotted(run_dir: Path) -> None:
    """The records of a real tiny run: AUC, log-loss and the oracle's AUC each on an axis of their own, and
    `eval_rows` (2048 here, 50,000 by default) on none, where it flattened the scores to a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    proc = submit(run_dir, *TINY)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = read_metrics(run_dir)
    train = [r for r in records if isinstance(r, TrainRecord)]
    evals = [r for r in records if isinstance(r, EvalRecord)]
    assert evals and all("eval_rows" in r.metrics for r in evals), evals
    fig = loss_figure(plt, train, evals)
    try:
        titled = {ax.get_title(): ax for ax in fig.axes}
        assert list(titled) == ["training loss", "eval auc", "eval logloss", "eval oracle_auc"], list(titled)
        for key in ("auc", "logloss", "oracle_auc"):
            (line,) = titled[f"eval {key}"].get_lines()  # one metric an axis
            assert list(line.get_ydata()) == [r.metrics[key] for r in evals]
        low, high = titled["eval auc"].get_ylim()
        assert high < 1.5, (low, high)  # scaled to AUC, not to a count of rows
    finally:
        plt.close(fig)


def test_report_plots_a_real_run(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = submit(run_dir, *TINY)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = report(run_dir)
    assert out.returncode == 0, out.stderr
    for name in ("loss.png", "throughput.png", "step_time.png", "shares.png", "checkpoints.png"):
        png = (run_dir / "report" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert not (run_dir / "report" / "gpu.png").exists()
    text = out.stdout
    assert "status completed, 12 steps, 2 ranks" in text
    assert "final eval: step=12, auc=" in text
    assert "throughput: median" in text and "imbalance" in text
    assert "no gpu.<node>.jsonl" in text
    # the trainer's own plan and checkpoint records, read by the report
    assert "balance: off, 1 plan (0 updates); final shares from step 0: rank 0 0.500, rank 1 0.500" in text
    assert "checkpoints: 3 saves (0 async)" in text

    # The same run dir with GPU samples: the driver's answers are faked (no GPU here), the sampler is real.
    install(monkeypatch, [FakeGpu(util=70, used_gb=20), FakeGpu(util=40, used_gb=12)])
    sampler = GpuSampler(gpu_file(run_dir, "n1"), 0.02, "n1", {"GPU-fake-0": 0, "GPU-fake-1": 1})
    assert sampler.start()
    deadline = time.monotonic() + 30
    samples = gpu_file(run_dir, "n1")
    while not samples.exists() or len(samples.read_text().splitlines()) < 4:  # two samples of two GPUs
        assert time.monotonic() < deadline, "the sampler wrote no samples"
        time.sleep(0.02)
    sampler.stop()
    out = report(run_dir)
    assert out.returncode == 0, out.stderr
    assert (run_dir / "report" / "gpu.png").read_bytes().startswith(b"\x89PNG")
    assert "n1/GPU 0 (rank 0):" in out.stdout and "util mean 70%" in out.stdout


def test_report_of_a_dir_without_metrics_exits_2(tmp_path: Path) -> None:
    out = report(tmp_path)
    assert out.returncode == 2
    assert "metrics.jsonl" in out.stderr


def balanced_run_dir(run_dir: Path) -> None:
    """A dynamic run's files as the trainer's record contract has them: plans at start and at each update,
    train records with counts and per-sample compute times, checkpoint saves, a result; and a torn last line
    (a crash mid-write)."""
    run_dir.mkdir(parents=True)
    shares = [[0.5, 0.5], [0.6, 0.4], [0.7, 0.3], [0.75, 0.25]]
    lines: list[dict[str, object]] = []
    for i, (a, b) in enumerate(shares):
        lines.append({"kind": "plan", "step": i * 10, "mode": "dynamic", "reason": "update" if i else "start",
                      "shares": [a, b], "counts": [int(256 * a), int(256 * b)], "time": 100.0 + i,
                      "from_the_future": 1})  # an unknown key: ignored
        for step in (i * 10 + 5, i * 10 + 10):
            lines.append({"kind": "train", "step": step, "loss": 0.6 - step / 100, "samples_per_s": 1000.0 + step,
                          "time": 100.0 + step, "step_time_s": [0.1, 0.1], "local_time_s": [0.05, 0.09],
                          "counts": [int(256 * a), int(256 * b)], "compute_s_per_sample": [1e-4, 3e-4],
                          "balance": "dynamic"})
    lines.append({"kind": "eval", "step": 40, "auc": 0.71, "logloss": 0.5, "time": 141.0})
    lines += [{"kind": "checkpoint", "step": 20, "async": True, "blocking_s": 0.012, "time": 121.0},
              {"kind": "checkpoint", "step": 40, "async": False, "blocking_s": 0.25, "time": 141.0}]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (run_dir / "metrics.jsonl").write_text(text + '{"kind": "plan", "step": 40, "mode": "dyn')
    (run_dir / "result.json").write_text(json.dumps(
        {"status": "completed", "steps": 40, "world_size": 2, "samples": 40 * 512, "samples_per_s": 1040.0,
         "wall_s": 20.0, "auc": 0.71}))


def test_metrics_reader_types_plan_and_checkpoint_records(tmp_path: Path) -> None:
    balanced_run_dir(tmp_path / "run")
    records = read_metrics(tmp_path / "run")
    plans = [r for r in records if isinstance(r, PlanRecord)]
    assert [p.step for p in plans] == [0, 10, 20, 30]  # the torn plan line is skipped
    assert plans[-1] == PlanRecord(step=30, mode="dynamic", reason="update", shares=[0.75, 0.25],
                                   counts=[192, 64], time=103.0)
    saves = [r for r in records if isinstance(r, CheckpointRecord)]
    assert saves == [CheckpointRecord(step=20, blocking_s=0.012, background=True, time=121.0),
                     CheckpointRecord(step=40, blocking_s=0.25, background=False, time=141.0)]
    last_train = [r for r in records if isinstance(r, TrainRecord)][-1]
    assert (last_train.counts, last_train.compute_s_per_sample, last_train.balance) == ([192, 64], [1e-4, 3e-4],
                                                                                        "dynamic")


def test_metrics_reader_passes_over_a_plan_that_is_not_one(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"kind": "plan", "step": 0, "mode": "off", "reason": "start", "shares": ["half", 0.5]}) + "\n"
        + json.dumps({"kind": "plan", "step": 0, "mode": "off", "shares": [0.5, 0.5]}) + "\n"  # no reason
        + json.dumps({"kind": "checkpoint", "step": 4}) + "\n"  # no blocking time
        + json.dumps({"kind": "checkpoint", "step": 8, "blocking_s": 0.5}) + "\n"
    )
    assert read_metrics(tmp_path) == [CheckpointRecord(step=8, blocking_s=0.5)]


def test_report_plots_each_ranks_share_and_checkpoint_blocking(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    balanced_run_dir(run_dir)
    out = report(run_dir)
    assert out.returncode == 0, out.stderr
    for name in ("shares.png", "checkpoints.png", "loss.png"):
        png = (run_dir / "report" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000
    text = out.stdout
    assert "status completed, 40 steps, 2 ranks, wall 20.0 s, 20480 global samples" in text
    assert ("balance: dynamic, 4 plans (3 updates); final shares from step 30: rank 0 0.750, rank 1 0.250 "
            "(192/64 rows per micro-batch)") in text
    assert "checkpoints: 2 saves (1 async), blocking training median 0.131 s, max 0.250 s, total 0.262 s" in text


def test_report_of_a_run_without_plans_draws_no_share_plot(tmp_path: Path) -> None:
    # a run from before balancing: train and eval records only
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"kind": "train", "step": 3, "loss": 0.6, "samples_per_s": 900.0, "step_time_s": [0.1]}) + "\n")
    out = report(tmp_path)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "report" / "shares.png").exists()
    assert not (tmp_path / "report" / "checkpoints.png").exists()
    assert "balance" not in out.stdout and "checkpoints:" not in out.stdout


def test_plan_history_keeps_the_plans_of_the_steps_a_resumed_attempt_redid() -> None:
    def plan(step: int, share: float, reason: str) -> PlanRecord:
        return PlanRecord(step=step, mode="dynamic", reason=reason, shares=[share, 1 - share])

    # attempt 1 planned at 0, 10, 20 and died at 25; attempt 2 resumed from the step-10 checkpoint
    first = [plan(0, 0.5, "start"), plan(10, 0.6, "update"), plan(20, 0.7, "update")]
    second = [plan(10, 0.6, "resume"), plan(20, 0.68, "update"), plan(30, 0.72, "update")]
    assert [(p.step, p.shares[0], p.reason) for p in plan_history(first + second)] == [
        (0, 0.5, "start"), (10, 0.6, "resume"), (20, 0.68, "update"), (30, 0.72, "update")]


def test_report_where_the_plots_cannot_go_is_one_line_and_exit_2_and_out_puts_them_elsewhere(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    balanced_run_dir(run_dir)
    (run_dir / "report").write_text("")  # a file where the plots' folder goes
    blocked = [(run_dir, run_dir / "report", "a file is in the way"),
               (run_dir, run_dir / "report" / "deeper", "Not a directory")]
    if os.geteuid() != 0:  # a colleague's run dir: readable, not writable (chmod does not stop root)
        theirs = tmp_path / "theirs"
        balanced_run_dir(theirs)
        theirs.chmod(0o555)
        blocked.append((theirs, theirs / "report", "Permission denied"))
    for source, out, why in blocked:
        proc = report(source) if out.parent == source else report(source, "--out", str(out))
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
        (line,) = proc.stderr.splitlines()
        assert line.startswith(f"gpujobs: cannot write the plots into {out}: {why}") and "--out DIR" in line, line
    proc = report(run_dir, "--out", str(tmp_path / "plots"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "plots" / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert f"plots: {tmp_path / 'plots' / 'loss.png'}" in proc.stdout


def test_report_of_a_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("x: 1\n")
    proc = report(path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [f"gpujobs: {path} is not a directory: RUN_DIR is a gpujobs run dir"]

"""`python -m gpujobs.report RUN_DIR` on the run dir of a real tiny 2-rank local run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, submit
from fake_nvml import FakeGpu, install

from gpujobs.run.gpu_sampler import GpuSampler

TINY = ("+experiment=rec", "+debug=tiny", "cluster=local")


def report(run_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpujobs.report", str(run_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_report_plots_a_real_run(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = submit(run_dir, *TINY)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = report(run_dir)
    assert out.returncode == 0, out.stderr
    for name in ("loss.png", "throughput.png", "step_time.png"):
        png = (run_dir / "report" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert not (run_dir / "report" / "gpu.png").exists()
    text = out.stdout
    assert "status completed, 12 steps, 2 ranks" in text
    assert "final eval: step=12, auc=" in text
    assert "throughput: median" in text and "imbalance" in text
    assert "no gpu.jsonl" in text

    # The same run dir with GPU samples: the driver's answers are faked (no GPU here), the sampler is real.
    install(monkeypatch, [FakeGpu(util=70, used_gb=20), FakeGpu(util=40, used_gb=12)])
    sampler = GpuSampler(run_dir / "gpu.jsonl", 0.02, "n1", {0: 0, 1: 1})
    assert sampler.start()
    time.sleep(0.2)
    sampler.stop()
    out = report(run_dir)
    assert out.returncode == 0, out.stderr
    assert (run_dir / "report" / "gpu.png").read_bytes().startswith(b"\x89PNG")
    assert "n1/GPU 0 (rank 0):" in out.stdout and "util mean 70%" in out.stdout


def test_report_of_a_dir_without_metrics_exits_2(tmp_path: Path) -> None:
    out = report(tmp_path)
    assert out.returncode == 2
    assert "metrics.jsonl" in out.stderr

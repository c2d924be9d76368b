"""GPU telemetry and GPU picking against a fake `pynvml` (tests/fake_nvml.py).

This machine has no NVIDIA GPU and no NVML, so the driver's answers are faked: that is the one thing
that cannot exist here. The sampler thread, gpu.jsonl, the picking policy and the config are real.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from conftest import compose_job, submit
from fake_nvml import FakeGpu, fake_nvml_env, install

from gpujobs.atomic import read_jsonl
from gpujobs.errors import ConfigError
from gpujobs.launch.gpus import choose_local_gpus, local_gpu_count
from gpujobs.run.gpu_sampler import GpuSampler


def test_sampler_writes_one_line_per_gpu_and_omits_unsupported_fields(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    install(monkeypatch, [FakeGpu(util=80, used_gb=30), FakeGpu(util=5, power_limit=False, xids=[79]),
                          FakeGpu()])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-fake-1")  # the job sees GPUs 2 and 1, in that order
    seen: list[list[dict[str, object]]] = []
    sampler = GpuSampler(tmp_path / "gpu.jsonl", 0.05, "n1", {0: 4, 1: 5}, sink=seen.append)
    assert sampler.start()
    deadline = time.monotonic() + 10
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    lines = [json.loads(line) for line in (tmp_path / "gpu.jsonl").read_text().splitlines()]
    assert len(lines) % 2 == 0 and len(lines) >= 4
    first, second = lines[0], lines[1]
    assert (first["gpu"], first["cuda_index"], first["rank"], first["uuid"]) == (2, 0, 4, "GPU-fake-2")
    assert (second["gpu"], second["cuda_index"], second["rank"], second["node"]) == (1, 1, 5, "n1")
    assert second["util_pct"] == 5 and second["power_w"] == 251.0 and second["sm_clock_mhz"] == 1980
    assert "power_limit_w" not in second and first["power_limit_w"] == 700.0
    assert "ecc_uncorrected" not in first  # NotSupported: left out, not faked as 0
    assert first["throttle"] == ["sw_power_cap"]  # gpu_idle is not a throttle
    assert second["xid"] == [79] and "xid" not in lines[3]  # reported once, when it happened
    assert first["mem_used_mib"] == pytest.approx(1e9 / 2**20, rel=1e-3)


def test_sampler_appends_after_a_torn_line_and_refuses_a_planted_link(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another node's sampler died mid-line: this one's first sample starts a line of its own and is read
    back whole. A link in gpu.jsonl's place is not written through: telemetry is off, and says why."""
    install(monkeypatch, [FakeGpu(), FakeGpu()])
    path = tmp_path / "gpu.jsonl"
    path.write_text('{"node": "n2", "gpu": 0, "util_pct": 9')
    seen: list[list[dict[str, object]]] = []
    sampler = GpuSampler(path, 0.05, "n1", {0: 0, 1: 1}, sink=seen.append)
    assert sampler.start()
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    samples = read_jsonl(path)
    assert samples[:2] == seen[0] and len(samples) == 2 * len(seen)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("theirs\n")
    (tmp_path / "linked.jsonl").symlink_to(elsewhere)
    caplog.set_level("INFO")
    sampler = GpuSampler(tmp_path / "linked.jsonl", 0.05, "n1", {})
    assert not sampler.start()
    sampler.stop()
    assert elsewhere.read_text() == "theirs\n"
    assert [r.message for r in caplog.records] == [f"GPU telemetry off: {tmp_path / 'linked.jsonl'} cannot be "
                                                   "written: it is a symbolic link, not a regular file (gpujobs "
                                                   "does not follow it)"]


def test_without_nvml_sampler_is_off_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` fails, as on a machine without it
    caplog.set_level("INFO")
    sampler = GpuSampler(tmp_path / "gpu.jsonl", 0.05, "n1", {})
    assert not sampler.start()
    sampler.stop()
    assert [r.message for r in caplog.records] == ["no NVML: GPU telemetry off"]
    assert not (tmp_path / "gpu.jsonl").exists()
    assert local_gpu_count() == 0


def test_pick_gpus_takes_the_least_loaded_with_enough_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, [FakeGpu(util=90), FakeGpu(util=0, used_gb=79), FakeGpu(util=3), FakeGpu(util=1)])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    job = compose_job("+experiment=rec", "resources.gpus_per_node=2", "resources.pick_gpus=true",
                      "resources.min_free_gpu_mem_gb=10")
    assert choose_local_gpus(job.resources) == [2, 3]  # GPU 1 is idle but full; GPU 0 is busy
    plain = compose_job("+experiment=rec", "resources.gpus_per_node=2")
    assert choose_local_gpus(plain.resources) == [0, 1]


def test_pick_gpus_refuses_when_too_few_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, [FakeGpu(used_gb=79), FakeGpu(used_gb=10)])
    job = compose_job("+experiment=rec", "resources.gpus_per_node=2", "resources.pick_gpus=true",
                      "resources.min_free_gpu_mem_gb=20")
    with pytest.raises(ConfigError, match=r"at most 1 here.*GPU 0: 10% busy, 1\.0 GB free"):
        choose_local_gpus(job.resources)


def test_a_local_run_that_finds_too_few_gpus_free_leaves_no_run_dir(tmp_path: Path) -> None:
    """The real CLI, its NVML faked for the submit side: the pick refuses after the lease and config
    were written, and takes both back."""
    env = fake_nvml_env(tmp_path / "gpus.json", [FakeGpu(used_gb=79), FakeGpu(used_gb=10)])
    run_dir = tmp_path / "run"
    proc = submit(run_dir, "+experiment=rec", "+debug=tiny", "cluster=local", "resources.gpus_per_node=2",
                  "resources.pick_gpus=true", "resources.min_free_gpu_mem_gb=20", env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpujobs: config error: resources.gpus_per_node=2"), proc.stderr
    assert not run_dir.exists(), sorted(str(p) for p in run_dir.rglob("*"))


def test_min_free_gpu_mem_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"resources\.min_free_gpu_mem_gb"):
        compose_job("+experiment=rec", "resources.min_free_gpu_mem_gb=-1")

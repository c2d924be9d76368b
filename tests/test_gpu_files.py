"""One GPU samples file a node (issue 39 D7): appends from several NFS clients to one file are not atomic, so
each node's sampler writes gpu.<node>.jsonl, and every reader (the report, the trackers' tail, the endpoint's
follower of the other nodes, `read_gpu_samples`) takes them all, and an earlier version's gpu.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from fake_nvml import FakeGpu, install

from gpujobs.rank.observe.gpu_sampler import GpuSampler
from gpujobs.rundir import GPU_FILE
from gpujobs.rundir.gpu_files import gpu_file, gpu_files, read_gpu_samples
from gpujobs.trackers.series import GpuTail


def test_each_nodes_sampler_writes_its_own_file_and_the_readers_take_every_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # two nodes' samplers, side by side here (NVML's answers faked: no GPU exists here; the samplers are real)
    install(monkeypatch, [FakeGpu(util=70, used_gb=20)])
    earlier = {"node": "old", "rank": 0, "gpu": 0, "uuid": "GPU-old", "util_pct": 1, "time": 1.0}
    (tmp_path / GPU_FILE).write_text(json.dumps(earlier) + "\n")  # an earlier version's shared file
    tail = GpuTail.from_now(tmp_path)  # an attempt's trackers: from now on, every node's file
    samplers = [GpuSampler(gpu_file(tmp_path, node), 0.02, node, {}) for node in ("n1", "n2.cluster")]
    assert all(s.start() for s in samplers)
    deadline = time.monotonic() + 30
    while len(read_gpu_samples(tmp_path)) < 7:
        assert time.monotonic() < deadline, "the samplers wrote no samples"
        time.sleep(0.02)
    for sampler in samplers:
        sampler.stop()
    assert [p.name for p in gpu_files(tmp_path)] == ["gpu.jsonl", "gpu.n1.jsonl", "gpu.n2.cluster.jsonl"]
    for node in ("n1", "n2.cluster"):  # each file holds its node's samples alone
        assert {s["node"] for s in map(json.loads, gpu_file(tmp_path, node).read_text().splitlines())} == {node}
    samples = read_gpu_samples(tmp_path)
    assert {s["node"] for s in samples} == {"old", "n1", "n2.cluster"}
    assert [s["time"] for s in samples] == sorted(s["time"] for s in samples)
    series = tail.read()
    assert "gpu/n1/gpu0/util_pct" in series and "gpu/n2.cluster/gpu0/util_pct" in series
    assert not any("/old/" in key for key in series)  # before the attempt began
    assert gpu_file(tmp_path, "a/b c").name == "gpu.a_b_c.jsonl"  # a node name never leaves the run dir

    # the report: both nodes' GPUs
    line = {"kind": "train", "step": 1, "loss": 0.5, "samples_per_s": 10.0, "time": time.time()}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    out = subprocess.run([sys.executable, "-m", "gpujobs.report", str(tmp_path)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "n1/GPU 0" in out.stdout and "n2.cluster/GPU 0" in out.stdout, out.stdout

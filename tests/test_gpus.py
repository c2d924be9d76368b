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

from gpujobs.backends.jobenv import DistInfo
from gpujobs.backends.local.gpus import choose_local_gpus, local_gpu_count
from gpujobs.base.atomic import read_jsonl
from gpujobs.base.errors import ConfigError
from gpujobs.base.nvml import rank_gpu_uuid
from gpujobs.rank.distributed import gpu_index_for, one_gpu_per_rank
from gpujobs.rank.observe.gpu_sampler import GpuSampler

SCRIPT = Path(__file__).parent / "scripts" / "torchrun_style.py"


def test_sampler_writes_one_line_per_gpu_and_omits_unsupported_fields(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    install(monkeypatch, [FakeGpu(util=80, used_gb=30), FakeGpu(util=5, power_limit=False, xids=[79]),
                          FakeGpu()])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-fake-1")  # the job sees GPUs 2 and 1, in that order
    seen: list[list[dict[str, object]]] = []
    sampler = GpuSampler(tmp_path / "gpu.jsonl", 0.05, "n1", {}, sink=seen.append)  # CPU ranks: no uuids
    assert sampler.start()
    deadline = time.monotonic() + 10
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    lines = [json.loads(line) for line in (tmp_path / "gpu.jsonl").read_text().splitlines()]
    assert len(lines) % 2 == 0 and len(lines) >= 4
    first, second = lines[0], lines[1]
    assert (first["gpu"], first["rank"], first["uuid"]) == (2, None, "GPU-fake-2")
    assert (second["gpu"], second["rank"], second["node"]) == (1, None, "n1")
    assert second["util_pct"] == 5 and second["power_w"] == 251.0 and second["sm_clock_mhz"] == 1980
    assert "power_limit_w" not in second and first["power_limit_w"] == 700.0
    assert "ecc_uncorrected" not in first  # NotSupported: left out, not faked as 0
    assert first["throttle"] == ["sw_power_cap"]  # gpu_idle is not a throttle
    assert second["xid"] == [79] and "xid" not in lines[3]  # reported once, when it happened
    assert first["mem_used_mib"] == pytest.approx(1e9 / 2**20, rel=1e-3)


def test_sampler_reads_the_gpus_the_ranks_reported_under_slurms_renumbering(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Slurm binds one GPU to each task and its device cgroup renumbers it: the sampler's own process
    sees CUDA_VISIBLE_DEVICES=0, which NVML (the node's numbers) reads as another job's GPU 0."""
    install(monkeypatch, [FakeGpu(util=99), FakeGpu(util=11), FakeGpu(util=99), FakeGpu(util=33)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    seen: list[list[dict[str, object]]] = []
    sampler = GpuSampler(tmp_path / "gpu.jsonl", 0.05, "n1", {"GPU-fake-3": 4, "GPU-fake-1": 5}, sink=seen.append)
    assert sampler.start()
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    assert [(r["gpu"], r["uuid"], r["rank"], r["util_pct"]) for r in seen[0]] == [
        (3, "GPU-fake-3", 4, 33), (1, "GPU-fake-1", 5, 11)]


def test_sampler_appends_after_a_torn_line_and_refuses_a_planted_link(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another node's sampler died mid-line: this one's first sample starts a line of its own and is read
    back whole. A link in gpu.jsonl's place is not written through: telemetry is off, and says why."""
    install(monkeypatch, [FakeGpu(), FakeGpu()])
    path = tmp_path / "gpu.jsonl"
    path.write_text('{"node": "n2", "gpu": 0, "util_pct": 9')
    seen: list[list[dict[str, object]]] = []
    sampler = GpuSampler(path, 0.05, "n1", {"GPU-fake-0": 0, "GPU-fake-1": 1}, sink=seen.append)
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
    # GPU 1 is idle but full; GPU 0 is busy
    assert [g.uuid for g in choose_local_gpus(job.resources)] == ["GPU-fake-2", "GPU-fake-3"]
    plain = compose_job("+experiment=rec", "resources.gpus_per_node=2")
    assert [g.uuid for g in choose_local_gpus(plain.resources)] == ["GPU-fake-0", "GPU-fake-1"]


def test_a_local_run_takes_its_gpus_among_those_cuda_visible_devices_names(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, [FakeGpu(util=0), FakeGpu(util=50), FakeGpu(util=90), FakeGpu(util=20)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-fake-1,3")  # indices (PCI bus order) and uuids, mixed
    assert local_gpu_count() == 3  # not the 4 NVML sees
    plain = compose_job("+experiment=rec", "resources.gpus_per_node=2")
    assert [g.uuid for g in choose_local_gpus(plain.resources)] == ["GPU-fake-2", "GPU-fake-1"]  # its order
    picked = compose_job("+experiment=rec", "resources.gpus_per_node=2", "resources.pick_gpus=true")
    # GPU 0 is the idlest, but the user did not give it to us
    assert [g.uuid for g in choose_local_gpus(picked.resources)] == ["GPU-fake-1", "GPU-fake-3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-fake-3,GPU-elsewhere,1")  # as CUDA, stop at what is not here
    assert local_gpu_count() == 1


def test_a_mig_slice_cuda_visible_devices_names_is_the_one_a_local_run_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, [FakeGpu(), FakeGpu(), FakeGpu(util=7, mig_of=1)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-fake-2")
    assert local_gpu_count() == 1
    job = compose_job("+experiment=rec", "resources.gpus_per_node=1", "resources.procs_per_node=1")
    assert [(g.uuid, g.index, g.util_pct) for g in choose_local_gpus(job.resources)] == [("MIG-fake-2", 1, 7)]


def test_more_gpus_than_cuda_visible_devices_names_are_refused_at_submit(tmp_path: Path) -> None:
    env = {**fake_nvml_env(tmp_path / "gpus.json", [FakeGpu()] * 4), "CUDA_VISIBLE_DEVICES": "GPU-fake-3,1"}
    run_dir = tmp_path / "run"
    proc = submit(run_dir, "+experiment=rec", "+debug=tiny", "cluster=local", "resources.gpus_per_node=3", env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["gpujobs: config error: resources.gpus_per_node=3 is invalid: allowed 0..2 (the GPUs "
                     "CUDA_VISIBLE_DEVICES='GPU-fake-3,1' names here)"], proc.stderr
    assert not run_dir.exists()


def test_the_ranks_get_the_users_gpus_by_uuid_in_pci_bus_order(tmp_path: Path) -> None:
    """A real local run (a torchrun-style script on 2 CPU ranks; only the driver's answers are faked): the
    user's CUDA_VISIBLE_DEVICES=3,GPU-fake-1 reaches the ranks as uuids, with CUDA told NVML's order."""
    env = {**fake_nvml_env(tmp_path / "gpus.json", [FakeGpu()] * 4), "CUDA_VISIBLE_DEVICES": "3,GPU-fake-1"}
    run_dir = tmp_path / "run"
    proc = submit(run_dir, "cluster=local", "resources.gpus_per_node=2", f"+script.path={SCRIPT}", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        seen = json.loads((run_dir / f"seen_rank{rank}.json").read_text())
        assert seen["gpus"] == {"CUDA_VISIBLE_DEVICES": "GPU-fake-3,GPU-fake-1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def _rank(rank: int, local_rank: int, local_world_size: int, node: str = "n1") -> DistInfo:
    return DistInfo(rank=rank, local_rank=local_rank, world_size=local_world_size,
                    local_world_size=local_world_size, master_addr="127.0.0.1", master_port=29500, node=node)


def test_each_rank_takes_its_own_gpu_or_is_refused_before_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [gpu_index_for(_rank(r, r, 4), 4) for r in range(4)] == [0, 1, 2, 3]
    assert [gpu_index_for(_rank(r, r, 4), 8) for r in range(4)] == [0, 1, 2, 3]
    assert gpu_index_for(_rank(3, 3, 4), 1) == 0  # Slurm bound one GPU to each task: cuda:0 is its own
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(ConfigError) as err:
        gpu_index_for(_rank(3, 3, 4), 2)  # rank 3 would have shared GPU 1 with rank 1
    assert str(err.value) == ("resources.gpus_per_node=4 is invalid: allowed at most the 2 GPUs visible to the "
                              "ranks on n1 (CUDA_VISIBLE_DEVICES='2,3'): one GPU per rank")


def test_ranks_that_report_one_gpu_are_refused_on_every_rank() -> None:
    bound = [  # one GPU bound to each task: every rank sees its own as CUDA index 0
        {"rank": 0, "node": "n1", "cuda_visible_devices": "0", "gpu_uuid": "GPU-a"},
        {"rank": 1, "node": "n1", "cuda_visible_devices": "0", "gpu_uuid": "GPU-b"},
        {"rank": 2, "node": "n2", "cuda_visible_devices": "0", "gpu_uuid": "GPU-c"},
        {"rank": 3, "node": "n2", "cuda_visible_devices": "0", "gpu_uuid": "GPU-c"},
    ]
    one_gpu_per_rank([*bound[:2], {"rank": 2, "node": "n2", "cuda_visible_devices": "", "gpu_uuid": None}])
    with pytest.raises(ConfigError) as err:
        one_gpu_per_rank(bound)
    assert str(err.value) == ("resources.gpus_per_node=2 is invalid: allowed at most the 1 GPU visible to the "
                              "ranks on n2 (CUDA_VISIBLE_DEVICES='0'): one GPU per rank; ranks 2, 3 all got GPU-c")


def test_a_rank_names_its_gpu_as_nvml_does() -> None:
    assert rank_gpu_uuid("5a8b6c2e-0d3f-4c1a-9e2b-7f6a5d4c3b2a") == "GPU-5a8b6c2e-0d3f-4c1a-9e2b-7f6a5d4c3b2a"
    assert rank_gpu_uuid("MIG-5a8b6c2e-0d3f-4c1a-9e2b-7f6a5d4c3b2a").startswith("MIG-5a8b")


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

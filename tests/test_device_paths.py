"""What a GPU run does differently from a CPU one, checked where the CPU allows (issue 25).

Where the difference shows only on a GPU (Adam's step counters staying off it, the non-blocking copy, one
device's CUDA stream restored on a rank that sees fewer), `bench/gpu_check.sh` checks it on a real one; here
the decisions are tested, and the paths they leave to the CPU are run for real.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch
from conftest import compose_job

from gpujobs.backends.jobenv import DistInfo
from gpujobs.rank.checkpoint import CheckpointManager
from gpujobs.rank.metrics import MetricsLog
from gpujobs.rank.precision import autocast_dtype, emulated_bf16
from gpujobs.rank.rng import cuda_state_for, rng_state, set_rng_state
from gpujobs.rank.train import load_task_builder
from gpujobs.rank.trainer import Trainer
from jobs.rec.data import pinned_staging
from jobs.rec.task import RecTask

CPU = torch.device("cpu")


def _trainer(run: Path, device: torch.device) -> Trainer:
    job = compose_job("+experiment=rec", "+debug=tiny", "trainer.max_steps=2", "checkpoint.every_steps=2",
                      "trainer.log_every=0", "data.num_train=512", "data.num_eval=256")
    torch.manual_seed(0)
    task = load_task_builder(job.task)(job.model, job.data, 1, job.trainer.grad_accum)
    info = DistInfo(0, 0, 1, 1, "127.0.0.1", 29500, "test")
    return Trainer(job, info, device, task, CheckpointManager(run, 2, 2, 0, world_size=1), MetricsLog(None))


@pytest.mark.filterwarnings("ignore:.*to a meta parameter:UserWarning")  # the stand-in has no values to copy into
def test_a_resume_loads_on_the_cpu_and_leaves_adams_step_counters_there(tmp_path: Path) -> None:
    _trainer(tmp_path, CPU).fit()
    # No CUDA here: the meta device stands in for the GPU, a device the parameters live on that is not the CPU.
    resumed = _trainer(tmp_path, torch.device("meta"))
    assert resumed.restore() and resumed.step == 2
    states = list(resumed.optimizer.state.values())
    assert len(states) == len(list(resumed.model.parameters()))
    for state in states:
        # Loaded where the parameters live, each `step` would cost Adam a device-to-host sync per step
        assert state["step"].device == CPU and float(state["step"]) == 2.0
        assert state["exp_avg"].device.type == "meta" and state["exp_avg_sq"].device.type == "meta"


@pytest.mark.parametrize(
    ("amp", "capabilities", "expected"),
    [
        ("auto", [(9, 0)], torch.bfloat16),  # H100, H200
        ("auto", [(8, 0), (8, 6)], torch.bfloat16),  # A100 with an A40
        ("auto", [(7, 0)], None),  # V100: bf16 emulated
        ("auto", [(7, 5)], None),  # T4
        ("auto", [(8, 0), (7, 5)], None),  # one older GPU: the whole job in fp32, one precision for all ranks
        ("auto", [], None),  # CPU
        ("bf16", [(7, 0)], torch.bfloat16),  # asked for: honoured, with a warning
        ("bf16", [], torch.bfloat16),
        ("off", [(9, 0)], None),
    ],
)
def test_amp_auto_picks_bf16_only_where_every_gpu_computes_it_natively(
    amp: str, capabilities: list[tuple[int, int]], expected: Optional[torch.dtype]
) -> None:
    assert autocast_dtype(amp, capabilities) == expected


def test_a_precision_other_than_native_bf16_on_a_gpu_is_warned_of() -> None:
    chosen = emulated_bf16("auto", [(8, 0), (7, 0)])
    assert chosen is not None and "trainer.amp=auto trains in fp32" in chosen and "7.0" in chosen, chosen
    assert "8.0" not in chosen.split("(")[0], chosen  # names the older GPUs, not all of them
    asked = emulated_bf16("bf16", [(7, 5)])
    assert asked is not None and "emulated" in asked and "7.5" in asked, asked
    assert emulated_bf16("auto", [(9, 0)]) is None and emulated_bf16("off", [(7, 0)]) is None
    assert emulated_bf16("auto", []) is None


def test_the_cuda_stream_restored_is_the_ranks_own_from_either_format(caplog: pytest.LogCaptureFixture) -> None:
    first, second = torch.full((16,), 1, dtype=torch.uint8), torch.full((16,), 2, dtype=torch.uint8)
    saved_before = [first, second]  # the old format: every GPU the rank saw, here two
    assert cuda_state_for(saved_before, torch.device("cuda", 1)) is second
    assert cuda_state_for(saved_before, torch.device("cuda", 0)) is first
    # Today's format: one stream, the rank's, restored on whatever device the rank has now
    assert cuda_state_for({"device": 3, "state": second}, torch.device("cuda", 0)) is second
    assert cuda_state_for({"device": 0, "state": first}, CPU) is None
    with caplog.at_level(logging.WARNING, logger="gpujobs.rank.rng"):
        assert cuda_state_for(saved_before, torch.device("cuda", 2)) is None
    assert "CUDA random state of 2 GPU(s), none for cuda:2" in caplog.text, caplog.text


def test_a_cpu_rank_saves_no_cuda_stream_and_restores_an_old_two_gpu_state(tmp_path: Path) -> None:
    state = rng_state(CPU)
    assert "cuda" not in state
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8)]
    torch.save(state, tmp_path / "rank_0.pt")
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    set_rng_state(torch.load(tmp_path / "rank_0.pt", weights_only=True), CPU)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_batches_are_staged_in_pinned_memory_for_cuda_only() -> None:
    assert pinned_staging(torch.device("cuda", 0)) and pinned_staging(torch.device("cuda"))
    assert not pinned_staging(CPU) and not pinned_staging(torch.device("meta"))


def test_a_cpu_batch_is_the_rows_themselves_unpinned() -> None:
    job = compose_job("+experiment=rec", "+debug=tiny")
    task = load_task_builder(job.task)(job.model, job.data, 1, 1)
    assert isinstance(task, RecTask)
    batch, rows = task.train_batch(3, 8, 40, CPU), task.data.train_rows(3, 8, 40)
    assert all(torch.equal(a, b) and a.device == CPU and not a.is_pinned() for a, b in zip(batch, rows, strict=True))

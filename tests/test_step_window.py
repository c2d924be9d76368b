"""A log window's bookkeeping on the rank (issue 39): what it keeps unread stays bounded whatever
`trainer.log_every` is (0: never logged), its time holds the device's work, and the step settings' knob."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import compose_job

from gpujobs.backends.jobenv import DistInfo
from gpujobs.rank import compute_clock
from gpujobs.rank.checkpoint import CheckpointManager
from gpujobs.rank.compute_clock import ComputeClock, StepTimes
from gpujobs.rank.metrics import MetricsLog
from gpujobs.rank.step_settings import SETTINGS_ENV, step_setting
from gpujobs.rank.train import load_task_builder
from gpujobs.rank.trainer import Trainer


def _trainer(run: Path, *overrides: str) -> Trainer:
    job = compose_job("+experiment=rec", "+debug=tiny", "checkpoint.every_steps=0", "trainer.eval_every=0",
                      "data.num_train=512", "data.num_eval=256", *overrides)
    torch.manual_seed(0)
    task = load_task_builder(job.task)(job.model, job.data, 1, job.trainer.grad_accum)
    info = DistInfo(0, 0, 1, 1, "127.0.0.1", 29500, "test")
    checkpoints = CheckpointManager(run, 0, 2, 0, world_size=1)
    return Trainer(job, info, torch.device("cpu"), task, checkpoints, MetricsLog(None))


def test_with_log_every_0_the_losses_kept_unread_stay_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compute_clock, "FOLD_AT", 8)
    kept: list[int] = []
    add = StepTimes.add_loss

    def spy(self: StepTimes, loss: torch.Tensor) -> None:  # the real method, its list's length noted
        add(self, loss)
        kept.append(len(self.losses))

    monkeypatch.setattr(StepTimes, "add_loss", spy)
    result = _trainer(tmp_path, "trainer.log_every=0", "trainer.max_steps=30", "trainer.grad_accum=2").fit()
    assert result["steps"] == 30 and len(kept) == 60
    assert max(kept) <= 8, kept


def test_folded_losses_sum_as_the_whole_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compute_clock, "FOLD_AT", 4)
    times, values = StepTimes(), [torch.tensor(float(i)) for i in range(1, 20)]
    for value in values:
        times.add_loss(value)
    assert len(times.losses) < 4 and times.loss_sum() == sum(range(1, 20))


class StandInEvent:
    """Stands in for torch.cuda.Event, as no CUDA exists here: recorded on the host clock, done at once (or,
    where `pending` says, not yet: a GPU still behind)."""

    pending = False

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0
        self.done = False

    def record(self) -> None:
        self.at, self.done = time.perf_counter(), not StandInEvent.pending

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end: Any) -> float:
        return (end.at - self.at) * 1000


def test_the_compute_clock_folds_the_events_the_gpu_is_done_with(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compute_clock, "FOLD_AT", 8)
    monkeypatch.setattr(torch.cuda, "Event", StandInEvent)
    clock = ComputeClock(torch.device("cuda", 0))  # a device object only: nothing runs on it
    longest = 0
    for micro in range(100):
        StandInEvent.pending = micro >= 95  # the last five still queued on the "GPU"
        clock.start()
        time.sleep(0.0005)
        clock.end()
        longest = max(longest, len(clock._pairs))
    assert longest <= 8 + 5
    total = clock.read()  # waits for the last, reads the rest
    assert 100 * 0.0005 <= total < 100 * 0.0005 + 1.0 and clock._pairs == []


def test_a_windows_time_holds_the_wait_for_the_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No CUDA here, so no queued GPU work: a wait of 0.3 s in `_device_done` stands in for the sync with it.
    # samples/s must count it: each window ends when the device is done, not when the host stopped queueing.
    trainer = _trainer(tmp_path, "trainer.log_every=5", "trainer.max_steps=10")
    waits: list[float] = []

    def device_done() -> float:
        time.sleep(0.3)
        waits.append(time.perf_counter())
        return waits[-1]

    monkeypatch.setattr(trainer, "_device_done", device_done)
    result = trainer.fit()
    assert len(waits) == 2  # the two log steps
    assert result["samples_per_s"] <= trainer.global_batch * 10 / 0.6, result


def test_the_check_only_knob_flips_a_step_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert step_setting("gradient_as_bucket_view") and step_setting("fused_adam") and not step_setting("static_graph")
    monkeypatch.setenv(SETTINGS_ENV, "gradient_as_bucket_view=0,static_graph=1")
    assert not step_setting("gradient_as_bucket_view") and step_setting("static_graph") and step_setting("fused_adam")
    monkeypatch.setenv(SETTINGS_ENV, "static=1")
    with pytest.raises(ValueError, match=r"NAME=0\|1 with NAME one of gradient_as_bucket_view"):
        step_setting("static_graph")

"""A process killed (SIGKILL) at random moments while saving never leaves a checkpoint that loads torn."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import torch

from gpujobs.rank.checkpoint import CheckpointManager

#: bench/bench_checkpoint.py --crash-trials N runs this test with many more trials.
TRIALS = int(os.environ.get("GPUJOBS_CRASH_TRIALS", "60"))


def _save_forever(directory: Path, step: int) -> None:
    torch.set_num_threads(1)
    manager = CheckpointManager(directory, every_steps=1, keep=2)
    while True:
        step += 1
        value = float(step)
        shared = {"model": {"w": torch.full((256, 256), value)}, "step": step}
        manager.save(step, lambda shared=shared: shared, {"rng": torch.full((64,), value)})


def manager_of(directory: Path) -> CheckpointManager:
    """A reader's view of the checkpoints in `directory`."""
    return CheckpointManager(directory, every_steps=1, keep=2)


def test_sigkill_while_saving_never_exposes_a_torn_checkpoint(tmp_path: Path) -> None:
    directory = tmp_path / "ck"
    chance = random.Random(1234)
    newest = 0
    for _ in range(TRIALS):
        pid = os.fork()
        if pid == 0:  # the saver: runs until killed
            try:
                _save_forever(directory, newest)
            finally:
                os._exit(1)
        # the saver has published a step past the last trial's before it dies somewhere in a later save:
        # progress however loaded the machine, and a kill at a random point of the saves that follow
        deadline = time.monotonic() + 60
        while max(manager_of(directory).complete_steps(), default=0) <= newest:  # (older ones get pruned)
            assert time.monotonic() < deadline, f"the saver published no step after {newest} in 60 s"
            time.sleep(0.001)
        time.sleep(chance.uniform(0.001, 0.03))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

        manager = CheckpointManager(directory, every_steps=1, keep=2)
        complete = manager.complete_steps()
        if not complete:
            continue
        # The newest complete checkpoint itself must load (no silent fallback) and be whole.
        path = manager.path_for(complete[-1])
        shared = torch.load(path / "state.pt", weights_only=True)
        own = torch.load(path / "rank_0.pt", weights_only=True)
        assert shared["step"] == complete[-1]
        assert torch.equal(shared["model"]["w"], torch.full((256, 256), float(complete[-1])))
        assert torch.equal(own["rng"], torch.full((64,), float(complete[-1])))
        loaded, skipped = manager.load_latest()
        assert loaded is not None and loaded.step == complete[-1] and skipped == []
        assert complete[-1] >= newest  # never goes back
        newest = complete[-1]
    assert newest >= TRIALS  # every saver published at least one step before its kill

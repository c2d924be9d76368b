"""Background checkpoints (`save_async`, `poll`, `wait`): same guarantees as a synchronous save.

One-rank tests use no process group (as gpujobs runs one rank); the agreement tests are real 2-rank
gloo groups in spawned processes, with a real full disk (a small tmpfs) and real damage. While a
save is in flight the ranks keep issuing all-reduces on the training group, as DDP does: the
background save's collectives go through their own groups and must not tangle with them.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_checkpoint_agreement import assert_all_fell_back_to_step_1, damage_rank_1_and_resume
from test_faults import small_disk

from gpujobs.rank.checkpoint import Checkpointed, CheckpointManager, CheckpointNotSaved
from gpujobs.rundir import MARKER
from gpujobs.rundir.marker import SavedRun

WORLD = 2
#: Step boundaries a rank waits through for a background save before the test calls it stuck.
MAX_POLLS = 100_000


def _manager(directory: Path, rank: int = 0, keep: int = 3) -> CheckpointManager:
    return CheckpointManager(directory, every_steps=1, keep=keep, rank=rank, background=True)


def _temporaries(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(".tmp-")]


# ---------------------------------------------------------------- one rank
def test_the_snapshot_is_a_copy_taken_before_save_async_returns(tmp_path: Path) -> None:
    manager = _manager(tmp_path / "ck")
    model = torch.nn.Linear(4, 3)
    rng = torch.arange(5.0)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    manager.save_async(1, lambda: {"model": model.state_dict(), "step": 1}, {"rng": rng})
    assert manager.in_flight == 1
    with torch.no_grad():  # training goes on at once, in place, while the save is written
        model.weight.add_(100.0)
        model.bias.zero_()
    rng.add_(1.0)
    assert manager.wait() == manager.path_for(1)
    assert manager.in_flight is None and manager.poll() is None

    # the next snapshot reuses the first one's host memory: it must hold the new values, and the
    # first checkpoint keeps its own
    manager.save_async(2, lambda: {"model": model.state_dict(), "step": 2}, {"rng": rng})
    assert manager.wait() == manager.path_for(2)
    loaded, skipped = manager.load_latest()
    assert loaded is not None and loaded.step == 2 and skipped == []
    assert torch.equal(loaded.shared["model"]["weight"], before["weight"] + 100.0)
    assert torch.equal(loaded.own["rng"], torch.arange(5.0) + 1.0)
    first = torch.load(manager.path_for(1) / "state.pt", weights_only=True)
    for name, value in before.items():
        assert torch.equal(first["model"][name], value)
    assert torch.equal(torch.load(manager.path_for(1) / "rank_0.pt", weights_only=True)["rng"], torch.arange(5.0))
    model.load_state_dict(first["model"])  # a snapshot of a state_dict loads back as one


def test_a_synchronous_save_first_waits_for_the_one_in_flight(tmp_path: Path) -> None:
    manager = _manager(tmp_path / "ck")
    big = {"w": torch.randn(2_000_000)}  # 8 MB: still being written when save() is called
    manager.save_async(1, lambda: big, {"rng": torch.zeros(2)})
    path = manager.save(2, lambda: big, {"rng": torch.ones(2)})
    assert path == manager.path_for(2)
    assert manager.in_flight is None  # save() took the outcome of step 1's save
    assert manager.complete_steps() == [1, 2]
    assert manager.poll() is None  # nothing in flight: no outcome to report twice


def test_a_failure_in_flight_is_raised_by_the_next_save_and_publishes_nothing(tmp_path: Path) -> None:
    manager = _manager(tmp_path / "ck")
    manager.save(1, lambda: {"w": torch.ones(3)}, {})

    def explode() -> dict[str, Any]:
        raise OSError(28, "No space left on device")

    manager.save_async(2, explode, {})  # taking the snapshot fails: the background write reports it
    with pytest.raises(CheckpointNotSaved) as err:
        manager.save(3, lambda: {"w": torch.ones(3)}, {})
    assert "step 2 not saved" in str(err.value) and "No space left" in str(err.value)
    assert "last good: step 1" in str(err.value)
    assert manager.complete_steps() == [1] and _temporaries(tmp_path / "ck") == []
    assert manager.in_flight is None and manager.save(3, lambda: {"w": torch.ones(3)}, {}) == manager.path_for(3)


def test_an_exception_in_the_background_thread_is_the_saves_outcome(tmp_path: Path) -> None:
    manager = _manager(tmp_path / "ck")
    # the marker cannot hold this: json raises TypeError on the thread, while publishing
    manager.save_async(1, lambda: {"w": torch.ones(3)}, {}, SavedRun(config={"not_json": object()}))
    with pytest.raises(CheckpointNotSaved) as err:
        manager.wait()
    assert "step 1 not saved" in str(err.value) and "rank 0 publishing" in str(err.value)
    assert "not JSON serializable" in str(err.value)
    assert manager.complete_steps() == []


def test_close_lets_the_save_in_flight_finish(tmp_path: Path) -> None:
    manager = _manager(tmp_path / "ck")
    manager.save_async(1, lambda: {"w": torch.randn(4_000_000)}, {"rng": torch.zeros(2)})
    manager.close()
    assert manager.in_flight is None
    assert manager.complete_steps() == [1] and _temporaries(tmp_path / "ck") == []


def test_blocking_time_is_recorded_for_both_kinds_of_save(tmp_path: Path) -> None:
    manager = _manager(tmp_path / "ck")
    manager.last_blocking_s = -1.0
    manager.save_async(1, lambda: {"w": torch.ones(3)}, {})
    assert manager.last_blocking_s > 0
    manager.last_blocking_s = -1.0
    manager.save(2, lambda: {"w": torch.ones(3)}, {})  # includes waiting for step 1's
    assert manager.last_blocking_s > 0


def test_maybe_save_saves_periodic_steps_in_the_background_and_the_last_and_a_stop_in_the_foreground(
    tmp_path: Path,
) -> None:
    manager = _manager(tmp_path / "ck", keep=5)
    manager.track(Checkpointed(lambda: {"w": torch.randn(1_000_000)}, lambda: {}, SavedRun, 4))
    first = manager.maybe_save(2)
    assert first is not None and first.background and manager.in_flight == 2
    stop = manager.maybe_save(2, stop=True)  # the ranks agreed to stop after step 2: its save is published now
    assert stop is None and manager.in_flight is None and manager.published == manager.path_for(2)
    last = manager.maybe_save(4)
    assert last is not None and not last.background and manager.complete_steps() == [2, 4]


# ---------------------------------------------------------------- real ranks
def _poll_until_over(manager: CheckpointManager) -> dict[str, Any]:
    """Step boundaries until the save in flight is over, with a training-group all-reduce at each (as
    DDP's) so the background save runs concurrently with it; the boundary and the outcome seen."""
    for boundary in range(1, MAX_POLLS):
        grads = torch.ones(16)
        dist.all_reduce(grads)
        assert torch.equal(grads, torch.full((16,), float(WORLD)))  # the training group is untangled
        try:
            path = manager.poll()
        except CheckpointNotSaved as err:
            return {"boundary": boundary, "not_saved": str(err)}
        if path is not None:
            return {"boundary": boundary, "path": str(path)}
    raise AssertionError("the background save never ended")


def _worker(rank: int, root: str, checkpoints: str, scenario: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),  # a tangle of collectives fails the test instead of hanging it
    )
    manager = _manager(Path(checkpoints), rank)
    out: dict[str, Any] = {}
    manager.save(1, lambda: {"w": torch.full((4,), 1.0)}, {"rng": torch.full((2,), 1.0 + rank)})
    if scenario == "full_disk":
        # 4 MB of shared state on a 2 MB filesystem: rank 0's background write hits ENOSPC
        manager.save_async(2, lambda: {"w": torch.randn(1_000_000)}, {"rng": torch.full((2,), 2.0 + rank)})
        out["second"] = _poll_until_over(manager)
    elif scenario == "damaged_rank_file":
        manager.save_async(2, lambda: {"w": torch.full((4,), 2.0)}, {"rng": torch.full((2,), 2.0 + rank)})
        out["second"] = _poll_until_over(manager)
        if rank == 0:  # nothing in flight: no collective, or rank 0 would wait here for rank 1 in vain
            assert [manager.poll() for _ in range(5)] == [None] * 5
        out["marker_world_size"] = json.loads((manager.path_for(2) / MARKER).read_text())["world_size"]
        out.update(damage_rank_1_and_resume(manager))
    out["complete"] = manager.complete_steps()
    (Path(root) / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def _run(root: Path, checkpoints: Path, scenario: str) -> list[dict[str, Any]]:
    mp.spawn(_worker, args=(str(root), str(checkpoints), scenario), nprocs=WORLD, join=True)
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_a_disk_full_during_a_background_write_is_reported_on_every_rank_at_the_same_step(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "2m") as disk:
        ranks = _run(tmp_path, disk / "ck", "full_disk")
        assert _temporaries(disk / "ck") == []
        assert not (disk / "ck" / "step_00000002").exists()
    assert ranks[0]["second"] == ranks[1]["second"]  # the same boundary, the same message
    message = ranks[0]["second"]["not_saved"]
    assert "step 2 not saved" in message and "rank 0: " in message and "No space left on device" in message
    assert "last good: step 1" in message
    for out in ranks:
        assert out["complete"] == [1]  # nothing published, nothing pruned


def test_a_damaged_rank_file_after_an_async_save_falls_back_as_after_a_sync_one(tmp_path: Path) -> None:
    ranks = _run(tmp_path, tmp_path / "ck", "damaged_rank_file")
    assert ranks[0]["second"] == ranks[1]["second"] and ranks[0]["second"]["path"].endswith("step_00000002")
    assert [out["marker_world_size"] for out in ranks] == [WORLD, WORLD]
    assert_all_fell_back_to_step_1(ranks)  # exactly as after a synchronous save

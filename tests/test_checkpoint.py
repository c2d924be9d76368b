"""CheckpointManager on one rank: round trip, verification, retention, and failing saves that lose nothing."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from gpujobs.rank.checkpoint import Checkpointed, CheckpointManager, CheckpointNotSaved
from gpujobs.rundir import MARKER
from gpujobs.rundir.marker import BadMarker, FileEntry, SavedBalance, SavedRun, newest_marker, read_marker


def state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"model": {"w": torch.randn(4, 3)}, "step": step, "config": {"name": "t", "lr": 0.1}}


def save(manager: CheckpointManager, step: int) -> Path:
    return manager.save(step, lambda: state(step), {"rng": torch.full((3,), float(step))})


def test_round_trip_keeps_tensors_and_plain_values(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ck", every_steps=10, keep=2)
    rng = torch.get_rng_state()
    path = manager.save(10, lambda: state(10), {"rng": rng})
    assert (path / MARKER).is_file()
    loaded, skipped = manager.load_latest()
    assert loaded is not None and skipped == []
    assert loaded.step == 10 and loaded.path == str(path) and loaded.marker.world_size == 1
    assert torch.equal(loaded.shared["model"]["w"], state(10)["model"]["w"])
    assert loaded.shared["config"] == state(10)["config"]
    assert torch.equal(loaded.own["rng"], rng)


def test_the_marker_lists_every_file_with_size_and_checksum(tmp_path: Path) -> None:
    path = save(CheckpointManager(tmp_path / "ck", every_steps=1, keep=1), 3)
    files = json.loads((path / MARKER).read_text())["files"]
    assert sorted(files) == ["rank_0.pt", "state.pt"]
    for name, entry in files.items():
        assert entry["size"] == (path / name).stat().st_size and isinstance(entry["crc32"], int)
        assert entry["crc32"] == zlib.crc32((path / name).read_bytes())  # taken as torch.save wrote it


def test_a_large_file_is_checksummed_as_it_is_written_and_verifies(tmp_path: Path) -> None:
    """A tensor's storage of 8 MiB or more is checksummed beside its write (on a helper thread)."""
    manager = CheckpointManager(tmp_path / "ck", every_steps=1, keep=1)
    big = {"w": torch.randn(3 << 20), "step": 1}  # 12 MiB
    path = manager.save(1, lambda: big, {"rng": torch.zeros(2)})
    entry = json.loads((path / MARKER).read_text())["files"]["state.pt"]
    assert entry["crc32"] == zlib.crc32((path / "state.pt").read_bytes())
    loaded, skipped = manager.load_latest()
    assert loaded is not None and skipped == [] and torch.equal(loaded.shared["w"], big["w"])


def test_one_marker_reader_for_both_sides(tmp_path: Path) -> None:
    """The checkpointer writes the marker through `Marker`; the torch-free reader gives the same record back,
    and refuses what is no marker (its step is then no checkpoint on either side)."""
    (tmp_path / "run").mkdir()
    manager = CheckpointManager(tmp_path / "run" / "checkpoints", every_steps=1, keep=2)
    run = SavedRun({"trainer": {"max_steps": 4}}, 64, 128, SavedBalance("dynamic", [{"step": 0, "shares": [1.0],
                                                                                    "counts": [64]}]))
    path = manager.save(2, lambda: state(2), {"rng": torch.zeros(2)}, run)
    marker = read_marker(path)
    assert marker.step == 2 and marker.world_size == 1 and marker.run == run
    assert sorted(marker.files) == ["rank_0.pt", "state.pt"]
    assert marker.files["state.pt"] == FileEntry((path / "state.pt").stat().st_size,
                                                 zlib.crc32((path / "state.pt").read_bytes()))
    assert newest_marker(tmp_path / "run") == (path, marker)
    for garbage in ("[]", '{"step": "2"}', '{"step": 2, "files": {"state.pt": 7}}', "{torn"):
        (path / MARKER).write_text(garbage)
        with pytest.raises(BadMarker):
            read_marker(path)
    assert newest_marker(tmp_path / "run") is None


def test_keeps_only_the_last_k(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ck", every_steps=1, keep=2)
    for step in (1, 2, 3, 4):
        save(manager, step)
    assert manager.complete_steps() == [3, 4]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_00000003", "step_00000004"]


def test_pruning_never_removes_the_checkpoint_just_published(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ck", every_steps=1, keep=1)
    save(manager, 300)  # a newer step than the run now saving (another life of the run dir)
    save(manager, 10)
    assert manager.complete_steps() == [10, 300]


def test_a_directory_without_marker_is_never_loaded(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ck", every_steps=1, keep=3)
    save(manager, 1)
    torn = manager.path_for(2)
    torn.mkdir()
    (torn / "state.pt").write_bytes(b"half a file")
    loaded, _ = manager.load_latest()
    assert loaded is not None and loaded.step == 1
    save(manager, 3)  # the next save sweeps the torn one away
    assert not torn.exists()
    assert manager.complete_steps() == [1, 3]


def test_a_temp_dir_whose_marker_is_written_but_not_renamed_is_no_checkpoint(tmp_path: Path) -> None:
    """The marker is written into the temp dir before its rename: a save killed between the two leaves
    a whole step under the temp name, which is never listed or loaded, and the next save sweeps away."""
    manager = CheckpointManager(tmp_path / "ck", every_steps=1, keep=3)
    save(manager, 1)
    elsewhere = save(CheckpointManager(tmp_path / "other", every_steps=1, keep=1), 2)
    assert sorted(p.name for p in elsewhere.iterdir()) == [MARKER, "rank_0.pt", "state.pt"]
    unrenamed = tmp_path / "ck" / ".tmp-step_00000002"
    elsewhere.rename(unrenamed)  # as the kill left it: marker and files durable, not yet renamed
    assert manager.complete_steps() == [1]
    loaded, skipped = manager.load_latest()
    assert loaded is not None and loaded.step == 1 and skipped == []
    save(manager, 3)
    assert not unrenamed.exists() and manager.complete_steps() == [1, 3]


def test_failing_save_publishes_nothing_and_names_the_last_good_step(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ck", every_steps=1, keep=1)
    save(manager, 1)

    def explode() -> dict[str, Any]:
        raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointNotSaved) as err:
        manager.save(2, explode, {})
    assert "step 2 not saved" in str(err.value) and "No space left" in str(err.value)
    assert "last good: step 1" in str(err.value)
    assert manager.complete_steps() == [1]
    loaded, _ = manager.load_latest()
    assert loaded is not None and torch.equal(loaded.shared["model"]["w"], state(1)["model"]["w"])
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["step_00000001"]


def test_a_temp_dir_planted_as_a_link_is_not_written_through(tmp_path: Path) -> None:
    """Someone who could once write the run dir planted the next save's temp dir as a link to a folder
    elsewhere: the save fails, saying so, and nothing lands in that folder."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    manager = CheckpointManager(tmp_path / "ck", every_steps=1, keep=1)
    save(manager, 1)
    (tmp_path / "ck" / ".tmp-step_00000002").symlink_to(elsewhere)
    with pytest.raises(CheckpointNotSaved, match=r"\.tmp-step_00000002 is a symlink"):
        save(manager, 2)
    assert list(elsewhere.iterdir()) == []
    assert manager.complete_steps() == [1]


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_a_damaged_newest_checkpoint_falls_back_and_says_so(tmp_path: Path, damage: str) -> None:
    manager = CheckpointManager(tmp_path / "ck", every_steps=1, keep=3)
    save(manager, 1)
    save(manager, 2)
    victim = manager.path_for(2) / "rank_0.pt"
    data = bytearray(victim.read_bytes())
    if damage == "flip":  # same size, one byte in the middle: only the checksum sees it
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[:-10]))
    else:
        victim.unlink()
    loaded, skipped = manager.load_latest()
    assert loaded is not None and loaded.step == 1
    assert [s["step"] for s in skipped] == [2] and "rank 0: " in skipped[0]["why"]
    assert "rank_0.pt" in skipped[0]["why"]


def test_policy_saves_on_cadence_and_at_the_end(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, every_steps=5, keep=1)
    assert [s for s in range(1, 13) if manager.should_save(s, 12)] == [5, 10, 12]
    never = CheckpointManager(tmp_path, every_steps=0, keep=1)
    assert [s for s in range(1, 13) if never.should_save(s, 12)] == [12]


def _tracked(manager: CheckpointManager, last_step: int) -> CheckpointManager:
    manager.track(Checkpointed(lambda: state(1), lambda: {"rng": torch.zeros(2)}, SavedRun, last_step))
    return manager


def test_maybe_save_follows_the_policy_and_saves_at_an_agreed_stop(tmp_path: Path) -> None:
    manager = _tracked(CheckpointManager(tmp_path / "ck", every_steps=5, keep=5), last_step=12)
    taken = [manager.maybe_save(step) for step in range(1, 13)]
    assert [t.step for t in taken if t is not None] == [5, 10, 12]
    assert not any(t.background for t in taken if t is not None)
    assert manager.complete_steps() == [5, 10, 12] and manager.published == manager.path_for(12)
    assert manager.maybe_save(12) is None  # saved already: once per step

    stopped = _tracked(CheckpointManager(tmp_path / "stop", every_steps=5, keep=5), last_step=12)
    assert stopped.maybe_save(3) is None
    taken_at_stop = stopped.maybe_save(3, stop=True)
    assert taken_at_stop is not None and not taken_at_stop.background and stopped.complete_steps() == [3]


def test_loading_refuses_pickled_code(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ck", every_steps=1, keep=2)
    save(manager, 1)

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (print, ("pwned",))

    manager.save(2, lambda: {"payload": Evil()}, {})
    loaded, skipped = manager.load_latest()  # weights_only=True rejects step 2 and falls back
    assert loaded is not None and loaded.step == 1 and [s["step"] for s in skipped] == [2]


@pytest.mark.parametrize("planted", ["step dir", "state.pt", "rank_0.pt", MARKER])
def test_a_planted_symlink_in_a_checkpoint_is_skipped_never_followed(tmp_path: Path, planted: str) -> None:
    """Whoever could once write the run dir plants a link to a checkpoint of theirs that verifies (step 5):
    the resume logs it as skipped and takes the older step of its own."""
    theirs = save(CheckpointManager(tmp_path / "theirs", every_steps=1, keep=1), 5)
    manager = CheckpointManager(tmp_path / "ck", every_steps=1, keep=3)
    save(manager, 3)
    step = manager.path_for(5)
    if planted == "step dir":
        step.symlink_to(theirs, target_is_directory=True)
    else:
        shutil.copytree(theirs, step)
        (step / planted).unlink()
        (step / planted).symlink_to(theirs / planted)
    loaded, skipped = manager.load_latest()
    assert loaded is not None and loaded.step == 3, loaded
    link = step if planted == "step dir" else step / planted
    assert skipped == [{"step": 5, "why": f"rank 0: {link} is a symlink"
                        + (": the job does not read it (remove it, if it is no run's)" if planted == "step dir"
                           else ": the job does not follow it (remove it, if it is no run's)")}], skipped

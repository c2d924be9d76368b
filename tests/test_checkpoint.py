"""CheckpointManager: round trip, atomicity, retention, and a failing save that loses nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpujobs.run.checkpoint import MARKER, CheckpointManager


def state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"model": {"w": torch.randn(4, 3)}, "step": step, "config": {"name": "t", "lr": 0.1}}


def test_round_trip_keeps_tensors_and_plain_values(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ck", every_steps=10, keep=2)
    saved = state(10)
    path = manager.save(10, lambda: saved, {"rng": torch.get_rng_state()})
    assert path is not None and (path / MARKER).is_file()
    loaded = manager.load_latest()
    assert loaded is not None
    assert loaded["step"] == 10
    assert torch.equal(loaded["shared"]["model"]["w"], saved["model"]["w"])
    assert loaded["shared"]["config"] == saved["config"]
    assert torch.equal(loaded["rank"]["rng"], torch.get_rng_state())


def test_keeps_only_the_last_k(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ck", every_steps=1, keep=2)
    for step in (1, 2, 3, 4):
        manager.save(step, lambda s=step: state(s), {})
    assert manager.complete_steps() == [3, 4]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_00000003", "step_00000004"]


def test_a_directory_without_marker_is_never_loaded(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ck", every_steps=1, keep=3)
    manager.save(1, lambda: state(1), {})
    torn = manager.path_for(2)
    torn.mkdir()
    (torn / "state.pt").write_bytes(b"half a file")
    loaded = manager.load_latest()
    assert loaded is not None and loaded["step"] == 1
    manager.save(3, lambda: state(3), {})  # the next save sweeps the torn one away
    assert not torn.exists()
    assert manager.complete_steps() == [1, 3]


def test_failing_save_leaves_the_previous_checkpoint_intact(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    manager = CheckpointManager(tmp_path / "ck", every_steps=1, keep=1)
    manager.save(1, lambda: state(1), {})

    def explode() -> dict[str, Any]:
        raise OSError(28, "No space left on device")

    assert manager.save(2, explode, {}) is None
    assert "not saved" in caplog.text and "No space left" in caplog.text
    assert manager.complete_steps() == [1]
    loaded = manager.load_latest()
    assert loaded is not None and torch.equal(loaded["shared"]["model"]["w"], state(1)["model"]["w"])
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["step_00000001"]


def test_unreadable_complete_checkpoint_falls_back_to_an_older_one(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ck", every_steps=1, keep=3)
    manager.save(1, lambda: state(1), {})
    manager.save(2, lambda: state(2), {})
    (manager.path_for(2) / "state.pt").write_bytes(b"corrupted")
    loaded = manager.load_latest()
    assert loaded is not None and loaded["step"] == 1


def test_policy_saves_on_cadence_and_at_the_end(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, every_steps=5, keep=1)
    assert [s for s in range(1, 13) if manager.should_save(s, 12)] == [5, 10, 12]
    never = CheckpointManager(tmp_path, every_steps=0, keep=1)
    assert [s for s in range(1, 13) if never.should_save(s, 12)] == [12]


def test_loading_refuses_pickled_code(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ck", every_steps=1, keep=2)
    manager.save(1, lambda: state(1), {})

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (print, ("pwned",))

    path = manager.save(2, lambda: {"payload": Evil()}, {})
    assert path is not None
    loaded = manager.load_latest()  # weights_only=True rejects step 2 and falls back
    assert loaded is not None and loaded["step"] == 1

"""Saves and resumes are agreed by every rank: real gloo process groups, real files, real damage.

Most scenarios run 2 ranks; the elastic one saves at 2 and resumes at 1 (no process group, as gpujobs
runs one rank) and at 3.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpujobs.rank.checkpoint import CheckpointManager, CheckpointNotSaved

WORLD = 2


def _state(step: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((8,), float(step))}, "step": step}


def _save(manager: CheckpointManager, step: int) -> Any:
    try:
        return str(manager.save(step, lambda: _state(step), {"rng": torch.full((2,), float(step + manager.rank))}))
    except CheckpointNotSaved as err:
        return {"not_saved": str(err)}


def damage_rank_1_and_resume(manager: CheckpointManager) -> dict[str, Any]:
    """Collective, once steps 1 and 2 are saved: rank 0 flips a byte of rank 1's file of step 2
    (same size: only the checksum sees it), then every rank resumes; what it loaded and skipped."""
    dist.barrier()
    if manager.rank == 0:
        victim = manager.path_for(2) / "rank_1.pt"
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    dist.barrier()
    loaded, skipped = manager.load_latest()
    return {
        "loaded": None if loaded is None else loaded.step,
        "own_rng": None if loaded is None else loaded.own["rng"].tolist(),
        "skipped": skipped,
    }


def assert_all_fell_back_to_step_1(ranks: list[dict[str, Any]]) -> None:
    """What `damage_rank_1_and_resume` must find on every rank."""
    assert [out["loaded"] for out in ranks] == [1, 1]
    assert [out["own_rng"] for out in ranks] == [[1.0, 1.0], [2.0, 2.0]]  # each rank its own file of step 1
    for out in ranks:
        assert [s["step"] for s in out["skipped"]] == [2]
        assert "rank 1: rank_1.pt fails its checksum" in out["skipped"][0]["why"]


def _worker(rank: int, root: str, scenario: str, world: int = WORLD) -> None:
    torch.set_num_threads(1)
    if world > 1:
        rendezvous = f"file://{root}/rendezvous-{scenario}"  # a file store serves one group only
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    manager = CheckpointManager(Path(root) / "ck", every_steps=1, keep=3, rank=rank)
    out: dict[str, Any] = {}
    if scenario.startswith("resume_at_"):  # the checkpoints of an earlier life of the run, at WORLD ranks
        loaded, skipped = manager.load_latest()
        out["loaded"] = None if loaded is None else loaded.step
        out["shared_w"] = None if loaded is None else loaded.shared["model"]["w"].tolist()
        out["own"] = None if loaded is None else loaded.own
        out["saved_world"] = None if loaded is None else loaded.marker.world_size
        out["skipped"] = skipped
        (Path(root) / f"{scenario}-rank{rank}.json").write_text(json.dumps(out))
        if world > 1:
            dist.destroy_process_group()
        return
    out["first"] = _save(manager, 1)
    if scenario == "blocked_rank_file":
        # rank 1 cannot write its file (a directory stands where it goes): a real failure in the write path
        if rank == 1:
            (Path(root) / "ck" / ".tmp-step_00000002" / "rank_1.pt").mkdir(parents=True)
        out["second"] = _save(manager, 2)
    elif scenario == "damaged_rank_file":
        out["second"] = _save(manager, 2)
        out.update(damage_rank_1_and_resume(manager))
    elif scenario == "two_steps":
        out["second"] = _save(manager, 2)
    out["complete"] = manager.complete_steps()
    (Path(root) / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def _run(tmp_path: Path, scenario: str) -> list[dict[str, Any]]:
    mp.spawn(_worker, args=(str(tmp_path), scenario), nprocs=WORLD, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_one_rank_failing_to_save_publishes_nothing_on_any_rank(tmp_path: Path) -> None:
    ranks = _run(tmp_path, "blocked_rank_file")
    for out in ranks:
        assert out["first"].endswith("step_00000001")
        assert "not_saved" in out["second"], out
        assert out["complete"] == [1]  # nothing published, nothing pruned
    # the same answer on every rank, naming the failing rank, the step and the last good one
    assert ranks[0]["second"] == ranks[1]["second"]
    message = ranks[0]["second"]["not_saved"]
    assert "step 2 not saved" in message and "rank 1: " in message and "last good: step 1" in message
    assert not (tmp_path / "ck" / "step_00000002").exists()
    assert not (tmp_path / "ck" / ".tmp-step_00000002").exists()


def test_a_damaged_rank_file_sends_every_rank_back_to_the_same_older_step(tmp_path: Path) -> None:
    assert_all_fell_back_to_step_1(_run(tmp_path, "damaged_rank_file"))


def test_a_checkpoint_of_two_ranks_resumes_at_one_and_at_three_with_the_shared_state_only(tmp_path: Path) -> None:
    for out in _run(tmp_path, "two_steps"):
        assert out["complete"] == [1, 2]
    newest = tmp_path / "ck" / "step_00000002"
    # A rank file of the old layout is not even read at another world size: rank 1 of the 3-rank
    # resume would otherwise fail on it and send everyone back to step 1.
    (newest / "rank_1.pt").unlink()
    for world in (1, 3):
        scenario = f"resume_at_{world}"
        mp.spawn(_worker, args=(str(tmp_path), scenario, world), nprocs=world, join=True)
        ranks = [json.loads((tmp_path / f"{scenario}-rank{r}.json").read_text()) for r in range(world)]
        for out in ranks:
            assert out["loaded"] == 2 and out["skipped"] == [], (world, out)
            assert out["shared_w"] == [2.0] * 8 and out["saved_world"] == WORLD
            assert out["own"] == {}  # per-rank state of 2 ranks does not map onto 1 or 3

"""The global sample stream in real runs: any split trains the same, plans replay, worlds change.

Real gloo ranks through the CLI. What is compared is what was trained: parameters (to float
rounding when the split differs, bit for bit when it does not), global samples and AUC.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, read_result, submit
from jobctl import RunningJob, attempts

TINY = ("+experiment=rec", "+debug=tiny", "cluster=local", "checkpoint.every_steps=0")


def _final_parameters(run_dir: Path) -> dict[str, torch.Tensor]:
    (step,) = sorted((run_dir / "checkpoints").glob("step_*"))
    state = torch.load(step / "state.pt", weights_only=True)
    return {key: value.double() for key, value in state["model"].items()}


def _ok(run_dir: Path, *overrides: str) -> dict[str, object]:
    proc = submit(run_dir, *TINY, *overrides)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return read_result(run_dir)


@pytest.mark.parametrize("accum", [1, 2])
def test_one_step_over_the_same_global_batch_is_the_same_whatever_the_split(tmp_path: Path, accum: int) -> None:
    step = ("trainer.max_steps=1", f"trainer.grad_accum={accum}", "data.global_batch_size=128",
            "trainer.grad_clip=null")
    _ok(tmp_path / "even", *step)
    _ok(tmp_path / "skewed", *step, "trainer.balance=static", "trainer.balance_shares=[0.8,0.2]")
    plans = [r for r in read_metrics(tmp_path / "skewed") if r["kind"] == "plan"]
    assert plans[0]["counts"] == ([51, 13] if accum == 2 else [102, 26])
    even, skewed = _final_parameters(tmp_path / "even"), _final_parameters(tmp_path / "skewed")
    assert even.keys() == skewed.keys() and even
    for key, value in even.items():
        torch.testing.assert_close(skewed[key], value, rtol=1e-6, atol=1e-7)


def test_off_and_static_runs_give_the_same_digest_twice(tmp_path: Path) -> None:
    digests: dict[str, set[object]] = {"off": set(), "static": set()}
    for attempt in range(2):
        digests["off"].add(_ok(tmp_path / f"off{attempt}")["param_digest"])
        static = ("trainer.balance=static", "trainer.balance_shares=[3,1]")
        digests["static"].add(_ok(tmp_path / f"static{attempt}", *static)["param_digest"])
    assert len(digests["off"]) == 1 and len(digests["static"]) == 1


def test_replay_of_a_dynamic_run_gives_its_digest(tmp_path: Path) -> None:
    dynamic = ("trainer.balance=dynamic", "trainer.balance_every=2", "trainer.balance_max_change=0.3",
               "telemetry.debug_slow_rank=1", "telemetry.debug_slow_factor=4")
    original = _ok(tmp_path / "dynamic", *dynamic)
    plans = [r for r in read_metrics(tmp_path / "dynamic") if r["kind"] == "plan"]
    assert len({tuple(p["counts"]) for p in plans}) >= 2, plans  # the plan did move
    assert plans[-1]["counts"][1] < plans[-1]["counts"][0]  # away from the slowed rank
    replayed = _ok(tmp_path / "replay", "trainer.balance=replay", f"trainer.balance_replay={tmp_path / 'dynamic'}")
    assert replayed["param_digest"] == original["param_digest"]
    replans = [r for r in read_metrics(tmp_path / "replay") if r["kind"] == "plan"]
    assert [(p["step"], p["counts"]) for p in replans if p["counts"] != replans[0]["counts"]] == [
        (p["step"], p["counts"]) for p in plans if p["counts"] != plans[0]["counts"]
    ]


def test_a_static_run_resumed_with_other_shares_follows_them(tmp_path: Path) -> None:
    """A static plan is a function of the config (and the GPUs): the resume recomputes it, and says so."""
    run_dir = tmp_path / "run"
    _ok(run_dir, "trainer.balance=static", "trainer.balance_shares=[3,1]", "trainer.max_steps=4")
    _ok(run_dir, "trainer.balance=static", "trainer.balance_shares=[1,3]", "trainer.max_steps=8")
    plans = [(p["step"], p["reason"], p["counts"]) for p in read_metrics(run_dir) if p["kind"] == "plan"]
    assert plans == [(0, "start", [96, 32]), (4, "resume, replanned", [32, 96])]
    logs = "".join(log.read_text() for log in (run_dir / "submitit").glob("*_0_log.err"))
    assert logs.count("saved split plan [96, 32] rows per rank is now [32, 96]") == 1


def test_replay_of_a_run_without_a_plan_history_is_one_clear_failure(tmp_path: Path) -> None:
    proc = submit(tmp_path / "replay", *TINY, "trainer.balance=replay", f"trainer.balance_replay={tmp_path}")
    assert proc.returncode != 0
    assert "holds no checkpoint with a plan history" in proc.stdout + proc.stderr


SLOWED = ("trainer.max_steps=60", "checkpoint.every_steps=10", "data.global_batch_size=128",
          "telemetry.debug_slow_rank=0", "telemetry.debug_slow_ms=40", "cluster.max_preemptions=0")


def _preempted_at(run_dir: Path, ranks: int, after_step: int) -> None:
    job = RunningJob(run_dir, *TINY, *SLOWED, f"resources.procs_per_node={ranks}")
    job.wait_for_step(after_step)
    job.signal_rank(0, signal.SIGUSR2)
    job.wait()
    assert attempts(run_dir)[-1]["reason"] == "preempted", job.output()


def test_a_run_preempted_at_2_ranks_resumes_at_1_and_then_at_3(tmp_path: Path) -> None:
    straight = _ok(tmp_path / "straight", *SLOWED)
    run_dir = tmp_path / "elastic"
    _preempted_at(run_dir, 2, 12)
    _preempted_at(run_dir, 1, attempts(run_dir)[-1]["steps_done"] + 6)
    last = _ok(run_dir, *SLOWED, "resources.procs_per_node=3")
    ledger = attempts(run_dir)
    assert [a["world_size"] for a in ledger] == [2, 1, 3]
    assert [a["reason"] for a in ledger] == ["preempted", "preempted", "completed"]
    assert ledger[1]["start_step"] == ledger[0]["steps_done"] and ledger[2]["start_step"] == ledger[1]["steps_done"]
    assert last["steps"] == straight["steps"] == 60
    assert last["samples"] == straight["samples"] == 60 * 128
    assert abs(float(last["auc"]) - float(straight["auc"])) <= 0.005  # type: ignore[arg-type]
    plans = [r for r in read_metrics(run_dir) if r["kind"] == "plan"]
    assert [p["counts"] for p in plans] == [[64, 64], [128], [43, 43, 42]]


def test_resume_at_another_world_size_needs_the_same_global_batch(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _ok(run_dir, "trainer.max_steps=4")  # global batch: 64 per rank x 2
    proc = submit(run_dir, *TINY, "trainer.max_steps=8", "resources.procs_per_node=1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "global batch (128 -> 64" in proc.stderr and "data.global_batch_size=128" in proc.stderr
    _ok(run_dir, "trainer.max_steps=8", "resources.procs_per_node=1", "data.global_batch_size=128")
    assert [a["world_size"] for a in attempts(run_dir)] == [2, 1]

"""`python -m gpujobs cost`: where the GPU-hours of a run or a sweep went.

Real runs only: a local run whose rank dies after a checkpoint and restarts, and (live cluster) a
6-point Slurm sweep with one point preempted. The parts are measured from their own records, so
"they add up" is a check: what they miss is `unaccounted`, held within 2% of the total.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, SLOW, compose_job
from jobctl import RunningJob, attempts
from rich.console import Console
from test_sweep import array_of, sweep, wait_final

from gpujobs.backends.slurm.sacct import parse_allocations, tres_counts
from gpujobs.cli import cost
from gpujobs.cli.cost_table import COLUMNS, table
from gpujobs.rundir.files import record_submission, write_config

ALL_PARTS = {*cost.PARTS, cost.UNACCOUNTED}


def gpujobs_cost(*args: str, env: dict[str, str] | None = None, columns: int = 80) -> subprocess.CompletedProcess[str]:
    """`python -m gpujobs cost ARGS` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "gpujobs", "cost", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, "COLUMNS": str(columns), **(env or {})})


def cost_json(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = gpujobs_cost(*args, "--json", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(json.loads(proc.stdout))


def check_fits_80_columns(text: str, rows: int) -> None:
    """Every line within 80 columns, the header whole, `rows` rows of data (nothing cut or wrapped)."""
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    assert "…" not in text, text
    header = next(line for line in lines if line.startswith("point"))
    assert header.split()[3:] == list(COLUMNS), text
    data = [line for line in lines if re.match(r"^(\d+|-|total) +(sacct|local|both|cpu|gpu) ", line)]
    assert len(data) == rows, text


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local run (2 CPU ranks, 60 steps, a checkpoint every 10) whose rank 1 is killed after
    checkpoint 20; it restarts from that checkpoint and completes."""
    run_dir = tmp_path_factory.mktemp("cost") / "run"
    job = RunningJob(run_dir, *SLOW, "cluster.max_restarts=1")
    job.wait_for_step(21)  # logged after checkpoint 20 is complete
    job.signal_rank(1, signal.SIGKILL)
    assert job.wait() == 0, job.output()
    return run_dir


def test_a_failed_attempt_redoes_the_steps_past_its_checkpoint(restarted: Path) -> None:
    first, second = attempts(restarted)
    assert first["reason"] == "failed" and second["start_step"] == 20, (first, second)
    redone = first["steps_done"] - second["start_step"]
    assert redone >= 1  # it trained past step 20 (it logged 21) before rank 1 died

    (point,) = cost_json(str(restarted))["points"]
    assert point["source"] == "attempts" and point["unit"] == "cpu" and point["notes"] == []
    # every step that counted, once; the ones trained again, in the failed attempt only
    assert point["steps"] == {"counted": 60, "redone": redone}
    one, two = point["segments"]
    assert (one["attempt"], one["state"], two["attempt"], two["state"]) == (1, "failed", 2, "completed")
    assert one["steps"]["redone"] == redone and one["parts"]["redone"] > 0
    assert two["steps"] == {"counted": 40, "redone": 0} and two["parts"]["redone"] == 0

    # held: each attempt's start..end x its 2 ranks x 1 CPU each (resources.cpus_per_task)
    held = sum((a["end"] - a["start"]) * a["world_size"] for a in (first, second))
    assert point["seconds"] == pytest.approx(held, abs=0.01)
    parts = point["parts"]
    assert abs(parts["unaccounted"]) <= 0.02 * point["seconds"], parts
    for name in ("training", "redone", "checkpoint", "eval", "startup", "stopping"):
        assert parts[name] > 0, (name, parts)
    assert parts["launch"] == parts["teardown"] == parts["hung"] == parts["health"] == 0  # local; none happened
    (total,) = cost_json(str(restarted))["totals"]
    assert total["seconds"] == point["seconds"] and total["steps"] == point["steps"]


def test_each_attempt_is_costed_as_it_ran_after_the_placement_changed(restarted: Path, tmp_path: Path) -> None:
    """A resume may change what each rank holds (config.yaml is rewritten): the attempts already run keep
    what their lines say they held."""
    assert [(a["unit"], a["per_rank"]) for a in attempts(restarted)] == [("cpu", 1), ("cpu", 1)]
    before = cost_json(str(restarted))["points"][0]["seconds"]
    moved = tmp_path / "run"
    shutil.copytree(restarted, moved)
    write_config(moved, compose_job(*SLOW, "resources.cpus_per_task=2"))  # what the next start would write
    (point,) = cost_json(str(moved))["points"]
    assert point["seconds"] == pytest.approx(before) and point["notes"] == [], point


def test_json_keys_are_the_documented_ones(restarted: Path) -> None:
    document = cost_json(str(restarted))
    assert set(document) == {"dir", "points", "totals"}
    (point,), (total,) = document["points"], document["totals"]
    assert list(point) == list(cost.POINT_KEYS)
    assert list(total) == list(cost.TOTAL_KEYS)
    assert all(list(segment) == list(cost.SEGMENT_KEYS) for segment in point["segments"])
    for parts in (point["parts"], total["parts"], *(s["parts"] for s in point["segments"])):
        assert list(parts) == [*cost.PARTS, cost.UNACCOUNTED]
    doc = cost.__doc__ or ""
    assert all(f'"{key}"' in doc for key in (*cost.POINT_KEYS, *cost.SEGMENT_KEYS, *ALL_PARTS))


def test_the_table_fits_80_columns(restarted: Path) -> None:
    proc = gpujobs_cost(str(restarted))
    assert proc.returncode == 0, proc.stderr
    check_fits_80_columns(proc.stdout, rows=2)  # the run, its total
    assert "CPU-h" in proc.stdout

    # the widest cells the table can get: a 4-digit point, 6-digit hours, -100.0 in every part
    widest = {"seconds": 3600.0 * 123456, "hours": 123456.0, "unit": "gpu",
              "parts": dict.fromkeys(ALL_PARTS, -3600.0 * 123456)}
    document = {"dir": "/a/sweep", "points": [{**widest, "point": 1000, "source": "sacct+attempts"}],
                "totals": [widest]}
    out = io.StringIO()
    Console(file=out, width=80).print(table(document))
    check_fits_80_columns(out.getvalue(), rows=2)


def test_cost_loads_without_torch(restarted: Path) -> None:
    code = ("import sys; from gpujobs.__main__ import main; code = main(['cost', sys.argv[1]]); "
            "assert 'torch' not in sys.modules, 'torch imported'; raise SystemExit(code)")
    proc = subprocess.run([sys.executable, "-c", code, str(restarted)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr


def test_a_run_dir_where_nothing_ran_is_one_line_and_exit_1(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_config(run_dir, compose_job("+experiment=rec", "+debug=tiny", "cluster=local"))
    proc = gpujobs_cost(str(run_dir))
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == [f"gpujobs: nothing to account in {run_dir}: no Slurm job started and no "
                                        "attempt recorded"]


def test_a_bad_path_is_one_line_and_exit_2(tmp_path: Path) -> None:
    for path in (tmp_path / "missing", tmp_path):  # nothing there; a dir that is neither run dir nor sweep dir
        proc = gpujobs_cost(str(path))
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
        (line,) = proc.stderr.splitlines()
        assert line.startswith(f"gpujobs: {path} is neither a run dir"), line


def test_no_sacct_for_a_slurm_point_is_one_line_and_exit_1(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_config(run_dir, compose_job("+experiment=rec", "+debug=tiny", "cluster=slurm"))
    record_submission(run_dir, "4242", run_dir / "submitit")
    empty = tmp_path / "bin"
    empty.mkdir()  # a PATH where sacct is not: the call really fails
    proc = gpujobs_cost(str(run_dir), env={"PATH": str(empty)})
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("gpujobs: sacct could not run:"), line


def test_a_ledger_with_a_backward_span_and_wrongly_typed_lines_still_counts_the_rest(tmp_path: Path) -> None:
    """Lines edited by hand or by another tool: an attempt that ends before it starts counts 0 s, with a
    note; a line whose fields have the wrong types is skipped as unreadable (as a torn line is), with a
    note, so `cost` and `status` still say what the other lines hold."""
    run_dir = tmp_path / "run"
    job = compose_job("+experiment=rec", "+debug=tiny", "cluster=local")
    write_config(run_dir, job)
    good = {"attempt": 2, "reason": "completed", "requeue": False, "why": "completed", "start": 1000.0,
            "end": 1100.0, "world_size": 2, "steps_done": 5, "trained_from": 1040.0}
    lines = [{**good, "attempt": 1, "reason": "failed", "requeue": True, "start": 500.0, "end": 400.0},  # backward
             good, {**good, "attempt": 3, "end": "2000"}, {**good, "attempt": 4, "end": None},
             {**good, "attempt": 5, "world_size": "2"}]
    (run_dir / "attempts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    train = {"kind": "train", "loss": 0.5, "samples_per_s": 10.0}
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in [
        {**train, "step": 5, "time": 1050.0, "step_time_s": [2.0, 2.0]},
        {**train, "step": "6", "time": 1060.0, "step_time_s": [2.0]}, {**train, "step": 7, "time": 1070.0,
                                                                        "step_time_s": ["2.0"]}]))
    (point,) = cost_json(str(run_dir))["points"]
    units = 2 * job.resources.cpus  # 2 CPU ranks
    assert point["seconds"] == 100.0 * units  # attempt 2 only
    backward, counted = point["segments"]
    assert (backward["attempt"], backward["seconds"], set(backward["parts"].values())) == (1, 0, {0})
    # attempt 2's one readable window: 5 steps at rank 0's 2 s
    assert counted["attempt"] == 2 and counted["steps"] == {"counted": 5, "redone": 0}
    assert counted["parts"]["training"] == 5 * 2.0 * units
    assert point["notes"] == ["attempts.jsonl: 3 lines are no attempt (a field missing or of the wrong type): "
                              "not counted", "attempt 1: ends 100.000 s before it starts: counted as 0 s"]
    table = gpujobs_cost(str(run_dir))
    assert table.returncode == 0 and "counted as 0 s" in table.stdout, table.stdout + table.stderr
    status = subprocess.run([sys.executable, "-m", "gpujobs", "status", str(run_dir)], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert status.returncode == 0 and "2 (completed)" in status.stdout, status.stdout + status.stderr


def test_sacct_allocations_and_their_tres() -> None:
    # lines as this project's test cluster writes them (SLURM_TIME_FORMAT=%s), with a typed GPU TRES added
    text = (
        "19220274_2|REQUEUED|1796127192|1796127202|10|billing=1,cpu=1,mem=2000M,node=1\n"
        "19220274_2|COMPLETED|1796127215|1796127221|6|billing=1,cpu=1,mem=2000M,node=1\n"
        "19220247|COMPLETED|1796126404|1796126406|2|billing=8,cpu=8,gres/gpu=4,mem=16000M,node=2\n"
        "19220248|RUNNING|1796126500|Unknown|31|billing=2,cpu=2,gres/gpu:a100=2,mem=4000M,node=1\n"
        "19220249_[3-5]|PENDING|Unknown|Unknown|0|\n"
        "19220238|CANCELLED by 0|None|1796126268|0|billing=2,cpu=1,mem=2000M,node=1\n"
    )
    found = parse_allocations(text)
    assert [(a.job_id, a.state, a.unit, a.units, a.elapsed_s) for a in found] == [
        ("19220274_2", "REQUEUED", "cpu", 1, 10.0), ("19220274_2", "COMPLETED", "cpu", 1, 6.0),
        ("19220247", "COMPLETED", "gpu", 4, 2.0), ("19220248", "RUNNING", "gpu", 2, 31.0),
    ]
    assert found[0].start == 1796127192.5 and found[0].end - found[0].start == 10  # the middle of each second
    assert found[3].end == found[3].start + 31  # still running: what it held so far
    assert tres_counts("cpu=4,gres/gpu=2,gres/gpu:a100=2") == (2, 4)


# ---------------------------------------------------------------- live cluster

#: 60 slowed steps (~3 s) per point, a checkpoint every 10: time to preempt one mid-run.
SWEEP = (
    "+experiment=rec", "+debug=tiny", "cluster=slurm", "resources.procs_per_node=1", "trainer.max_steps=60",
    "checkpoint.every_steps=10", "telemetry.debug_slow_rank=0", "telemetry.debug_slow_ms=40",
)


def sacct_held_cpu_seconds(array: str, env: dict[str, str]) -> tuple[float, int]:
    """This test's own sacct call: CPU-seconds allocated to every instance of the array's tasks, and how
    many instances there were."""
    out = subprocess.run(["sacct", "-X", "--duplicates", "-n", "-P", "-o", "JobID,ElapsedRaw,AllocTRES", "-j", array],
                         capture_output=True, text=True, check=True, env={**os.environ, **env}).stdout
    rows = [line.split("|") for line in out.splitlines() if line.count("|") == 2]
    held = [(int(elapsed), int(re.search(r"(?:^|,)cpu=(\d+)", tres).group(1)))  # type: ignore[union-attr]
            for _, elapsed, tres in rows if elapsed.isdigit() and elapsed != "0"]
    assert all("gres/gpu" not in tres for *_, tres in rows)  # CPU ranks: CPU-hours
    return float(sum(elapsed * cpus for elapsed, cpus in held)), len(held)


@pytest.mark.slurm
def test_a_six_point_sweep_with_one_point_preempted(tmp_path: Path, slurm: dict[str, str]) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = sweep(sweep_dir, *SWEEP, "optim.lr=1e-3,2e-3,3e-3,4e-3,5e-3,6e-3", env=slurm)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    array, victim = array_of(proc.stdout), 2
    metrics = sweep_dir / str(victim) / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and '"kind": "checkpoint"' in metrics.read_text()):
        assert time.monotonic() < deadline, f"point {victim} saved no checkpoint within 180 s"
        time.sleep(0.05)
    subprocess.run(["scancel", "--signal=USR2", f"{array}_{victim}"], check=True, env={**os.environ, **slurm})
    for i in range(6):
        assert wait_final(f"{array}_{i}", slurm, timeout=240) == "COMPLETED"
    story = attempts(sweep_dir / str(victim))
    assert [a["reason"] for a in story] == ["preempted", "completed"], story
    assert story[1]["start_step"] == story[0]["steps_done"]  # the agreed checkpoint: zero steps redone

    # cost asks sacct once, for every point, with every requeued instance
    calls, wrapper = tmp_path / "sacct-calls", tmp_path / "bin" / "sacct"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {shutil.which("sacct")} "$@"\n')
    wrapper.chmod(0o755)
    document = cost_json(str(sweep_dir), env={**slurm, "PATH": f"{wrapper.parent}:{os.environ['PATH']}"})
    (call,) = calls.read_text().splitlines()
    assert "--duplicates" in call.split()

    held, instances = sacct_held_cpu_seconds(array, slurm)
    assert instances == 7  # six points, one of them twice
    (total,) = document["totals"]
    assert total["unit"] == "cpu" and total["seconds"] == pytest.approx(held, rel=0.02)
    assert abs(total["parts"]["unaccounted"]) <= 0.02 * total["seconds"], total
    assert total["steps"] == {"counted": 6 * 60, "redone": 0}

    points = {p["point"]: p for p in document["points"]}
    assert sorted(points) == list(range(6))
    for num, point in points.items():
        assert point["source"] == "sacct" and point["notes"] == [], point
        assert point["steps"] == {"counted": 60, "redone": 0} and point["parts"]["redone"] == 0
        states = [(s["job_id"], s["state"], s["attempt"]) for s in point["segments"]]
        if num == victim:  # the preemption's cost: a second allocation, with its own launch and start-up
            assert states == [(f"{array}_{num}", "REQUEUED", 1), (f"{array}_{num}", "COMPLETED", 2)], states
            segment = point["segments"][1]
            again, half_second = segment["parts"], 0.5 * segment["units"]
            assert again["startup"] > 0 and again["training"] > 0
            # Slurm's start and end are whole seconds, taken at their middle: a launch shorter than half a
            # second can show as less than nothing, by at most that half second
            assert again["launch"] > -half_second and again["launch"] + again["teardown"] > 0, again
        else:
            assert states == [(f"{array}_{num}", "COMPLETED", 1)], states

    table_run = gpujobs_cost(str(sweep_dir), env=slurm)
    assert table_run.returncode == 0, table_run.stderr
    check_fits_80_columns(table_run.stdout, rows=7)  # six points, the total

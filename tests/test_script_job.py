"""Bring your own script: a torchrun-style script runs unchanged as a local gpujobs job."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import read_result, submit

SCRIPT = Path(__file__).parent / "scripts" / "torchrun_style.py"


def test_torchrun_style_script_runs_on_two_local_ranks(run_dir: Path) -> None:
    proc = submit(
        run_dir, "cluster=local", "resources.procs_per_node=2", f"+script.path={SCRIPT}",
        "+script.args=[--epochs,3]", "nccl=debug",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = [json.loads((run_dir / f"seen_rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["RANK"] for s in seen] == ["0", "1"]
    assert all(s["WORLD_SIZE"] == "2" and s["LOCAL_WORLD_SIZE"] == "2" for s in seen)
    assert all(s["rank_sum"] == 1.0 for s in seen)  # the all-reduce really crossed ranks
    assert seen[0]["args"] == ["--epochs", "3"]
    result = read_result(run_dir)
    assert result["kind"] == "script" and result["world_size"] == 2


def test_missing_script_is_refused(run_dir: Path) -> None:
    proc = submit(run_dir, "cluster=local", "+script.path=/nowhere/train.py")
    assert proc.returncode == 2
    assert "script.path='/nowhere/train.py' is invalid" in proc.stderr
    assert not run_dir.exists()

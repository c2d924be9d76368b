"""Bring your own script: run a torchrun-style training script unchanged, one process per rank.

The script reads RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT as it
would under torchrun; gpujobs supplies them from the local or Slurm job, along with the NCCL settings.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gpujobs.atomic import write_json_atomic
from gpujobs.config import JobConfig
from gpujobs.run.entry import RESULT_FILE
from gpujobs.run.jobenv import detect, export_torchrun_env


@dataclass
class ScriptJob:
    """Run `job.script` as this rank; raises if the script exits non-zero."""

    job: JobConfig
    run_dir: str
    master_port: Optional[int] = None

    def __call__(self) -> dict[str, Any]:
        script = self.job.script
        assert script is not None  # make_payload only builds a ScriptJob for a job with a script
        info = detect(self.master_port)
        export_torchrun_env(info)
        os.environ.update(self.job.nccl.to_env())
        os.environ["GPUJOBS_RUN_DIR"] = self.run_dir
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, script.path, *script.args], cwd=script.cwd or None, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{script.path} exited with code {proc.returncode} on rank {info.rank}")
        result = {
            "status": "completed",
            "kind": "script",
            "script": script.path,
            "world_size": info.world_size,
            "wall_s": round(time.perf_counter() - start, 3),
        }
        if info.is_main:
            write_json_atomic(Path(self.run_dir) / RESULT_FILE, result)
        return {**result, "rank": info.rank, "node": info.node}

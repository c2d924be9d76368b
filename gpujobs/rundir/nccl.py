"""RUN_DIR/nccl/: where a rank's NCCL writes the files `nccl.extra` names (debug logs, topology dumps)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from gpujobs.config.nccl import NCCL_DIR, OUTPUT_FILE_VARS, NcclSettings
from gpujobs.rundir.trust import own_dir


def export_nccl_env(settings: NcclSettings, run_dir: Optional[Path]) -> dict[str, str]:
    """Set `settings.to_env(run_dir)` in this rank's environment, before NCCL initialises; returns it.

    RUN_DIR/nccl/ is made first (mode 0700, never through a planted link: NCCL would write through
    it), so that NCCL finds the directory of its files. Without a run dir (a process group outside a
    run, as the benchmarks make) a file asked for is refused, not dropped without a word.
    """
    files = sorted(key for key in settings.extra if key in OUTPUT_FILE_VARS)
    if files and run_dir is None:
        raise ValueError(f"nccl.extra.{files[0]} is a file NCCL writes in RUN_DIR/{NCCL_DIR}/: no run dir given")
    if files and run_dir is not None:
        own_dir(Path(run_dir), NCCL_DIR, mode=0o700)
    env = settings.to_env(run_dir)
    os.environ.update(env)
    return env

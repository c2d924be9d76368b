"""`cluster=debug`: one rank, in this process, so pdb and breakpoints work (`executor.run_debug`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from gpujobs.backends.base import Backend, PreflightCache
from gpujobs.config.load import JobConfig


class DebugBackend(Backend):
    """The job's rank 0 alone, in the submitting process; nothing beside it (no supervisor, no watchdog)."""

    name = "debug"
    in_process = True

    def preflight(self, job: JobConfig, cache: Optional[PreflightCache] = None) -> None:
        """Nothing to ask: this process runs one rank, whatever the config asks for (`run_debug` says so)."""

    def start(self, job: JobConfig, run_dir: Path) -> int:
        from gpujobs.backends.debug.executor import run_debug

        return run_debug(job, run_dir)

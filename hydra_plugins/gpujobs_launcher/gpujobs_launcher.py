"""`GpujobsLauncher`: every point validated before anything starts; Slurm points queued as job arrays.

Points run through Hydra's `run_job`, one after another, as with Hydra's basic launcher: that is all an
ordinary Hydra app sees. gpujobs' own task (`gpujobs.submit`) instead adds its point to the active
`SweepPlan`, and once every point is in, the launcher carries the plan out (`gpujobs.launch.sweep`,
whose docstring has the whole design). Imports of gpujobs and submitit happen in `launch`, so that
Hydra's plugin discovery stays fast.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)


class GpujobsLauncher(Launcher):
    """Hydra launcher: plan every point, then run or queue them (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        """Keep what `launch` needs."""
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def _run_points(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[JobReturn]:
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        runs: list[JobReturn] = []
        for offset, overrides in enumerate(job_overrides):
            idx = initial_job_idx + offset
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = idx
                sweep_config.hydra.job.num = idx
            runs.append(run_job(
                hydra_context=self.hydra_context,
                task_function=self.task_function,
                config=sweep_config,
                job_dir_key="hydra.sweep.dir",
                job_subdir_key="hydra.sweep.subdir",
            ))
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return runs

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Run every point's task; carry out the plan gpujobs points made; exit 1 if a followed point failed."""
        from gpujobs.launch.sweep import collecting, run_plan, summary  # lazily: plugin discovery stays fast

        setup_globals()
        assert self.config is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).absolute()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"Launching {len(job_overrides)} jobs (gpujobs launcher)")
        with collecting(sweep_dir) as plan:
            try:
                runs = self._run_points(job_overrides, initial_job_idx)
            except BaseException:  # a refused point: nothing was queued; leave no empty run dirs
                plan.discard()
                raise
        if not plan.points:
            return runs
        outcomes = run_plan(plan)
        by_num = {o.point.num: o for o in outcomes}
        for ret in runs:
            outcome = by_num.get(ret.hydra_cfg.hydra.job.num) if ret.hydra_cfg is not None else None
            if outcome is not None:
                ret.return_value = outcome.code
        if any(o.code for o in outcomes):
            print(summary(outcomes), file=sys.stderr, flush=True)
            raise SystemExit(1)
        return runs

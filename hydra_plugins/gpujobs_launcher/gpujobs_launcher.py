"""`GpujobsLauncher`: every point validated before anything starts; Slurm points queued as job arrays.

Points run through Hydra's `run_job`, one after another, as with Hydra's basic launcher: that is all an
ordinary Hydra app sees. gpujobs' own task (`gpujobs.submit`) instead adds its point to the active
`SweepPlan`, and once every point is in, the launcher carries the plan out (`gpujobs.launch.sweep`,
whose docstring has the whole design). Imports of gpujobs and submitit happen in `launch`, so that
Hydra's plugin discovery stays fast.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

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

    def _run_derived(
        self, batch: Sequence[Sequence[str]], points: Iterable[tuple[DictConfig, DictConfig]]
    ) -> list[JobReturn]:
        """What `run_job` does for each point, less its copies and writes: the gpujobs task only plans it."""
        from gpujobs.config.hydra_private import completed_job, set_values

        assert self.config is not None and self.task_function is not None
        for num, overrides in enumerate(batch):
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
        configure_log(self.config.hydra.job_logging, self.config.hydra.verbose)
        runs: list[JobReturn] = []
        for full, task in points:  # the sweeper has set HydraConfig to the point's `hydra` node
            output_dir = os.path.join(str(OmegaConf.select(full, "hydra.sweep.dir")),
                                      str(OmegaConf.select(full, "hydra.sweep.subdir")))
            hydra: Any = HydraConfig.get()  # a DictConfig (the point's `hydra` node)
            set_values(hydra, {"runtime.output_dir": os.path.abspath(output_dir)})
            value = self.task_function(task)
            runs.append(completed_job(list(hydra.overrides.task), os.getcwd(), value))
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return runs

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Run every point's task; carry out the plan gpujobs points made; exit 1 if a followed point failed."""
        points = len(job_overrides)
        return self._launch(points, initial_job_idx, lambda: self._run_points(job_overrides, initial_job_idx))

    def launch_derived(
        self, batch: Sequence[Sequence[str]], points: Iterable[tuple[DictConfig, DictConfig]]
    ) -> Sequence[JobReturn]:
        """As `launch`, for points the gpujobs sweeper derived: (full config, task config) each, in order."""
        return self._launch(len(batch), 0, lambda: self._run_derived(batch, points), ", one composition")

    def _launch(
        self, count: int, first_num: int, run_points: Callable[[], list[JobReturn]], how: str = ""
    ) -> Sequence[JobReturn]:
        """Run the points' tasks with a plan active (`run_points`), then carry out the plan they made."""
        from gpujobs.backends import backend_for
        from gpujobs.base.errors import GpujobsError, SubmitError
        from gpujobs.launch.next_steps import next_steps
        from gpujobs.launch.sweep import collecting, run_plan, summary  # lazily: plugin discovery stays fast
        from gpujobs.rundir.trust import check_dir

        setup_globals()
        assert self.config is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).absolute()
        check_dir("hydra.sweep.dir", sweep_dir)  # before a point's dir is made in it (any sweeper)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"Launching {count} jobs (gpujobs launcher{how})")
        with collecting(sweep_dir) as plan:
            try:
                runs = run_points()
            except BaseException:  # a refused point: nothing was queued; leave no empty run dirs
                plan.discard()
                raise
            try:
                plan.check_together()
            except GpujobsError:  # points each valid, not side by side
                plan.discard()
                raise
        if not plan.points:
            return runs
        try:
            outcomes = run_plan(plan)
        except SubmitError:  # sbatch refused (an array of) the sweep: what it did not queue leaves no dirs
            plan.discard()
            raise
        if not any(p.job.cluster.dry_run for p in plan.points):  # a dry run leaves no sweep dir to read
            queued = any(backend_for(p.job).queues and not backend_for(p.job).follows(p.job) for p in plan.points)
            print(next_steps(sweep_dir, queued=queued, sweep=True), flush=True)
        by_num = {o.point.num: o for o in outcomes}
        for num, ret in enumerate(runs, start=first_num):
            outcome = by_num.get(num)
            if outcome is not None:
                ret.return_value = outcome.code
        if any(o.code for o in outcomes):
            print(summary(outcomes), file=sys.stderr, flush=True)
            raise SystemExit(1)
        return runs

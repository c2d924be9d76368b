"""`python -m gpujobs.submit [overrides]`: compose and validate a config, then launch the job.

Exit codes: 0 the job completed (or was queued), 1 it failed, 2 the config or submission was refused,
128 + N a local job's launcher was stopped by signal N (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP): its job was
killed, its attempt recorded `cancelled`, and the same command resumes it. This module never imports torch:
the job side does that, in its own processes.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gpujobs.base.errors import ConfigError, GpujobsError
from gpujobs.base.made_dirs import MadeDirs
from gpujobs.config.hydra_errors import one_line
from gpujobs.config.hydra_private import one_composition
from gpujobs.config.packaged import config_dir
from gpujobs.launch.sweep import PLANS_SWEEP_POINTS

#: conf/ (the checkout's or the wheel's copy); GPUJOBS_CONFIG_DIR points elsewhere (a team's own config tree).
CONFIG_DIR = str(config_dir())
#: The config or the submission was refused before anything ran or was queued: one line said why, and no
#: directory the submit made is left.
EXIT_REFUSED = 2

_task_started = False
_dry_run = False
"""A point's config asked for a dry run: the submit prints, and leaves no directory behind."""


def _refuse(err: GpujobsError, where: str = "") -> NoReturn:
    """Say why in one line (`config error:` for a bad value) and exit 2."""
    prefix = "config error: " if isinstance(err, ConfigError) else ""
    print(f"gpujobs: {prefix}{err}{where}", file=sys.stderr)
    raise SystemExit(EXIT_REFUSED) from None


def _task(cfg: DictConfig) -> int:
    global _task_started, _dry_run
    _task_started = True
    from gpujobs.config.load import load_config, override_keys
    from gpujobs.launch import check_paths, launch, resolve_cluster
    from gpujobs.launch.sweep import active_plan
    from gpujobs.rundir.files import discard_if_empty

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    plan = active_plan()
    # In a sweep the error names the point; it is still one line.
    where = f" (sweep point #{hydra_cfg.job.num}: {' '.join(hydra_cfg.overrides.task)})" if plan else ""
    try:
        # cluster=auto: this machine picks, here, not in load_config
        # unresolved: an override such as `optim.lr=${oops}` is reported by load_config, naming its key
        user_keys = override_keys(OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False))  # type: ignore[arg-type]
        job = resolve_cluster(load_config(cfg, user_keys))
        _dry_run = _dry_run or job.cluster.dry_run
        check_paths(job, run_dir, Path(hydra_cfg.sweep.dir).absolute() if plan is not None else None)
        if plan is not None:  # a gpujobs sweep: validate and plan this point; the launcher starts them all
            plan.add(job, run_dir, hydra_cfg.job.num, list(hydra_cfg.overrides.task))
            return 0
        code = launch(job, run_dir)
    except GpujobsError as err:
        discard_if_empty(run_dir)
        _refuse(err, where)
    if code:
        raise SystemExit(code)
    return code


# In a sweep, the gpujobs sweeper may derive the points' configs from one composition (it plans them only).
setattr(_task, PLANS_SWEEP_POINTS, True)
_submit = hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")(_task)


def _check_name_override(args: list[str]) -> None:
    """Refuse a `name=` override longer than a directory name before Hydra makes the default run dir
    (`outputs/${name}/...`) of it: Linux would refuse that level, and the error would name hydra.run.dir."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from gpujobs.config.cluster import DIR_NAME_TEXT
    from gpujobs.config.validate import NAME_MAX

    parser = OverridesParser.create()
    for arg in args:
        if not arg.lstrip("+").startswith("name="):
            continue
        try:
            (override,) = parser.parse_overrides([arg])
            names = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
        except HydraException:
            continue  # what Hydra cannot parse or enumerate it reports itself, in one line
        for name in names:
            if isinstance(name, str) and len(name.encode()) > NAME_MAX:
                _refuse(ConfigError("name", name, DIR_NAME_TEXT))


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    """Entry point; Hydra's own composition errors (bad override syntax, unknown group) exit 2 too.

    `argv` (overrides and Hydra's flags) stands in for `sys.argv[1:]` and `prog` for `sys.argv[0]`:
    Hydra reads only `sys.argv`, so `gpujobs submit` passes its arguments there. A refused submit (exit 2)
    and a dry run leave no directory that this submit made (the run dir, `outputs/NAME/` above it, ...).
    """
    made = MadeDirs()
    try:
        with made:
            _main(argv, prog)
    except SystemExit as exit_:
        if exit_.code == EXIT_REFUSED or _dry_run:
            made.remove_empty()
        raise
    if _dry_run:
        made.remove_empty()


def _main(argv: Optional[list[str]], prog: Optional[str]) -> None:
    if argv is not None:
        sys.argv = [prog or sys.argv[0], *argv]
    # a run dir is trusted only if no one else may write it (gpujobs.rundir.trust): under a umask of 002
    # Hydra and gpujobs would make run dirs the group may write, which the check then refuses
    os.umask(os.umask(0o022) | 0o022)
    multirun = bool({"-m", "--multirun"} & set(sys.argv[1:]))
    _check_name_override(sys.argv[1:])
    # Hydra raises its composition errors instead of printing them on several lines; they are reported
    # below, one line each. A user's own HYDRA_FULL_ERROR keeps Hydra's full traceback.
    ours = "HYDRA_FULL_ERROR" not in os.environ
    if ours:
        os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        with one_composition(multirun):  # Hydra's main composes the config twice; once is enough
            _submit()
    except SystemExit as exit_:
        if exit_.code == 1 and not _task_started:
            raise SystemExit(EXIT_REFUSED) from None
        raise
    except GpujobsError as err:  # raised by the sweep's launcher, once every point was planned
        _refuse(err)
    except (HydraException, OmegaConfBaseException) as err:
        if _task_started:
            raise
        if ours:
            print(f"gpujobs: config error: {one_line(err, sys.argv[1:])}", file=sys.stderr)
        else:
            traceback.print_exc()
        raise SystemExit(EXIT_REFUSED) from None
    except OSError as err:  # before any task: Hydra making the run or sweep dir (after Hydra's: some are OSErrors)
        if _task_started:
            raise
        key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
        print(f"gpujobs: {key} is invalid: allowed a directory this user can create and write "
              f"({err.strerror}: {err.filename})", file=sys.stderr)
        raise SystemExit(EXIT_REFUSED) from None
    finally:
        if ours:
            os.environ.pop("HYDRA_FULL_ERROR", None)


if __name__ == "__main__":
    main()

"""`gpujobs prepare OVERRIDES...`: prepare a job's raw input files into its sample store, once.

The config is composed from the same tree and overrides as `gpujobs submit`, and validated by the same code,
so the store that training opens is the one prepared here (`data.store`). The data config says what to
prepare (`prepare_plan()`: its input files, parser and store). Where the job would run here
(`cluster=local`), `data.prepare_workers` processes do it (default: one per input file, at most one per CPU);
on a scheduler (`cluster=slurm`) it is ONE job array, a task per shard that needs work, at most
`data.prepare_workers` running at once, followed to its end unless `cluster.wait=false`
(`gpujobs.launch.prepare`). A rerun prepares only what is missing or whose input changed.

Exit codes: 0 the store is prepared (or was already); 1 it failed on this machine (a file it could not
read or write); 2 refused in one line: a bad config value, a data config with nothing to prepare, a bad
input line (`data.bad_lines=fail`), a store another prepare holds or that cannot take this one.
This module never imports torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Optional

from gpujobs.base.errors import ConfigError, GpujobsError
from gpujobs.data.layout import SPLITS

if TYPE_CHECKING:  # Hydra, the config loader and the parsers are imported by the commands that use them
    from gpujobs.config.load import JobConfig
    from gpujobs.data.manifest import Manifest
    from gpujobs.data.prepare import PreparePlan

#: Refused before anything was prepared, or on a bad input line: one line said why.
EXIT_REFUSED = 2
#: The prepare itself failed: a file it could not read or write.
EXIT_FAILED = 1

USAGE_EPILOG = """\
Overrides are Hydra's, as for `gpujobs submit`: e.g.
  gpujobs prepare +experiment=rec data=criteo data.train_files='/data/train/day_*.gz' \\
      data.eval_files=/data/eval/day_23.gz data.store=/data/criteo-store
A rerun prepares only the shards that are missing (a killed prepare resumes); then train with
  gpujobs submit +experiment=rec data=criteo ... data.store=/data/criteo-store
"""


def parser(prog: str) -> argparse.ArgumentParser:
    """The command's arguments: Hydra overrides only; `--help` shows how a store is prepared and used."""
    args = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=USAGE_EPILOG,
        description="Compose and validate the config as `gpujobs submit` does, then prepare the data config's "
                    "input files (data.train_files, data.eval_files) into its sample store (data.store).")
    args.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="a Hydra override: key=value, group=option")
    return args


def compose_job(overrides: list[str]) -> tuple[JobConfig, str]:
    """The validated job that `gpujobs submit OVERRIDES` would run, with the cluster picked, and the name of
    its data config (`criteo`: the option of the `data` group).

    Hydra's compose API, from the same config tree as submit, so no run dir is made: a prepare has none.
    Raises Hydra's or OmegaConf's composition errors, and ConfigError for a bad value.
    """
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from gpujobs.cli.submit import CONFIG_DIR
    from gpujobs.config.load import load_config, override_keys
    from gpujobs.launch import resolve_cluster

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="prepare"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    data_option = str(cfg.hydra.runtime.choices.get("data"))
    with open_dict(cfg):
        del cfg["hydra"]  # Hydra's own settings: what submit's task gets has none either
    return resolve_cluster(load_config(cfg, override_keys(overrides))), data_option


def plan_of(job: JobConfig, data_option: str) -> PreparePlan:
    """The data config's `PreparePlan`; ConfigError on `data` for a data config that prepares nothing."""
    prepare_plan = getattr(job.data, "prepare_plan", None)
    if not callable(prepare_plan):
        raise ConfigError("data", data_option, "a data config with input files to prepare into a store "
                          "(data=criteo); this one has nothing to prepare")
    plan: PreparePlan = prepare_plan()
    return plan


def worker_count(data: Any, plan: PreparePlan) -> int:
    """`data.prepare_workers` where set, else one process per input file, at most one per CPU."""
    chosen = getattr(data, "prepare_workers", None)
    if chosen is not None:
        return int(chosen)
    files = sum(len(paths) for paths in plan.splits.values())
    return max(1, min(files, os.cpu_count() or 1))


def say(line: str) -> None:
    """One progress line, out at once (a prepare of many files takes a while; its log is watched)."""
    print(f"gpujobs prepare: {line}", flush=True)


def count(number: int, noun: str) -> str:
    """`1 shard`, `3 shards`."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def summary(manifest: Manifest, seconds: float) -> str:
    """The final line: each split's rows and shards, the bad lines skipped, the time taken, and a warning
    counting the shards of no rows."""
    splits = [f"{split} {count(manifest.rows(split), 'row')} in "
              f"{count(sum(shard.split == split for shard in manifest.shards), 'shard')}" for split in SPLITS]
    bad = sum(shard.bad_lines for shard in manifest.shards)
    empty = sum(shard.rows == 0 for shard in manifest.shards)  # kept under bad_lines=skip, each said as it was made
    warning = f" (warning: {count(empty, 'shard')} with no rows)" if empty else ""
    return f"done in {seconds:.1f} s: {', '.join(splits)}, {count(bad, 'bad line')} skipped{warning}"


def prepare(overrides: list[str]) -> int:
    """Compose, plan and prepare, here or as the cluster's job array; returns the exit code. Raises
    GpujobsError (refusals), composition errors and OSError for `main` to put in one line."""
    job, data_option = compose_job(overrides)
    plan = plan_of(job, data_option)
    from gpujobs.backends import backend_for
    from gpujobs.backends.base import Scheduler
    from gpujobs.data.manifest import read_manifest
    from gpujobs.launch.prepare import follow_prepare, prepare_here, queue_prepare

    backend = backend_for(job)
    inputs = ", ".join(count(len(paths), f"{split} file") for split, paths in plan.splits.items())
    started = time.monotonic()
    if not isinstance(backend, Scheduler):
        workers = worker_count(job.data, plan)
        say(f"{inputs} into data.store={plan.store}, {workers} worker process{'es' if workers != 1 else ''}, "
            f"bad lines: {plan.bad_lines}")
        manifest = prepare_here(plan, workers, log=say)
    else:
        say(f"{inputs} into data.store={plan.store}, as one {backend.name} job array, bad lines: {plan.bad_lines}")
        job_id = queue_prepare(job, plan, backend, getattr(job.data, "prepare_workers", None), log=say)
        # followed unless cluster.wait=false: a prepare is mostly followed by training, which needs the store
        if job_id is not None and job.cluster.wait is False:
            say(f"{backend.name} job array {job_id} queued, not followed (cluster.wait=false): the store is ready "
                "once its last task writes the manifest")
            return 0
        if job_id is not None:
            manifest = follow_prepare(plan.store, backend, job_id)
        else:
            say("every shard was prepared already: nothing queued")
            manifest = read_manifest(plan.store)
    say(summary(manifest, time.monotonic() - started))
    return 0


def refused(text: str, code: int = EXIT_REFUSED) -> int:
    """Say why in one line on stderr; returns the exit code."""
    print(f"gpujobs: {text}", file=sys.stderr, flush=True)
    return code


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> int:
    """Entry point of `gpujobs prepare` and `python -m gpujobs.prepare`; returns the exit code."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from gpujobs.config.hydra_errors import one_line

    overrides = parser(prog or "gpujobs prepare").parse_args(sys.argv[1:] if argv is None else argv).overrides
    try:
        return prepare(overrides)
    except ConfigError as err:  # StoreError is one: a busy store, one prepared otherwise, a disk full
        return refused(f"config error: {err}")
    except GpujobsError as err:  # BadLineError: `file:line: what is wrong`
        return refused(str(err))
    except (HydraException, OmegaConfBaseException) as err:
        return refused(f"config error: {one_line(err, overrides)}")
    except OSError as err:
        where = f": {err.filename}" if err.filename else ""
        return refused(f"prepare failed: {err.strerror or err}{where}", EXIT_FAILED)

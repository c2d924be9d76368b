"""What the srun line of a Slurm job names: each task's run dir, and where it trains (torch-free).

The ranks (`python -m gpujobs.rank.srun`) and the batch step's supervisor (`gpujobs.attempt.supervise`)
read the same words off the same line, so both find the same run dir; the supervisor names the rank's
module by this string, never by importing it (the rank layer sits above this one).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from gpujobs.base.atomic import write_text_atomic
from gpujobs.rundir import CONFIG_FILE, RERUNS_DIR, lease
from gpujobs.rundir.files import read_config
from gpujobs.rundir.records import read_result
from gpujobs.rundir.trust import Untrusted, check_run_dir, own_dir

#: The module every task of a Slurm job runs (`python -m gpujobs.rank.srun ...`).
RANK_MODULE = "gpujobs.rank.srun"
_DESCRIPTION = f"`python -m {RANK_MODULE} --folder F (RUN_DIR | --points FILE)`: what every task of a Slurm job runs."

#: Exit status of a job that found its run dir held by another live job.
EXIT_STOOD_DOWN = 3


def point_run_dir(points_file: Path, task_id: int) -> Path:
    """The run dir of array index `task_id`: that line of the array's list."""
    lines = [line for line in points_file.read_text().splitlines() if line.strip()]
    if not 0 <= task_id < len(lines):
        raise SystemExit(f"gpujobs: array index {task_id} is not in {points_file} ({len(lines)} points)")
    return Path(lines[task_id])


def completed(run_dir: Path) -> bool:
    """Whether the run dir holds the result of a run that completed, with nothing left to train for its
    config (a resubmission with a longer `trainer.max_steps` continues it in place)."""
    result = read_result(run_dir)
    return result is not None and result.leaves_nothing_to(read_config(run_dir).trainer.max_steps)


def training_dir(run_dir: Path, job_id: str) -> Path:
    """Where this job trains: the run dir itself, or a fresh rerun dir when the run dir already completed.

    The choice depends only on the original run dir, which nothing writes to once it completed, so every
    rank (and every requeue of this job) makes the same one.
    """
    if not completed(run_dir):
        return run_dir
    rerun = own_dir(run_dir, RERUNS_DIR, job_id)
    write_text_atomic(rerun / CONFIG_FILE, (run_dir / CONFIG_FILE).read_text())
    return rerun


def stand_down_unless_ours(run_dir: Path, job_id: str) -> None:
    """Take the run dir's lease for Slurm job `job_id`, or exit at once when another live job holds it
    (a hand-run `sbatch` of a running run dir, a resubmit racing a requeue): nothing is touched then."""
    try:
        lease.acquire(run_dir, lease.here(job_id), wait_s=60)
    except lease.LeaseHeld as err:
        print(f"gpujobs: {err}; this job ({job_id}) stands down and leaves the run dir as it is", file=sys.stderr)
        raise SystemExit(EXIT_STOOD_DOWN) from None


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """`--folder F (RUN_DIR | --points FILE)` (the supervisor reads the same words off the srun line)."""
    parser = argparse.ArgumentParser(prog=f"python -m {RANK_MODULE}", description=_DESCRIPTION)
    parser.add_argument("--folder", type=Path, required=True, help="submitit folder: logs and result pickles")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("run_dir", type=Path, nargs="?", help="the run dir (a single job)")
    target.add_argument("--points", type=Path, help="a job array's run dirs, one per array index")
    return parser.parse_args(argv)


def run_dir_of(args: argparse.Namespace, array_task_id: Optional[str]) -> Path:
    """The run dir that this task (of an array: this array index) trains, once it and the submitit folder
    are found to be the user's alone (`gpujobs.rundir.trust`): whoever else may write them could plant the
    pickle that submitit loads, or links that the ranks would write through. Exits, saying which, if not."""
    run_dir = args.run_dir if args.points is None else point_run_dir(args.points, int(array_task_id or 0))
    try:
        check_run_dir(run_dir)
        check_run_dir(args.folder)
    except Untrusted as err:
        raise SystemExit(f"gpujobs: {err}") from None
    return run_dir

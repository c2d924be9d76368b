"""`python -m gpujobs.rank.srun --folder F (RUN_DIR | --points FILE)`: what every task of a Slurm job runs.

The sbatch script names a run dir (for a job array: a file of run dirs, one per array index), never a
pickle named by job id. Each task builds its payload from the run dir's config.yaml, then hands it to
submitit's job-side runner as if submitit had pickled it (result pickles, logs and job environment as
for any submitit job). So the `submit.sbatch` kept in every Slurm run dir can be queued again by hand:

- a run that did not complete (crashed, cancelled, out of requeues) resumes from its last checkpoint,
  in its own run dir, as a requeue would;
- a run that completed (with nothing left to train for its config) is left as it is: training starts
  again from scratch in
  `RUN_DIR/reruns/<job id>/` (with a copy of config.yaml), so "sbatch it again" reproduces the run
  (same seed, same world size: same `param_digest`) without overwriting the first result.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path
from typing import Optional

from gpujobs.attempt.preemption import catch_early
from gpujobs.base.atomic import write_text_atomic
from gpujobs.rundir import CONFIG_FILE, RERUNS_DIR, lease
from gpujobs.rundir.files import read_config
from gpujobs.rundir.records import read_result
from gpujobs.rundir.trust import Untrusted, check_run_dir, own_dir

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
    parser = argparse.ArgumentParser(prog="python -m gpujobs.rank.srun", description=__doc__.splitlines()[0])
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


def main(argv: Optional[list[str]] = None) -> None:
    """Build this task's payload from its run dir and run it under submitit's job-side runner."""
    catch_early()  # before anything slow: a USR2 while this rank starts is kept for the watcher
    args = parse_args(argv)

    import submitit

    from gpujobs.backends.submitit_private import DelayedSubmission, cloudpickle_dump, process_job, submitted_pickle
    from gpujobs.rank.main import make_payload

    os.environ["SUBMITIT_FOLDER"] = str(args.folder)
    env = submitit.JobEnvironment()
    run_dir = run_dir_of(args, env.array_task_id)
    job = read_config(run_dir)
    train_dir = training_dir(run_dir, env.job_id)
    stand_down_unless_ours(train_dir, str(env.job_id))
    delayed = DelayedSubmission(make_payload(job, train_dir))
    delayed.set_timeout(job.cluster.timeout_min, max_num_timeout=3)
    # Every rank writes the same payload where submitit's runner looks for it; rename keeps it whole.
    pickle = submitted_pickle(args.folder, env.job_id)
    pickle.parent.mkdir(parents=True, exist_ok=True)
    tmp = pickle.with_name(f".{pickle.name}.{uuid.uuid4().hex}")
    cloudpickle_dump(delayed, tmp)
    os.replace(tmp, pickle)
    process_job(args.folder)


if __name__ == "__main__":
    main()

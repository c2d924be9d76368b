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

import os
import uuid
from typing import Optional

from gpujobs.attempt.preemption import catch_early
from gpujobs.attempt.slurm_task import parse_args, run_dir_of, stand_down_unless_ours, training_dir
from gpujobs.rundir.files import read_config


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

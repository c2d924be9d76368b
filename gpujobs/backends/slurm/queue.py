"""Queue one run dir's job with `sbatch` alone: the submit side's common case (`cluster.wait=false`).

submitit's executor (`executor.py`) costs its import, about a tenth of a submit (asyncio, tarfile,
importlib.metadata, cloudpickle), though queueing needs none of it: the script is `render_sbatch`'s text
(the one renderer: what a dry run prints and `submit.sbatch` keeps), sbatch takes it through the one
Slurm command runner, and the queued copy lies where submitit keeps it (`<folder>/<job id>_submission.sh`,
its `JobPaths.submission_file`), so the job reads as one submitit queued. Following it (`cluster.wait`)
needs only its id and folder (`executor.follow_slurm`); job arrays (sweeps) go through submitit's
executor.
"""

from __future__ import annotations

import contextlib
import secrets
from pathlib import Path

from gpujobs.backends.slurm.commands import last_line, slurm_command
from gpujobs.backends.slurm.sbatch import run_dir_script
from gpujobs.base.atomic import write_text_atomic
from gpujobs.base.errors import SubmitError
from gpujobs.config.load import JobConfig
from gpujobs.rundir import SBATCH_FILE, lease
from gpujobs.rundir.files import record_submission


def queue_single(job: JobConfig, run_dir: Path) -> str:
    """Queue the run dir's job; keep the exact script as `submit.sbatch`; return the job id.

    The run dir's lease passes to the new job (LeaseHeld when another live job holds it). When sbatch
    refuses: SubmitError with its reason, and nothing of the submission left in the run dir.
    """
    lease.check_free(run_dir, lease.here())
    folder = run_dir / job.cluster.folder
    script = run_dir_script(job, run_dir)
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)  # the tasks' logs go there: Slurm makes no directories
    queued = folder / f".submission_file_{secrets.token_hex(16)}.sh"
    queued.write_text(script)
    try:
        job_id = sbatch_parsable(queued, "the job")
    except SubmitError:
        queued.unlink(missing_ok=True)
        if made:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    queued.rename(folder / f"{job_id}_submission.sh")
    lease.replace(run_dir, lease.here(job_id))
    write_text_atomic(run_dir / SBATCH_FILE, script)
    record_submission(run_dir, job_id, folder)
    return job_id


def sbatch_parsable(script: Path, what: str) -> str:
    """Queue `script` with `sbatch --parsable`; the job id. SubmitError "sbatch refused WHAT: its reason" when
    it refuses (its last stderr line, else stdout's, else the exit status)."""
    proc = slurm_command(["sbatch", "--parsable", str(script)], check=False)
    job_id = proc.stdout.strip().split(";")[0]
    if proc.returncode != 0 or not job_id.isdigit():
        said = last_line(proc.stderr) or last_line(proc.stdout) or f"exit status {proc.returncode}"
        raise SubmitError(f"sbatch refused {what}: {said}")
    return job_id

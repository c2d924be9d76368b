"""submitit's private names that gpujobs relies on, all in this one module (written for submitit 1.5.x).

submitit's public API (executors, jobs, `JobEnvironment`) pickles a callable on the submit side; gpujobs
instead renders its own sbatch script and builds each task's payload on the job side, which needs
submitit's hooks and job-side runner. Every such name is used here and only here, and listed in
`PRIVATE_NAMES`; `tests/test_private_apis.py` checks each against the installed submitit (that it
exists, is of the kind and takes the parameters used here), so an upgrade that moves one fails there,
naming it, instead of in a user's job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import DelayedSubmission, FailedJobError, JobPaths, UncompletedJobError, cloudpickle_dump

#: The submitit series this module is written for (`pip` pins it in pyproject.toml).
PINNED = {"submitit": "1.5"}

#: Every private name used below, as (module, dotted attribute, kind, parameters used), for the test.
#: kind: "class", "function" (parameters after `self`, in order), "property", "attribute" (of the class),
#: "instance attribute" (set by `__init__`).
PRIVATE_NAMES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("submitit.core.submission", "process_job", "function", ("folder",)),
    ("submitit.core.utils", "DelayedSubmission", "class", ()),
    ("submitit.core.utils", "FailedJobError", "class", ()),
    ("submitit.core.utils", "UncompletedJobError", "class", ()),
    ("submitit.core.utils", "cloudpickle_dump", "function", ("obj", "filename")),
    ("submitit.core.utils", "JobPaths", "class", ("folder", "job_id", "task_id")),
    ("submitit.core.utils", "JobPaths.submitted_pickle", "property", ()),
    ("submitit.core.utils", "JobPaths.submission_file", "property", ()),
    ("submitit", "SlurmExecutor._submit_command", "function", ("command",)),
    ("submitit", "SlurmExecutor._make_submission_file_text", "function", ("command", "uid")),
    ("submitit", "SlurmExecutor._internal_process_submissions", "function", ("delayed_submissions",)),
    ("submitit", "SlurmExecutor._num_tasks", "function", ()),
    ("submitit", "SlurmJob._sub_jobs", "instance attribute", ()),
    ("submitit", "SlurmJob._results_timeout_s", "attribute", ()),
)

#: A job that ended without its result (failed, or stopped early): what `job.results()` raises.
JOB_ENDED_WITHOUT_RESULT = (FailedJobError, UncompletedJobError)

__all__ = [
    "JOB_ENDED_WITHOUT_RESULT", "DelayedSubmission", "FailedJobError", "RenderedSlurmExecutor",
    "UncompletedJobError", "cloudpickle_dump", "process_job", "skip_results_wait", "submission_file",
    "submitted_pickle",
]


class RenderedSlurmExecutor(submitit.SlurmExecutor):
    """submitit's Slurm executor whose submission file is `script()`'s text: the one renderer.

    submitit's own array path (`map_array`, `batch()`) would copy a plain `SlurmExecutor` and bypass
    `script()`, which is why pickled submissions are refused: `submit_command` is the way in.
    """

    def script(self) -> str:
        """The exact text `sbatch` gets."""
        raise NotImplementedError

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return self.script()

    def _internal_process_submissions(self, delayed_submissions: list[Any]) -> list[Any]:
        raise NotImplementedError("gpujobs builds payloads job-side from the run dir: use submit_command()")

    def submit_command(self, command: str) -> submitit.Job[Any]:
        """`sbatch` the script (which runs `command`); submitit's job for it. FailedJobError if sbatch refused."""
        return self._submit_command(command)

    def num_tasks(self) -> int:
        """Tasks per job (array task), as submitit counts them from the parameters."""
        return self._num_tasks()


def process_job(folder: Path) -> None:
    """Run, in this task, the payload submitit's job-side runner finds in `folder` (`submitted_pickle`).

    Imported when called: `submitit.core.submission` imports numpy, which the submit side never needs."""
    from submitit.core.submission import process_job as run

    run(folder)


def skip_results_wait(sjob: Any) -> None:
    """Make `sjob.results()` read what is there at once: submitit waits up to 15 s per task for a
    result file that a slow shared filesystem may not show yet."""
    for task in sjob._sub_jobs or [sjob]:
        task._results_timeout_s = 0


def submitted_pickle(folder: Path, job_id: str) -> Path:
    """Where submitit's job-side runner (`process_job`) reads the payload of job `job_id`."""
    return Path(JobPaths(folder, job_id=job_id).submitted_pickle)


def submission_file(sjob: Any) -> Path:
    """The script submitit kept for a queued job (what `sbatch` got)."""
    return Path(sjob.paths.submission_file)

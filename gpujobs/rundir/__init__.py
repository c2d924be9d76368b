"""The run directory: one torch-free package owns its layout, its records and its lease; both sides use it.

A run dir is shared by every attempt of its job (requeues, restarts, a hand-run `sbatch` of its
`submit.sbatch`). Every file name is defined here, once::

    config.yaml        the resolved, validated config (`files.write_config` / `files.read_config`)
    plan.json          the memory plan made at submit: per table where it lives, per rank its bytes
    checkpoints/       step_<N>/ with a COMPLETE marker written last (gpujobs.rank.checkpoint)
    attempts.jsonl     one line per attempt (`attempts.AttemptLog`)
    result.json        the completed run's result
    metrics.jsonl      rank 0's metrics, one line per log step
    gpu.<node>.jsonl   GPU telemetry samples, a file a node (`gpu_files`; gpu.jsonl in earlier versions)
    slurm_jobs.jsonl   the queued submissions of the run dir: Slurm jobs, JobSets (`files.read_submissions`)
    lease.json         the job that runs the run dir (`lease`)
    submit.sbatch      the script that queues the run dir alone
    jobset.yaml        the JobSet created for the run dir (cluster=kubernetes)
    prometheus.json    where the Prometheus endpoint listens
    tracker.json       the experiment trackers' run of this run dir (MLflow run id, TensorBoard log dir)
    reruns/<job id>/   runs of a completed run dir's submit.sbatch queued again
    heartbeat/         rank_<N>.json: each rank's step and phase, rewritten every second (the watchdog reads them)
    hangs/<attempt>/   a hung attempt's evidence: every rank's stacks, NCCL's flight recorder, NVML
    failures/          rank_<N>.json: a rank's error as it failed (rank 0 records the first in the ledger)
    nccl/              the files NCCL writes (`nccl.extra.NCCL_DEBUG_FILE` and the dumps), by name

JSON-lines files are read with `read_jsonl`, which skips a line torn by a crash. Modules:
`files` (config and submissions), `attempts` (the ledger and its budgets), `lease` (one job per run
dir), `process` (a process named by pid and start, as the lease names its holder), `resume` (resume
only the same run), `trackers` (tracker.json) and `trust` (a run dir is the user's alone; nothing in it
is written through a link). The job side imports these, never `gpujobs.launch`.
"""

from __future__ import annotations

from gpujobs.base.atomic import read_jsonl
from gpujobs.config.nccl import NCCL_DIR  # named where the settings that fill it are

CONFIG_FILE = "config.yaml"
PLAN_FILE = "plan.json"
CHECKPOINT_DIR = "checkpoints"
#: A checkpoint is CHECKPOINT_DIR/step_<8 digits>/, published by its MARKER file.
STEP_PREFIX = "step_"
MARKER = "COMPLETE"
ATTEMPTS_FILE = "attempts.jsonl"
RESULT_FILE = "result.json"
METRICS_FILE = "metrics.jsonl"
#: Every node's GPU samples in one file, as run dirs of earlier versions hold them (read, never written now:
#: each node has its own, `gpu_files.gpu_file`).
GPU_FILE = "gpu.jsonl"
SUBMISSIONS_FILE = "slurm_jobs.jsonl"
LEASE_FILE = "lease.json"
SBATCH_FILE = "submit.sbatch"
PROMETHEUS_FILE = "prometheus.json"
TRACKER_FILE = "tracker.json"
RERUNS_DIR = "reruns"
HEARTBEAT_DIR = "heartbeat"
HANGS_DIR = "hangs"
FAILURES_DIR = "failures"

#: The entries above, those a run dir holds at its top: a directory with none of them (nor the submitit
#: folder, `cluster.folder`) is no run dir (`trust.check_run_dir_files`).
RUN_DIR_NAMES = frozenset({
    CONFIG_FILE, PLAN_FILE, CHECKPOINT_DIR, ATTEMPTS_FILE, RESULT_FILE, METRICS_FILE, GPU_FILE, SUBMISSIONS_FILE,
    LEASE_FILE, SBATCH_FILE, PROMETHEUS_FILE, TRACKER_FILE, RERUNS_DIR, HEARTBEAT_DIR, HANGS_DIR, FAILURES_DIR,
    NCCL_DIR,
})

__all__ = [
    "ATTEMPTS_FILE", "CHECKPOINT_DIR", "CONFIG_FILE", "FAILURES_DIR", "GPU_FILE", "HANGS_DIR", "HEARTBEAT_DIR",
    "LEASE_FILE", "MARKER", "METRICS_FILE", "NCCL_DIR", "PLAN_FILE", "PROMETHEUS_FILE", "RERUNS_DIR", "RESULT_FILE",
    "RUN_DIR_NAMES", "SBATCH_FILE", "STEP_PREFIX", "SUBMISSIONS_FILE", "TRACKER_FILE", "read_jsonl",
]

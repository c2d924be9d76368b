"""Submit side (torch-free): check a validated job against where it will run, then run or submit it."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Optional

from gpujobs.backends import backend_for, backend_named, names, resolve_cluster_name
from gpujobs.backends.base import NO_SCRIPT, Backend
from gpujobs.backends.container_words import SRUN_OPTIONS
from gpujobs.base.errors import ConfigError, SubmitError
from gpujobs.base.hostname import loopback_hostname
from gpujobs.config.container import NO_RUNTIME
from gpujobs.config.load import JobConfig
from gpujobs.config.memory import MemoryPlan
from gpujobs.config.modes import Runtime
from gpujobs.config.validate import check_slurm_path
from gpujobs.launch.memory import plan_job
from gpujobs.launch.next_steps import next_steps
from gpujobs.rundir import CONFIG_FILE, PLAN_FILE
from gpujobs.rundir.files import write_config
from gpujobs.rundir.plan import write_plan


def resolve_cluster(job: JobConfig) -> JobConfig:
    """`job` with `cluster=auto` replaced by the cluster this machine submits to (a copy; `job` if not auto).

    Probing the machine is the submit side's business: `load_config` also reads a run dir's config.yaml
    on the job side, which holds the name picked here.
    """
    name = resolve_cluster_name(job.cluster.name)
    if name == job.cluster.name:
        return job
    return dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, name=name))


def check_paths(job: JobConfig, run_dir: Path, sweep_dir: Optional[Path] = None) -> None:
    """Refuse run-dir paths that Slurm or a container runtime would misread (ConfigError naming the Hydra key),
    before any write.

    Control characters are refused for every cluster; `%` and `\\` where the job goes to Slurm, which
    expands the one in its log paths and drops the other from `#SBATCH` lines; `:` and `,` in what a
    container mounts at its own path (`ContainerConfig.check_mounted_path`). In a sweep, `run_dir` is the
    point's dir under `sweep_dir`.
    """
    slurm = backend_for(job).parses_paths
    run_key = "hydra.run.dir" if sweep_dir is None else "hydra.sweep.subdir"
    if sweep_dir is not None:
        check_slurm_path("hydra.sweep.dir", sweep_dir, slurm=slurm)
    check_slurm_path(run_key, run_dir, slurm=slurm)
    check_slurm_path("cluster.folder", job.cluster.folder, slurm=slurm)
    store = getattr(job.data, "store", None)  # a data config with a prepared store
    mounted = [("hydra.runtime.cwd", Path.cwd()), *([("hydra.sweep.dir", sweep_dir)] if sweep_dir else []),
               (run_key, run_dir), *([("data.store", store)] if store else [])]
    for key, path in mounted:
        job.container.check_mounted_path(key, path)


def preflight(job: JobConfig, cache: Optional[dict[Any, Any]] = None) -> Optional[MemoryPlan]:
    """Refuse, with a ConfigError, what the chosen cluster cannot run, or a model that does not fit its memory
    (`gpujobs.launch.memory`); nothing is written before. Returns the memory plan (None where the model cannot
    describe itself).

    `cache` keeps what the cluster said across the points of a sweep (see `Backend.preflight`).
    """
    backend = backend_for(job)
    if job.cluster.dry_run and not backend.renders:
        raise ConfigError("cluster.dry_run", True, NO_SCRIPT)
    _check_container(job, backend)  # before anything else asks the cluster: nothing of it runs outside unasked
    job.logger.check_here()  # a tracker's package missing, a log dir that cannot be: refused here, not on the job side
    plan = plan_job(job, cache)  # a model that cannot fit needs no data and no cluster's word
    check_data = getattr(job.data, "check_here", None) if job.script is None else None  # a script reads no data
    if check_data is not None:  # e.g. a sample store missing or unfinished: refused here, not after the queue
        check_data(job)
    _check_replay(job)
    said = derive_cpus(job, backend, cache)
    backend.preflight(job, cache)
    if said is not None:  # after every check: a refused submit's one line stands alone
        print(said, file=sys.stderr)
    warn_loopback(job)
    return plan


def derive_cpus(job: JobConfig, backend: Backend, cache: Optional[dict[Any, Any]] = None) -> Optional[str]:
    """`resources.cpus_per_task: null` made the CPUs a rank gets on the nodes `backend` would run `job` on
    (`ResourcesConfig.derived_cpus`), in `job` itself: the config written to the run dir and the script
    queued hold it. Returns, for the caller to print, the line that says so where GPU ranks' nodes' CPUs are
    unknown from here (once a sweep): the value is then a guess the user may want to set."""
    res = job.resources
    if res.cpus_per_task is not None:
        return None
    node_cpus = backend.node_cpus(job, cache) if res.gpus_per_node else None
    cpus, why = res.derived_cpus(node_cpus)
    res.cpus_per_task = cpus
    said: set[str] = cache.setdefault("cpus_per_task said", set()) if cache is not None else set()
    line = f"gpujobs: resources.cpus_per_task=null: {cpus} CPUs per rank ({why})"
    if not res.gpus_per_node or node_cpus is not None or line in said:
        return None
    said.add(line)
    return line


def warn_loopback(job: JobConfig) -> Optional[str]:
    """Warn (stderr; the warning is returned) where ranks of several nodes would leave gloo to the hostname and
    this node's resolves to loopback: a cluster's nodes are often set up alike, and there ranks never meet."""
    if job.resources.nodes < 2 or job.nccl.gloo_socket_ifname is not None or job.nccl.socket_ifname is not None:
        return None
    loopback = loopback_hostname()
    if loopback is None:
        return None
    warning = (f"gpujobs: warning: {loopback}: where the nodes' hostnames resolve so too, gloo (which carries the "
               "ranks' first collective, on GPUs as well) listens on loopback and ranks of two nodes never meet; "
               "set nccl.socket_ifname (or nccl.gloo_socket_ifname) to the nodes' interface")
    print(warning, file=sys.stderr)
    return warning


def _check_container(job: JobConfig, backend: Backend) -> None:
    """`container=`: a runtime the chosen cluster runs the ranks in (none always is), an image alone only where
    the cluster runs it itself (`Backend.runs_images`), an image file that exists and can be read, mounts whose
    host paths exist (`ContainerConfig.check_here`)."""
    runtime = job.container.runtime
    if runtime == Runtime.none and job.container.image and not backend.runs_images:
        alone = "|".join(name for name in names() if backend_named(name).runs_images)
        raise ConfigError("container.image", job.container.image, f"{NO_RUNTIME}; cluster={alone} takes an image alone")
    if runtime != Runtime.none and runtime not in backend.container_runtimes:
        where = [name for name in names() if runtime in backend_named(name).container_runtimes]
        runs = f"runs on cluster={'|'.join(where)}" if where else "runs on no cluster"
        why = f": it is {SRUN_OPTIONS[runtime]}" if runtime in SRUN_OPTIONS else " in this version"
        others = "".join(f", {r}" for r in sorted(backend.container_runtimes))
        raise ConfigError("container", runtime.value, f"none{others} on cluster={backend.name} "
                          f"(container={runtime} {runs}{why})")
    if runtime != Runtime.none:
        store = getattr(job.data, "store", None)  # a data config with a prepared store (it is absolute by now)
        job.container.check_here([Path.cwd(), *([Path(store)] if store else [])])


def _check_replay(job: JobConfig) -> None:
    """`trainer.balance=replay`: its run dir must hold a plan history now, not only when the job (maybe after
    hours in a queue) starts and reads it the same way."""
    from gpujobs.rundir.resume import NoPlanHistory, global_batch_of, plan_history, plan_misfit

    replay = job.trainer.balance_replay
    if job.trainer.balance != "replay" or not replay:
        return
    try:
        history = plan_history(Path(replay))
    except NoPlanHistory as err:
        raise ConfigError("trainer.balance_replay", replay, f"the run dir of a finished trainer.balance=dynamic "
                          f"run ({err})") from None
    world, batch = job.resources.world_size, global_batch_of(job)
    rows = batch // job.trainer.grad_accum if batch is not None else None  # a data config that cannot say: ranks only
    misfit = plan_misfit(history, world, rows)
    if misfit is not None:
        counts = [int(c) for c in misfit["counts"]]
        fits = f"{world} ranks" + (f" and {rows} rows per micro-batch" if rows is not None else "")
        raise ConfigError("trainer.balance_replay", replay, f"the run dir of a finished trainer.balance=dynamic "
                          f"run of {fits} throughout (its plan of step {misfit['step']} splits {sum(counts)} rows "
                          f"over {len(counts)} ranks)")


def check_start(job: JobConfig, run_dir: Path, key: str = "hydra.run.dir") -> None:
    """Refuse, before anything is written, a start that `run_dir` must not take (every single run and
    every point of a sweep, local or Slurm, asks): a sweep dir, which holds points, not a run
    (ConfigError on `key`, the Hydra key that placed the run dir); a run dir that is not the user's alone
    (ConfigError: `gpujobs.rundir.trust`), or under a directory someone else may change; a directory of other
    files, or a run dir sharing a file with another (a hard link: ConfigError); checkpoints of another run, or
    ones that `checkpoint.resume=false` would prune (ResumeMismatch); another live job's lease (LeaseHeld).
    Each is one line naming the run dir."""
    from gpujobs.launch.sweep_file import SWEEP_FILE
    from gpujobs.rundir import lease
    from gpujobs.rundir.resume import check_run_dir
    from gpujobs.rundir.trust import check_dir, check_run_dir_files

    check_dir(key, run_dir)  # first: whoever else may write it could have planted what the checks below read
    check_dir("cluster.folder", run_dir / job.cluster.folder)  # submitit's pickles: in a sticky run dir, anyone's
    if (run_dir / SWEEP_FILE).exists():
        raise ConfigError(key, str(run_dir), f"a run dir, not a sweep dir (it holds {SWEEP_FILE}: a sweep dir "
                          "holds the points' run dirs, not a run)")
    check_run_dir_files(key, run_dir, job.cluster.folder)  # a user's other work, a cp -al copy: never written
    check_run_dir(job, run_dir)  # a run dir with checkpoints resumes only the same run
    lease.check_free(run_dir)  # a sweep point's too: refused here, not after the points before it ran


def launch(job: JobConfig, run_dir: Path) -> int:
    """Preflight and `check_start`, then start the job (or, for a dry run, print its script); returns the
    exit code. A start ends with the run dir and the commands that read it (`next_steps`)."""
    plan = preflight(job)
    check_start(job, run_dir)
    if job.cluster.dry_run:
        from gpujobs.rundir.files import discard_if_empty

        script = backend_for(job).render(job, run_dir)  # first: a render refused is one line, no plan before it
        if plan is not None:  # on stderr: stdout is the script, as it would be queued
            print(plan.render(), file=sys.stderr)
        print(script, end="")
        discard_if_empty(run_dir)  # a dry run leaves nothing behind, not even the empty run dir
        return 0
    code = start(job, run_dir, plan)
    backend = backend_for(job)
    print(next_steps(run_dir, queued=backend.queues and not backend.follows(job)), flush=True)
    return code


def start(job: JobConfig, run_dir: Path, plan: Optional[MemoryPlan] = None) -> int:
    """Take the run dir's lease, write its config (and its memory `plan`, plan.json), then run or submit the
    already checked job; returns the exit code. Raises LeaseHeld, before anything is written, when another
    live job runs the run dir."""
    from gpujobs.rundir import lease
    from gpujobs.rundir.records import read_result

    result = read_result(run_dir)
    if result is not None and result.leaves_nothing_to(job.trainer.max_steps):
        print(f"gpujobs: run dir {run_dir} completed already ({result.steps} steps): nothing to run, and its "
              "result stays (a longer trainer.max_steps continues it; a new run dir trains it again)", flush=True)
        return 0
    # this launcher's; a queueing backend's submission hands it to the job it queues
    backend = backend_for(job)
    me = lease.here(submitting=backend.queues)
    lease.acquire(run_dir, me)
    had_config = (run_dir / CONFIG_FILE).exists()
    write_config(run_dir, job)
    if plan is not None:
        write_plan(run_dir, plan)
    if backend.in_process:  # exceptions go to the user (pdb): nothing to give back
        return backend.start(job, run_dir)
    try:
        return backend.start(job, run_dir)
    except (SubmitError, ConfigError):
        # refused before anything ran or was queued (sbatch said no, too few GPUs free): nothing of it stays
        lease.release(run_dir, me)
        if not had_config:
            (run_dir / CONFIG_FILE).unlink(missing_ok=True)
            (run_dir / PLAN_FILE).unlink(missing_ok=True)
        raise

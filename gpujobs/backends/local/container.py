"""A local job's ranks in a container (`container=podman|charliecloud|apptainer`): the interpreter each rank
task runs, and what preflight checks of the runtime here (torch-free).

submitit's local controller shlex-splits its `python=` string and runs it once per rank; here that string
is the runtime's argv and the image's `python3`, so the launcher and the controller stay outside and only
the ranks are in the image. Every runtime shares the host's pid and network namespaces (ch-run and
apptainer always, podman by `--pid=host --network=host`): the launcher's signals, the hang watchdog's
/proc reads and the ranks' rendezvous on 127.0.0.1 work as without a container. The run dir, the submit
directory and the data store are mounted at their own paths (`gpujobs.backends.container_words`).
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional

from gpujobs.backends.container_words import (
    CONTAINER_PYTHON,
    apptainer_words,
    ch_run_words,
    same_path_mounts,
    submitting_bins,
)
from gpujobs.base.errors import ConfigError
from gpujobs.config.container import ContainerConfig, Mount
from gpujobs.config.load import JobConfig
from gpujobs.config.modes import Runtime

#: The runtimes a local job's ranks run in, and the program each needs on PATH here.
LOCAL_RUNTIMES = {Runtime.podman: "podman", Runtime.charliecloud: "ch-run", Runtime.apptainer: "apptainer"}
#: Runtime clients that stay the controller's child while the rank runs elsewhere (podman's is a Go program
#: that catches every signal and only waits for its container; the rank is the child of podman's conmon).
RUNTIME_CLIENTS = frozenset({"podman"})
#: What a rank reads of the environment the controller gives it, passed by name into podman, which passes
#: nothing unasked: submitit's job environment, gpujobs' own switches, CUDA's, NCCL's and torch's settings,
#: torchrun's rendezvous, the thread count and Python's output and hashing (a `PREFIX*` passes every name
#: that starts so). ch-run and apptainer pass the whole environment.
RANK_ENV = ("SUBMITIT_*", "GPUJOBS_*", "CUDA_*", "NCCL_*", "TORCH_*", "MASTER_*", "OMP_*", "PYTHONUNBUFFERED",
            "PYTHONHASHSEED", "HYDRA_FULL_ERROR")
#: ch-run binds the host's /tmp at /tmp: a path under it needs no directory in the image.
_CH_RUN_TMP = Path("/tmp")
#: `podman image exists` reads the local image store: well under a second unless the store is locked.
_PODMAN_ASK_TIMEOUT_S = 30.0


def rank_python(job: JobConfig, run_dir: Path, submit_dir: Path, env: Mapping[str, str] = os.environ) -> str:
    """submitit's `python=` for `job`'s ranks: this Python (container=none), else the runtime's argv and the
    image's interpreter, shell-quoted. `env` is the launcher's environment (the controller's is a copy)."""
    box = job.container
    if box.runtime == Runtime.none:
        return shlex.quote(sys.executable)
    mounts = same_path_mounts(job, run_dir, submit_dir)
    workdir = box.workdir or str(submit_dir)
    gpus = box.gpus_on(job.resources.gpus_per_node)
    words: Sequence[str]
    if box.runtime == Runtime.podman:
        words = podman_words(box, mounts, workdir, gpus, run_dir, root=os.geteuid() == 0)
    elif box.runtime == Runtime.charliecloud:
        words = _ch_run(box, mounts, workdir, env)
    else:
        words = apptainer_words(box, mounts, workdir, gpus)
    return shlex.join([*words, CONTAINER_PYTHON])


def podman_words(box: ContainerConfig, mounts: list[Mount], workdir: str, gpus: bool, run_dir: Path, *,
                 root: bool) -> tuple[str, ...]:
    """`podman run` for one rank: host pid, network and IPC namespaces (the watchdog reads the ranks' pids,
    gloo and NCCL meet on 127.0.0.1 and share /dev/shm); no signal proxy (a rank still starting would die of
    a forwarded USR2: the launcher signals the ranks themselves); the caller's uid inside when not root
    (podman refuses `--userns=keep-id` to root); GPUs through CDI; the run dir as a label (`podman ps
    --filter label=gpujobs.run_dir=...`)."""
    assert box.image is not None  # ContainerConfig refuses a runtime without one
    names = [word for name in (*RANK_ENV, *box.env) for word in ("--env", name)]
    return ("podman", "run", "--rm", "--pid=host", "--network=host", "--ipc=host", "--sig-proxy=false",
            *([] if root else ["--userns=keep-id"]), f"--label=gpujobs.run_dir={run_dir}",
            *[word for m in mounts for word in ("-v", m.text())], "-w", workdir,
            *(["--device", "nvidia.com/gpu=all"] if gpus else []), *names, box.image)


def _ch_run(box: ContainerConfig, mounts: list[Mount], workdir: str, env: Mapping[str, str]) -> list[str]:
    """ch-run keeps the caller's environment, which holds the launcher's venv: its `python3` (a link to a
    host interpreter, or through a mount of the submit directory a working one with host packages) must not
    be the one found inside, so PATH loses the venv's bin and VIRTUAL_ENV goes. ch-run needs USER set."""
    venvs = set(submitting_bins(sys.executable, env.get("VIRTUAL_ENV")))
    path = os.pathsep.join(d for d in env.get("PATH", os.defpath).split(os.pathsep) if d and d not in venvs)
    user = [] if env.get("USER") else ["env", f"USER={pwd.getpwuid(os.getuid()).pw_name}"]
    return [*user, *ch_run_words(box, mounts, workdir, ["--unset-env=VIRTUAL_ENV", f"--set-env=PATH={path}"])]


def tasks_are_ranks(box: ContainerConfig) -> bool:
    """Whether the controller's USR2 to a task it started (at the time limit less the lead) reaches the rank:
    the task is the rank (container=none; ch-run execs it) or passes signals on (apptainer's starter), but
    podman's client passes none (`--sig-proxy=false`)."""
    return LOCAL_RUNTIMES.get(box.runtime) not in RUNTIME_CLIENTS


def check_local_container(job: JobConfig, submit_dir: Path, run_dir: Optional[Path] = None) -> None:
    """Refuse (ConfigError) a runtime whose program is not on PATH here, an image podman's storage does not
    hold (or a reference podman cannot read), and an image directory that ch-run cannot bind a mount into:
    every mount's container path (and the workdir) must be a directory in the image or lie under /tmp.
    `run_dir`, once known, is checked with the rest."""
    box = job.container
    if box.runtime == Runtime.none:
        return
    program = LOCAL_RUNTIMES[box.runtime]
    if shutil.which(program) is None:
        raise ConfigError("container.runtime", box.runtime.value, f"a runtime installed here ({program} is not "
                          "on PATH: the ranks of cluster=local run through it)")
    if box.runtime == Runtime.podman and box.image is not None and run_dir is None:  # asked once, at preflight
        check_podman_image(box.image)
    if box.runtime == Runtime.charliecloud and box.image is not None and Path(box.image).is_dir():
        mounts = same_path_mounts(job, run_dir or submit_dir, submit_dir)
        purposes = {str(submit_dir): "the submit directory's mount", str(run_dir): "the run directory's mount"}
        wanted = [(m.container, purposes.get(m.host, f"the mount of {m.host}")) for m in mounts]
        for path, what in [*wanted, *([(box.workdir, "container.workdir")] if box.workdir else [])]:
            _check_bind_target(box.image, path, what)


def check_podman_image(image: str) -> None:
    """Refuse (ConfigError on container.image) an image that podman's storage here does not hold, or a reference
    podman cannot read, asking `podman image exists`: otherwise every rank's `podman run` would try a registry
    (or die of `invalid reference format`) after the job started, and the attempt would fail with exit 1."""
    command = ["podman", "image", "exists", image]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, errors="replace",
                              timeout=_PODMAN_ASK_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        why = (f"it did not answer within {_PODMAN_ASK_TIMEOUT_S:g} s" if isinstance(err, subprocess.TimeoutExpired)
               else f"it could not run: {err.strerror or err}")
        raise ConfigError("container.image", image, f"an image podman can be asked about ({why})") from None
    if proc.returncode == 0:
        return
    if proc.returncode == 1:  # podman's answer "no such image" (any error is 125)
        raise ConfigError("container.image", image, "an image in podman's storage on this machine (`podman image "
                          "exists` says it is not there: podman pull or podman load it first)")
    said = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    raise ConfigError("container.image", image, f"an image reference podman reads (podman image exists: {said})")


def _check_bind_target(image: str, inside: str, what: str) -> None:
    """ch-run binds only onto a directory the image has (it is read-only), or under /tmp (bound from the host)."""
    if Path(inside) == _CH_RUN_TMP or _CH_RUN_TMP in Path(inside).parents:
        return
    target = Path(image) / inside.lstrip("/")
    if not target.is_dir():
        raise ConfigError("container.image", image, f"an image directory holding {inside} for {what} (ch-run "
                          f"binds only onto existing directories): create it in the image (mkdir -p {target})")

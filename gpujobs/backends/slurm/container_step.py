"""The ranks' srun step in a container (`container=pyxis|apptainer|charliecloud|oci`): its words, decided here.

`sbatch.sbatch_request` puts them between srun's own options and the rank command, and the template quotes
each; the supervisor, which runs the srun line, stays outside in the batch step. The run dir (a sweep's dir
for an array), the submit directory and the data store are mounted at their own paths, so every path in the
config, the ledger and the logs means the same inside and out. Each runtime's words are the ones it documents:
pyxis (github.com/NVIDIA/pyxis/wiki/Usage), `apptainer exec`, Charliecloud's `ch-run`, Slurm's `srun --container`;
the mounts and the argv a local run shares are `gpujobs.backends.container_words`'.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from gpujobs.backends.container_words import (
    CONTAINER_PYTHON,
    apptainer_words,
    ch_run_words,
    same_path_mounts,
    submitting_bins,
)
from gpujobs.config.container import ContainerConfig, Mount
from gpujobs.config.load import JobConfig
from gpujobs.config.modes import Runtime

#: The runtimes a Slurm job's step runs in.
SLURM_RUNTIMES = frozenset({Runtime.pyxis, Runtime.apptainer, Runtime.charliecloud, Runtime.oci})
#: enroot's GPU hook stands down where the image's NVIDIA_VISIBLE_DEVICES is `void` (pyxis, container.gpus=false).
_NO_GPUS = ("NVIDIA_VISIBLE_DEVICES", "void")


@dataclass(frozen=True)
class ContainerStep:
    """The srun step's container, rendered: what the template writes around the rank command."""

    runtime: str = ""
    """The runtime's name ('' without a container: the script is the plain one)."""
    words: tuple[str, ...] = ()
    """srun's container options and the runtime's argv, before the rank command (each quoted by the template)."""
    pass_env: tuple[str, ...] = ()
    """apptainer: names exported as APPTAINERENV_NAME (their values over the image's) where set."""
    env: tuple[tuple[str, str], ...] = ()
    """Variables the script exports for the runtime (pyxis without GPUs: NVIDIA_VISIBLE_DEVICES=void)."""
    hide_bin: str = ""
    """charliecloud: the submitting Python's bin, which the script takes off PATH (ch-run passes PATH on, and
    that bin's python3 is mounted with the submit directory: the image's must win); '' for none."""


def container_step(job: JobConfig, root: Path, submit_dir: Path, python: str = sys.executable) -> ContainerStep:
    """The step's container words for `job` (an empty ContainerStep for container=none); `python` runs the
    supervisor outside."""
    box = job.container
    if box.runtime == Runtime.none:
        return ContainerStep()
    if box.runtime not in SLURM_RUNTIMES:  # preflight refuses it first (`gpujobs.launch.preflight`)
        raise ValueError(f"container={box.runtime} has no Slurm step")
    assert box.image is not None  # ContainerConfig refuses a runtime without one
    mounts = same_path_mounts(job, root, submit_dir)
    workdir = box.workdir or str(submit_dir)
    gpus = box.gpus_on(job.resources.gpus_per_node)
    if box.runtime == Runtime.pyxis:
        return _pyxis(box, box.image, mounts, workdir, gpus)
    if box.runtime == Runtime.apptainer:
        words = apptainer_words(box, mounts, workdir, gpus)
        return ContainerStep(box.runtime.value, words, pass_env=tuple(box.env))
    if box.runtime == Runtime.charliecloud:
        return ContainerStep(box.runtime.value, ch_run_words(box, mounts, workdir),
                             hide_bin=next(iter(submitting_bins(python)), ""))
    # oci: the bundle's config.json holds its mounts, cwd and devices (checked at preflight)
    return ContainerStep(box.runtime.value, (f"--container={box.image}",))


def _pyxis(box: ContainerConfig, image: str, mounts: list[Mount], workdir: str, gpus: bool) -> ContainerStep:
    """pyxis' srun options: mounts as one comma-separated list (its flags joined by `+`; `ro` is one)."""
    names = list(box.env) + ([] if gpus else [_NO_GPUS[0]])
    words = [f"--container-image={image}", f"--container-mounts={','.join(m.text() for m in mounts)}",
             f"--container-workdir={workdir}", "--no-container-mount-home"]
    if names:
        words.append(f"--container-env={','.join(names)}")
    return ContainerStep(box.runtime.value, tuple(words), env=() if gpus else (_NO_GPUS,))


def in_container(command: str) -> str:
    """The rank command with its interpreter (the submitting Python's path) replaced by the image's."""
    words = shlex.split(command)
    return " ".join(shlex.quote(word) for word in [CONTAINER_PYTHON, *words[1:]])


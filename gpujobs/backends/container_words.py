"""What every backend that runs ranks in a container says alike (torch-free): the same-path mounts, the
image's interpreter, and the argv of the runtimes that run both on Slurm and here (`apptainer exec`, `ch-run`).

The run dir (a sweep's dir for an array), the submit directory and the data store are mounted at their own
paths, so every path in the config, the ledger and the logs means the same inside and out. Each runtime's
words are the ones it documents (`apptainer exec --help`, `ch-run --help`); what only one backend says
(pyxis' and Slurm's srun options, podman's) stays in that backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from gpujobs.config.container import ContainerConfig, Mount
from gpujobs.config.load import JobConfig

#: The interpreter the ranks run inside: the image's, found on its PATH (the submitting Python's path means
#: nothing there). Debian-based images, NGC's and Apptainer's all have `python3`.
CONTAINER_PYTHON = "python3"
#: Where a system's own Python lives: its bin stays on PATH (srun and the Slurm commands are there too; an
#: image's python3 is found in the same places).
SYSTEM_BINS = frozenset({"/usr/bin", "/bin", "/usr/local/bin"})


def submitting_bins(python: str, virtual_env: Optional[str] = None) -> list[str]:
    """The bins of the submitting Python (`python`'s own, an active venv's) that a runtime passing PATH on
    (ch-run) must not search inside: their `python3` is a link to a host interpreter, or, mounted with the
    submit directory, a working one with host packages, and the image's must win. System bins stay."""
    bins = [str(Path(python).parent), *([str(Path(virtual_env) / "bin")] if virtual_env else [])]
    return sorted({path for path in bins if path not in SYSTEM_BINS})


def same_path_mounts(job: JobConfig, root: Path, submit_dir: Path) -> list[Mount]:
    """The mounts every containerized step has, each at its own path: the submit directory, `root` (the run
    dir, or a sweep's dir holding its points) and the data store where the data config has one; a path under
    one already mounted is left out (it is there), then `container.mounts` as given."""
    store: Optional[Any] = getattr(job.data, "store", None)
    paths = [submit_dir, root] + ([submit_dir / str(store)] if store else [])  # an absolute store stays itself
    kept: list[Path] = []
    for path in paths:
        if not any(path == seen or seen in path.parents for seen in kept):
            kept.append(path)
    return [Mount(str(p), str(p)) for p in kept] + job.container.parsed_mounts


def apptainer_words(box: ContainerConfig, mounts: Sequence[Mount], workdir: str, gpus: bool) -> tuple[str, ...]:
    """`apptainer exec [--nv] --bind H:C[:ro]... --pwd WORKDIR IMAGE`, before the command."""
    assert box.image is not None  # ContainerConfig refuses a runtime without one
    binds = [word for m in mounts for word in ("--bind", m.text())]
    return ("apptainer", "exec", *(["--nv"] if gpus else []), *binds, "--pwd", workdir, box.image)


def ch_run_words(box: ContainerConfig, mounts: Sequence[Mount], workdir: str,
                 options: Sequence[str] = ()) -> tuple[str, ...]:
    """`ch-run --bind=H:C... --cd=WORKDIR [options] IMAGE --`, before the command. ch-run keeps the caller's
    environment and execs the command (same pid); the GPU libraries are put in the image itself
    (`ch-fromhost --nvidia`)."""
    assert box.image is not None
    binds = [f"--bind={m.host}:{m.container}" for m in mounts]
    return ("ch-run", *binds, f"--cd={workdir}", *options, box.image, "--")


#: Runtimes that are options of Slurm's srun, not programs: they run only where srun starts the ranks.
SRUN_OPTIONS = {"pyxis": "srun's --container-image (the pyxis plugin)",
                "oci": "srun's --container (Slurm's oci.conf)"}

"""The `container` section: the image the ranks' step runs in, and what is mounted into it (torch-free).

`container=none|pyxis|apptainer|charliecloud|podman|oci` picks the runtime (`gpujobs.config.modes.Runtime`);
the keys below are checked here, when the config loads, so that every value that reaches `srun`'s line (and
the runtime's own parser of a mount list, which splits at `,` and `:`) is one it reads as written. What the
submit host can check beyond the config (an image file, a mount's host path) is `check_here`'s, at preflight.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Optional

from gpujobs.base.errors import ConfigError
from gpujobs.config.modes import Runtime
from gpujobs.config.validate import Checked, check_slurm_path

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Why no path that is mounted holds ',' or ':'.
_SPLIT = "the runtimes split a mount list at ',' and a mount at ':'"
MOUNT_TEXT = f"HOST:CONTAINER or HOST:CONTAINER:ro, CONTAINER an absolute path, neither holding ',' ({_SPLIT})"
#: Where each runtime's image may be a name (a registry reference, an image in the runtime's storage), not a
#: file: such an image is not checked here. Anything else names a file or directory the nodes read.
_URI = re.compile(r"[a-z][a-z0-9+.-]*://")
#: Why a container key is refused with container=none.
NO_RUNTIME = "nothing with container=none (pick a runtime: container=pyxis|apptainer|charliecloud|podman|oci)"


class Mount(NamedTuple):
    """One `container.mounts` entry, parsed: `host` at `container`, read-only or not."""

    host: str
    container: str
    read_only: bool = False

    def text(self) -> str:
        """`HOST:CONTAINER[:ro]`, as every runtime here writes a bind (pyxis, apptainer, podman)."""
        return f"{self.host}:{self.container}" + (":ro" if self.read_only else "")


def parse_mount(key: str, text: str) -> Mount:
    """`HOST:CONTAINER[:ro]` as a Mount, HOST made absolute (the ranks start elsewhere); ConfigError naming
    `key` for a relative CONTAINER, a `,`, a host path with `:`, or a flag other than `ro`."""
    parts = text.split(":")
    why = ("it holds ','" if "," in text else "a path holds ':', or the flag is not ro" if len(parts) > 2 and (
        len(parts) > 3 or parts[2] != "ro") else "" if len(parts) > 1 and all(parts[:2]) else "no HOST:CONTAINER")
    if why:
        raise ConfigError(key, text, f"{MOUNT_TEXT} ({why})")
    host, inside = parts[0], parts[1]
    if not inside.startswith("/"):
        raise ConfigError(key, text, f"{MOUNT_TEXT} (the container path {inside!r} is relative)")
    return Mount(str(Path(host).expanduser().absolute()), os.path.normpath(inside), len(parts) == 3)


def image_is_file(runtime: Runtime, image: str) -> bool:
    """Whether `image` names a file or directory (checked at preflight, made absolute), not a name the runtime
    resolves itself: a URI (`docker://`, `oras://`) never is; for pyxis a path starts with `/` or `.` (else it
    is an enroot reference such as `nvcr.io#nvidia/pytorch:24.05-py3`); for Charliecloud it holds a `/` (else
    it is a name in ch-image's storage); for Podman never (`localhost/rec:1` and `docker.io/library/debian`
    are names in its storage or a registry's); an apptainer image or an OCI bundle always is one."""
    if _URI.match(image) or runtime == Runtime.podman:
        return False
    if runtime == Runtime.pyxis:
        return image.startswith(("/", "."))
    if runtime == Runtime.charliecloud:
        return "/" in image
    return runtime in (Runtime.apptainer, Runtime.oci)


@dataclass
class ContainerConfig(Checked):
    """The container the ranks run in (`container=none|pyxis|apptainer|charliecloud|podman|oci`). The supervisor
    stays outside; the run dir, the submit directory and the data store are mounted at their own paths."""

    runtime: Runtime = Runtime.none
    """none (the Python that submitted) | pyxis (srun --container-image) | apptainer (apptainer exec) |
    charliecloud (ch-run) | podman | oci (Slurm's srun --container with the site's oci.conf)."""
    image: Optional[str] = None
    """The image: an enroot URI or squashfs file (pyxis), a .sif file or URI (apptainer), an image directory,
    squashfs file or storage name (charliecloud), a name in podman's storage or a registry's (podman), an OCI
    bundle directory (oci), an OCI image reference the nodes pull (cluster=kubernetes, with no runtime: the
    kubelet runs it). Required unless none; a file is made absolute at submit and must be readable there (the
    nodes read it through shared storage)."""
    mounts: list[str] = field(default_factory=list)
    """More bind mounts, `HOST:CONTAINER` or `HOST:CONTAINER:ro` (HOST made absolute at submit, and it must
    exist; CONTAINER absolute; no `,`). oci: none (its bundle's config.json holds the mounts)."""
    workdir: Optional[str] = None
    """The ranks' working directory inside (absolute; null: the submit directory, mounted at its own path)."""
    env: list[str] = field(default_factory=list)
    """Names of variables whose values outside the ranks see inside, over the image's own (pyxis:
    --container-env; apptainer: APPTAINERENV_NAME; charliecloud and oci pass the whole environment)."""
    gpus: Optional[bool] = None
    """The GPUs in the container (apptainer --nv; pyxis: enroot's GPU hook). null: on when the job has GPUs."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.runtime == Runtime.none:
            self._check_unused()
            return
        if not self.image:
            raise ConfigError("image", self.image, f"an image for container={self.runtime} (required)")
        check_slurm_path("image", self.image, slurm=True)  # it reaches srun's line, %-expanding plugins included
        if image_is_file(self.runtime, self.image):
            self.image = str(Path(self.image).expanduser().absolute())
        for index, text in enumerate(self.mounts):
            check_slurm_path(f"mounts[{index}]", text, slurm=True)
            self.mounts[index] = parse_mount(f"mounts[{index}]", text).text()
        if self.workdir is not None:
            check_slurm_path("workdir", self.workdir, slurm=True)
            if not self.workdir.startswith("/") or "," in self.workdir:
                raise ConfigError("workdir", self.workdir, "an absolute path inside the container, or null")
        for name in self.env:
            if not _ENV_NAME.fullmatch(name):
                raise ConfigError("env", name, "names of environment variables ([A-Za-z_][A-Za-z0-9_]*)")
        if self.runtime == Runtime.oci and (self.mounts or self.workdir is not None):
            key, value = ("mounts", self.mounts) if self.mounts else ("workdir", self.workdir)
            raise ConfigError(key, value, "none with container=oci (srun --container runs the bundle as its "
                                          "config.json says: its mounts and process.cwd)")
        if self.runtime == Runtime.charliecloud and any(m.endswith(":ro") for m in self.mounts):
            raise ConfigError("mounts", self.mounts, "read-write mounts with container=charliecloud (ch-run -b "
                                                     "has no read-only flag)")

    def _check_unused(self) -> None:
        """With container=none a value set here would be silently ignored: refused instead. The image alone is
        `JobConfig`'s to judge: cluster=kubernetes takes it with no runtime (the kubelet runs it)."""
        for key, value in (("mounts", self.mounts), ("workdir", self.workdir), ("env", self.env),
                           ("gpus", self.gpus)):
            if value:
                raise ConfigError(key, value, NO_RUNTIME)

    @property
    def parsed_mounts(self) -> list[Mount]:
        """`mounts` as Mount objects (already checked)."""
        return [parse_mount(f"container.mounts[{i}]", text) for i, text in enumerate(self.mounts)]

    def check_mounted_path(self, key: str, path: object) -> None:
        """Refuse (ConfigError on `key`, a full key) a path that the ranks' container mounts at its own path (the
        run or sweep dir, the data store, the submit directory) when it holds ':' or ',', as `mounts` are
        refused; with container=none nothing is mounted, and any path passes."""
        text = str(path)
        if self.runtime != Runtime.none and (":" in text or "," in text):
            raise ConfigError(key, text, f"a path without ':' or ',' with container={self.runtime} (it is mounted "
                                         f"into the container at its own path, and {_SPLIT})")

    def gpus_on(self, gpus_per_node: int) -> bool:
        """Whether the ranks see the node's GPUs: `gpus`, or, where null, whether the job has any."""
        return self.gpus if self.gpus is not None else gpus_per_node > 0

    def check_here(self, shared: Sequence[Path] = ()) -> None:
        """Submit side: refuse an image file that is missing or unreadable and a mount whose host path is missing
        (ConfigError naming the key, before anything is written). The nodes read both through storage they share
        with this host; a name the runtime resolves (a registry reference) is not checked. An OCI bundle must
        mount each of the `shared` paths (the submit directory, the data store) at its own path."""
        if self.runtime == Runtime.none:
            return
        if self.image is not None and image_is_file(self.runtime, self.image):
            _check_readable("container.image", self.image, oci=self.runtime == Runtime.oci)
            if self.runtime == Runtime.oci:
                _check_bundle_mounts(self.image, shared)
        for index, mount in enumerate(self.parsed_mounts):
            if not os.path.exists(mount.host):
                raise ConfigError(f"container.mounts[{index}]", self.mounts[index],
                                  f"a mount whose host path exists ({mount.host} does not)")


def _check_readable(key: str, image: str, *, oci: bool) -> None:
    """An image file or directory this user can read (an OCI bundle: a directory holding config.json)."""
    path = Path(image)
    wanted = "an OCI bundle directory holding a readable config.json" if oci else "an image file or directory"
    if not path.exists():
        raise ConfigError(key, image, f"{wanted} that exists ({image} does not)")
    target = path / "config.json" if oci else path
    if not os.access(target, os.R_OK) or (path.is_dir() and not os.access(path, os.R_OK | os.X_OK)):
        raise ConfigError(key, image, f"{wanted} this user can read ({target} is not readable)")


def _check_bundle_mounts(bundle: str, shared: Sequence[Path]) -> None:
    """Each of `shared` lies under a bind mount of the bundle's config.json whose source is its destination:
    Slurm's srun --container adds no mounts of its own, so a path the job records would mean nothing inside."""
    key, config = "container.image", Path(bundle) / "config.json"
    try:
        spec = json.loads(config.read_text())
        same = [Path(m["source"]) for m in spec.get("mounts", []) if m.get("source") == m.get("destination")]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        raise ConfigError(key, bundle, f"an OCI bundle whose config.json reads as one ({err})") from None
    for path in shared:
        if not any(path == m or m in path.parents for m in same):
            raise ConfigError(key, bundle, f"an OCI bundle whose config.json mounts {path} at its own path "
                                           "(a bind mount whose source is its destination, or a directory above it)")

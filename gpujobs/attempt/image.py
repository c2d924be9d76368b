"""The image an attempt's ranks ran in, as its ledger line names it (torch-free).

Every line of a job with a container names `image` (`container.image` as configured). Where the runtime
tells which image that name stood for when the attempt started, the line also holds it: Podman's image ID
(`image_id`, `sha256:...`: the digest of the image's config, which an image imported from a tarball has too,
where it has no registry digest). Apptainer's `.sif`, Charliecloud's directory, enroot's squashfs and an OCI
bundle have no identity their runtime reports short of reading the whole image: their lines hold the name only.

The ID is resolved once per attempt, outside the container, by what starts the ranks (the local launcher:
`export_image_id`, before each attempt), never on the submit path; it reaches the ranks in their environment
(`IMAGE_ID_ENV`), so rank 0 inside and the launcher outside write the same fields (`image_fields`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

from gpujobs.config.container import ContainerConfig
from gpujobs.config.modes import Runtime

#: The image ID of the attempt running now, set by its launcher for itself and its ranks.
IMAGE_ID_ENV = "GPUJOBS_IMAGE_ID"
#: `podman image inspect` reads the local image store: well under a second unless the store is locked.
_INSPECT_TIMEOUT_S = 30.0


def image_fields(container: ContainerConfig) -> dict[str, str]:
    """An attempt line's image fields for a job with `container`: none without one; `image`, and
    `image_id` where the launcher resolved one for this attempt (Podman)."""
    if not container.image:  # a runtime's, or (cluster=kubernetes) the pods' image, run by the kubelet
        return {}
    fields = {"image": container.image}
    # only Podman's launcher sets it: any other job ignores a value left in the environment it was submitted from
    image_id = os.environ.get(IMAGE_ID_ENV) if container.runtime == Runtime.podman else None
    if image_id:
        fields["image_id"] = image_id
    return fields


def podman_image_id(image: str) -> Optional[str]:
    """The ID (`sha256:...`) of the image that `image` names in Podman's store now, or None when Podman
    cannot say (said in one line on stderr: the attempt runs anyway, its line without the ID)."""
    command = ["podman", "image", "inspect", "--format", "{{.Id}}", image]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=_INSPECT_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        why = f"it did not answer within {_INSPECT_TIMEOUT_S:g} s" if isinstance(err, subprocess.TimeoutExpired) \
            else f"it could not run: {err.strerror or err}"
        print(f"gpujobs: the image ID of {image} is not recorded: {why}", file=sys.stderr, flush=True)
        return None
    found = proc.stdout.strip()
    if proc.returncode != 0 or not found:
        said = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        print(f"gpujobs: the image ID of {image} is not recorded: podman image inspect: {said}",
              file=sys.stderr, flush=True)
        return None
    return found if found.startswith("sha256:") else f"sha256:{found}"


def export_image_id(container: ContainerConfig) -> Optional[str]:
    """Launcher, before each attempt: resolve the image ID where the runtime reports one (Podman) and set
    it in this process's environment (`IMAGE_ID_ENV`), which its ranks inherit; returns it. Any other
    runtime, or an ID Podman cannot give, leaves the variable unset (an earlier attempt's is removed)."""
    image_id = None
    if container.runtime == Runtime.podman and container.image:
        image_id = podman_image_id(container.image)
    if image_id is None:
        os.environ.pop(IMAGE_ID_ENV, None)
    else:
        os.environ[IMAGE_ID_ENV] = image_id
    return image_id

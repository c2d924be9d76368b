"""Where gpujobs' own files lie: the Hydra config tree (`conf/`) and the sbatch templates.

Both live at the top of the repository, where users edit them. A source checkout or an editable
install reads them there; a wheel carries copies inside this package (`gpujobs/_conf`,
`gpujobs/_sbatch_templates`, see `force-include` in pyproject.toml), so an installed gpujobs works
from any directory. An environment variable points either one at a tree of the user's own.
"""

from __future__ import annotations

import os
from pathlib import Path

#: This package's directory; the repository's root is its parent in a checkout.
_PACKAGE = Path(__file__).resolve().parent.parent

CONFIG_DIR_ENV = "GPUJOBS_CONFIG_DIR"
TEMPLATE_DIR_ENV = "GPUJOBS_SBATCH_TEMPLATES"


def _locate(env: str, packaged: str, top_level: str) -> Path:
    override = os.environ.get(env)
    if override:
        return Path(override)
    # The packaged copy first: in an installed wheel the package's parent is site-packages, where a
    # top-level `conf/` would be some other project's. A checkout never has the packaged copy.
    inside = _PACKAGE / packaged
    return inside if inside.is_dir() else _PACKAGE.parent / top_level


def config_dir() -> Path:
    """The Hydra primary config directory: `$GPUJOBS_CONFIG_DIR`, else the packaged or the checkout's `conf/`.

    A directory that does not exist is reported by Hydra, which names it.
    """
    return _locate(CONFIG_DIR_ENV, "_conf", "conf")


def template_dir() -> Path:
    """The sbatch templates: `$GPUJOBS_SBATCH_TEMPLATES`, else the packaged or the checkout's `sbatch_templates/`."""
    return _locate(TEMPLATE_DIR_ENV, "_sbatch_templates", "sbatch_templates")

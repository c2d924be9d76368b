"""Who besides its owner may change a directory: the one rule that run dirs and shared folders are held to."""

from __future__ import annotations

import stat


def open_to_others(mode: int) -> bool:
    """Whether a directory of `mode` lets users other than its owner replace its entries: writable by group
    or others without the sticky bit (with it, only an entry's owner may rename or remove it)."""
    return bool(mode & (stat.S_IWGRP | stat.S_IWOTH)) and not mode & stat.S_ISVTX

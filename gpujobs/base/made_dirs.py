"""The directories a command made, so that one that is refused (or only prints) can take them back.

Hydra makes the run dir, and every missing directory above it (`outputs/`, `outputs/rec/`, a Kubernetes
volume's mount path), before the task sees the config; a refused submit must leave none of them. Which of
them existed before cannot be told afterwards (a directory keeps no birth time that Python reads), so they
are recorded as they are made: `os.mkdir` is wrapped while a `MadeDirs` is entered (`Path.mkdir` and
`os.makedirs` both call it).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Optional


class MadeDirs:
    """A context manager recording every directory `os.mkdir` makes in this process while it is entered."""

    def __init__(self) -> None:
        self.made: list[Path] = []
        self._mkdir: Optional[Any] = None

    def __enter__(self) -> MadeDirs:
        self._mkdir = mkdir = os.mkdir

        def recording_mkdir(path: Any, mode: int = 0o777, *, dir_fd: Optional[int] = None) -> None:
            mkdir(path, mode, dir_fd=dir_fd)
            if dir_fd is None:  # a path relative to another directory's fd is not one this module undoes
                self.made.append(Path(os.fsdecode(path)).absolute())

        os.mkdir = recording_mkdir
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mkdir is not None:
            os.mkdir = self._mkdir
            self._mkdir = None

    def remove_empty(self) -> None:
        """Remove the recorded directories that are still empty, deepest first (a parent emptied by its
        child's removal goes too); one that holds anything, or is not this user's, stays."""
        for path in sorted(set(self.made), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):  # not empty, gone already, or not ours to remove
                if path.stat().st_uid == os.geteuid():
                    path.rmdir()

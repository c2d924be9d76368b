"""A Prometheus file_sd target for a run's endpoint, and its withdrawal once the ranks are gone (torch-free).

Rank 0's exporter (`gpujobs.rank.observe.prometheus`) announces its endpoint with `FileSdTarget`; the
supervisor beside the ranks (the local launcher, the Slurm batch step) calls `withdraw_left_target`
once an attempt's ranks are gone, for a target that a killed rank 0 could not withdraw.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any, Optional

from gpujobs.rundir import PROMETHEUS_FILE
from gpujobs.rundir.trust import read_own

log = logging.getLogger(__name__)


class FileSdTarget:
    """The endpoint as a Prometheus file_sd target: `<sd_dir>/gpujobs-<job>-<run dir hash>.json`.

    The directory may be shared by many users' jobs, so nothing here trusts a name in it: the file is
    written under a fresh random name (`mkstemp`: O_CREAT | O_EXCL | O_NOFOLLOW, so a planted file or
    symlink is never opened), made 0644 for the Prometheus user to read, fsynced, then renamed over
    the target name, which replaces whatever is there (a symlink included) without following it. A
    requeued attempt of the same run writes the same name. Where another user's file holds that name in
    a sticky shared directory (the rename is refused), the target takes a random name instead, so a
    squatter cannot keep the job from being found. `remove` unlinks the file only if it is still the
    one written here. A failure is logged and the job carries on without a target.
    """

    def __init__(self, sd_dir: Path, job_name: str, run_dir: Path) -> None:
        digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
        # the job name is checked at submit (letters, digits, _.-): safe in a file name
        self.path = Path(sd_dir) / f"gpujobs-{job_name}-{digest}.json"
        self._written: Optional[tuple[int, int]] = None  # (st_dev, st_ino) of the file this process wrote

    def write(self, address: str, labels: dict[str, str]) -> bool:
        """Announce `address` ("host:port") with `labels` (empty values left out); False if it could not."""
        entry = [{"targets": [address], "labels": {k: v for k, v in sorted(labels.items()) if v}}]
        tmp = None
        try:
            # not *.json: a Prometheus globbing the directory never reads a half-written file
            fd, tmp = tempfile.mkstemp(prefix=".gpujobs-", suffix=".tmp", dir=self.path.parent)
            with os.fdopen(fd, "w") as handle:
                os.fchmod(fd, 0o644)  # mkstemp makes 0600; the umask plays no part in fchmod
                handle.write(json.dumps(entry, indent=2) + "\n")
                handle.flush()
                os.fsync(fd)
                info = os.fstat(fd)
            try:
                os.replace(tmp, self.path)
            except PermissionError:  # a sticky shared dir, where another user's file holds the name
                self._take_another_name()
                os.replace(tmp, self.path)
            tmp = None
        except OSError as err:
            log.warning("could not write the Prometheus file_sd target %s (%s): a site Prometheus will not "
                        "find this job", self.path, err)
            return False
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        self._written = (info.st_dev, info.st_ino)
        log.info("Prometheus file_sd target %s: %s", self.path, address)
        return True

    def _take_another_name(self) -> None:
        """Announce under a random name instead: nobody can have made it first (a squatter is logged)."""
        with contextlib.suppress(OSError):
            log.warning("%s belongs to uid %d, not to this job: announcing the target under another name",
                        self.path, os.lstat(self.path).st_uid)
        self.path = self.path.with_name(f"{self.path.stem}-{secrets.token_hex(8)}.json")

    def identity(self) -> dict[str, Any]:
        """The file written here: its path and (st_dev, st_ino)."""
        dev, ino = self._written if self._written is not None else (None, None)
        return {"path": str(self.path), "dev": dev, "ino": ino}

    def remove(self) -> None:
        """Withdraw the target, unless the file is no longer the one written here (then leave it, logged)."""
        if self._written is None:
            return
        try:
            info = os.lstat(self.path)
            if (info.st_dev, info.st_ino) != self._written:
                log.warning("%s was replaced by someone else: left in place", self.path)
            else:
                os.unlink(self.path)
        except FileNotFoundError:
            log.warning("the Prometheus file_sd target %s was already gone", self.path)
        except OSError as err:
            log.warning("could not remove the Prometheus file_sd target %s: %s", self.path, err)
        self._written = None


def _names(path: Path, run_dir: Path) -> bool:
    """Whether `path` is a file_sd target that `FileSdTarget.write` wrote for `run_dir`."""
    try:
        entries = json.loads(read_own(path))
        return [entry["labels"]["run_dir"] for entry in entries] == [str(Path(run_dir).resolve())]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def withdraw_left_target(run_dir: Path) -> None:
    """The supervisor, once an attempt's ranks are gone: withdraw the file_sd target its rank 0 announced and
    could not withdraw (killed for a hang, or with its launcher), so that no alert fires for a job that is
    over and no later endpoint on that port is scraped under this run's labels. Only the very file rank 0
    wrote (prometheus.json says which), owned by this user: a requeued attempt's new file stays. What
    prometheus.json says is not enough (whoever could write the run dir once could have planted it to name
    any file): the file must also be a target that names this run dir, as no file but this run's does."""
    try:
        target = json.loads(read_own(Path(run_dir) / PROMETHEUS_FILE))["sd_target"]
        path, written = Path(target["path"]), (int(target["dev"]), int(target["ino"]))
    except (OSError, ValueError, KeyError, TypeError):
        return  # no endpoint, or no target announced
    try:
        info = os.lstat(path)
        if (info.st_dev, info.st_ino) != written or info.st_uid != os.getuid() or not _names(path, run_dir):
            return
        os.unlink(path)
    except OSError:
        return  # withdrawn by rank 0 (the usual end), or not ours to remove
    log.warning("withdrew the Prometheus file_sd target %s that the attempt's rank 0 left behind", path)

"""Where the job's numbers go: `metrics.jsonl` in the run dir (rank 0 only) and the log."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Optional

import torch

from gpujobs.base.atomic import JsonlAppender
from gpujobs.rundir.records import MetricsRecord, metrics_line


class MetricsLog:
    """Appends one JSON object per line, each written at once so followers see it (`atomic.JsonlAppender`:
    a line torn by an earlier attempt's crash is ended at open, a link in the file's place refused)."""

    def __init__(self, path: Optional[Path]) -> None:
        self.path = path
        # held open for the whole run (one line per log step); closed by `close`
        self._out = JsonlAppender(path) if path is not None else None

    def write(self, record: MetricsRecord) -> None:
        """Append `record`'s line, stamped with the wall-clock time (no-op on ranks other than 0)."""
        if self._out is None:
            return
        self._out.append([{**metrics_line(record), "time": round(time.time(), 3)}])

    def close(self) -> None:
        """Close the file."""
        if self._out is not None:
            self._out.close()
            self._out = None


def param_digest(model: torch.nn.Module) -> str:
    """sha256 over the parameters, names sorted, raw bytes: a reproducibility fingerprint."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()

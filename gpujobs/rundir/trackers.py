"""tracker.json: which tracker run a run dir logs to, for its whole life (torch-free; both sides use it).

The first attempt that opens a tracker records its run here (the MLflow run id, the TensorBoard log dir);
every later attempt of the run dir (a Slurm requeue, a local restart, a resubmission) reads it and continues
that run. A sweep's submit side writes it first, for each point, with the child run it created under the
sweep's parent run. Written atomically (temp file + fsync + rename); a file that cannot be read counts as
none (the attempt logs a warning and opens a new tracker run).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gpujobs.base.atomic import write_json_atomic
from gpujobs.rundir import TRACKER_FILE
from gpujobs.rundir.lines import from_line, to_line

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MlflowRun:
    """The MLflow run a run dir logs to."""

    tracking_uri: str
    experiment_id: str
    run_id: str
    parent_run_id: Optional[str] = None
    """The sweep's parent run, when the run dir is a sweep point."""


@dataclass(frozen=True)
class TrackerState:
    """What tracker.json holds: one entry per tracker that was ever opened for the run dir."""

    mlflow: Optional[MlflowRun] = None
    tensorboard_log_dir: Optional[str] = None

    def to_json(self) -> dict[str, Any]:
        """The file's content."""
        out: dict[str, Any] = {}
        if self.mlflow is not None:
            out["mlflow"] = to_line(self.mlflow, drop_empty=True)
        if self.tensorboard_log_dir is not None:
            out["tensorboard"] = {"log_dir": self.tensorboard_log_dir}
        return out


def read_state(run_dir: Path) -> TrackerState:
    """The run dir's tracker.json (an empty state when there is none or it cannot be read)."""
    path = run_dir / TRACKER_FILE
    try:
        values = json.loads(path.read_text())
    except FileNotFoundError:
        return TrackerState()
    except (OSError, ValueError) as err:
        log.warning("%s cannot be read (%s): the trackers open new runs", path, err)
        return TrackerState()
    mlflow, board = values.get("mlflow"), values.get("tensorboard")
    run = from_line(MlflowRun, mlflow)
    if mlflow is not None and run is None:
        log.warning("%s: its MLflow entry is no run (a field missing or not text): a new MLflow run is opened",
                    path)
    log_dir = str(board["log_dir"]) if isinstance(board, dict) and board.get("log_dir") else None
    return TrackerState(run, log_dir)


def write_state(run_dir: Path, state: TrackerState) -> None:
    """Replace the run dir's tracker.json atomically."""
    write_json_atomic(run_dir / TRACKER_FILE, state.to_json())

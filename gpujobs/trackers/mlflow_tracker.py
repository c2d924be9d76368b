"""MLflow: one MLflow run per run dir, continued by every attempt (torch-free: the sweep's submit side uses it too).

The run id lives in tracker.json. MLflow cannot delete a metric point, so an attempt never logs a step the run
already holds: it asks the run, per kind of record (train, eval), for the last step logged (the history of one
series, `SENTINEL`, sent after the rest of each record, so its point means the whole record is in), skips the
records at or below it and logs, from metrics.jsonl, those of earlier attempts that never reached MLflow. After
a crash the steps past the checkpoint are trained again; the points the crashed attempt logged for them stay
(see `gpujobs.rank.observe.trackers` for why that, and not buffering until a checkpoint).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from gpujobs.config.load import JobConfig
from gpujobs.rundir.trackers import MlflowRun, TrackerState, read_state, write_state
from gpujobs.trackers.series import StepRecord, clean_name, flat_config, values_of

log = logging.getLogger(__name__)

#: The series each kind of record logs last (an eval record: its first metric, in name order).
SENTINEL = {"train": "train/loss"}
#: An attempt's end as MLflow states it (a stopped attempt is followed by another, which sets RUNNING again).
STATUS = {"completed": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
#: MLflow's longest param value.
_MAX_PARAM = 6000


def client_for(tracking_uri: str) -> Any:
    """An MlflowClient of `tracking_uri` (mlflow is imported here, not before: it takes a second or two)."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def experiment_id(client: Any, name: str) -> str:
    """The id of experiment `name`, created if it does not exist (another job may create it meanwhile)."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    try:
        return str(client.create_experiment(name))
    except MlflowException:
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)


def log_params(client: Any, run_id: str, params: dict[str, Any]) -> None:
    """Log the params the run does not hold yet (MLflow refuses to change one; a resumed run has them)."""
    from mlflow.entities import Param

    held = client.get_run(run_id).data.params
    new = [Param(name, str(value)[:_MAX_PARAM]) for name, value in ((clean_name(k), v) for k, v in params.items())
           if name not in held]
    if new:
        client.log_batch(run_id, params=new)


def run_name(job: JobConfig, run_dir: Path) -> str:
    """`<job name> <run dir name>`: the run dir's timestamp (or a sweep point's number) tells runs apart."""
    return f"{job.name} {run_dir.name}"


class MlflowTracker:
    """Rank 0's MLflow run for one attempt; every call comes from the trackers' worker thread."""

    name = "mlflow"

    def __init__(self, job: JobConfig, run_dir: Path) -> None:
        assert job.logger.mlflow is not None and job.logger.mlflow.tracking_uri is not None
        self.job = job
        self.run_dir = run_dir
        self.cfg = job.logger.mlflow
        self.client: Any = None
        self.run: Optional[MlflowRun] = None
        self._logged: dict[str, int] = {}
        """Kind -> the last step the run holds (asked once per kind, then kept)."""
        self.skipped = 0
        """Records not logged because the run already held their step."""

    def start(self) -> None:
        """Continue the run dir's MLflow run (or create it), mark it running and log the config as params."""
        uri = str(self.cfg.tracking_uri)
        self.client = client_for(uri)
        state = read_state(self.run_dir)
        self.run = self._continued(state, uri) or self._created(state, uri)
        self.client.update_run(self.run.run_id, status="RUNNING")
        log_params(self.client, self.run.run_id, flat_config(self.job.to_dict()))

    def open(self, first_step: int, replay: Sequence[StepRecord]) -> None:
        """Log the records of earlier attempts below `first_step` that the run lacks."""
        assert self.run is not None
        self.log([(record, {}) for record in replay])
        log.info("MLflow: run %s in %s from step %d (%d records replayed from metrics.jsonl)", self.run.run_id,
                 self.cfg.tracking_uri, first_step, len(replay) - self.skipped)
        self.skipped = 0

    def _continued(self, state: TrackerState, uri: str) -> Optional[MlflowRun]:
        from mlflow.exceptions import MlflowException

        known = state.mlflow
        if known is None:
            return None
        if known.tracking_uri != uri:
            log.warning("MLflow: tracker.json's run %s is in %s, the config now names %s: a new run there",
                        known.run_id, known.tracking_uri, uri)
            return None
        try:
            self.client.get_run(known.run_id)
        except MlflowException as err:
            log.warning("MLflow: tracker.json's run %s is not in %s (%s): a new run", known.run_id, uri, err)
            return None
        return known

    def _created(self, state: TrackerState, uri: str) -> MlflowRun:
        experiment = experiment_id(self.client, self.cfg.experiment or self.job.name)
        tags = {"gpujobs.run_dir": str(self.run_dir.absolute())}
        created = self.client.create_run(experiment, run_name=run_name(self.job, self.run_dir), tags=tags)
        run = MlflowRun(uri, experiment, created.info.run_id)
        write_state(self.run_dir, TrackerState(run, state.tensorboard_log_dir))
        return run

    def _last_logged(self, kind: str, sentinel: str) -> int:
        if kind not in self._logged:
            assert self.run is not None
            steps = [metric.step for metric in self.client.get_metric_history(self.run.run_id, sentinel)]
            self._logged[kind] = max(steps, default=-1)
        return self._logged[kind]

    def log(self, batch: Sequence[tuple[StepRecord, dict[str, float]]]) -> None:
        """The records (and GPU readings) at their steps in one request, but none whose step the run holds."""
        from mlflow.entities import Metric

        assert self.run is not None
        metrics: list[Any] = []
        logged: dict[str, int] = {}  # kind -> its last step in this batch
        for record, gpu in batch:
            kind, values = record.kind, values_of(record)
            sentinel = SENTINEL.get(kind) or min(values, default="")
            if not values or record.step <= (logged[kind] if kind in logged else self._last_logged(kind, sentinel)):
                self.skipped += 1
                continue
            stamp = int((record.time or time.time()) * 1000)
            series = {**gpu, **{k: v for k, v in values.items() if k != sentinel}, sentinel: values[sentinel]}
            # in order: MLflow splits a long batch, and each record's sentinel comes after the rest of it
            metrics += [Metric(key, value, stamp, record.step) for key, value in series.items()]
            logged[kind] = record.step
        if not metrics:
            return
        try:
            self.client.log_batch(self.run.run_id, metrics=metrics)
        except Exception:
            # part of it may be in: ask the run again next time (a point sent again, with its own time and
            # value, is one the store already holds, which a database store keeps once)
            self._logged.clear()
            raise
        self._logged.update(logged)

    def close(self, status: str) -> None:
        """Mark the run FINISHED, KILLED (stopped: another attempt follows) or FAILED."""
        if self.run is not None:
            self.client.set_terminated(self.run.run_id, status=STATUS[status])

"""A sweep's MLflow runs, made on the submit side before any point starts (torch-free).

One parent run per sweep (per tracking URI and experiment its points name, which is one in practice), and one
child run per point with the point's overrides as params (`optim.lr=0.01` -> param `optim.lr` = `0.01`, as
typed). Each point's child goes into its run dir's tracker.json, so the point's job continues that run as any
attempt continues its run dir's. The parent is recorded in the sweep dir's tracker.json. A point whose run dir
already has a run (a sweep dir used again) keeps it. The parent ends when the submit side is done: FINISHED if
every point was queued or ran, FAILED if not. TensorBoard needs nothing here: each point's log dir is under the
sweep dir, with its hparams (`tensorboard --logdir SWEEP_DIR`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpujobs.base.errors import SubmitError
from gpujobs.config.load import JobConfig
from gpujobs.rundir.trackers import MlflowRun, TrackerState, read_state, write_state
from gpujobs.trackers.mlflow_tracker import client_for, experiment_id, log_params, run_name
from gpujobs.trackers.series import clean_name

log = logging.getLogger(__name__)

#: MLflow's HTTP settings while the submit side makes the sweep's runs, where the user set neither: one retry
#: and 5 s a request, so a tracking server that is down or mistyped is refused in seconds, not after MLflow's
#: default 7 retries with backoff (about 4 minutes). The job side keeps MLflow's defaults: its tracker waits in
#: a thread of its own (`gpujobs.rank.observe.trackers`), never holding a rank or a user at a prompt.
SUBMIT_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


@contextlib.contextmanager
def _bounded_requests() -> Iterator[None]:
    """`SUBMIT_HTTP_ENV` for the requests made within (MLflow reads both variables at each request), then the
    environment as it was, so a local point's job, started afterwards, inherits none of it."""
    unset = [name for name in SUBMIT_HTTP_ENV if name not in os.environ]
    os.environ.update({name: SUBMIT_HTTP_ENV[name] for name in unset})
    try:
        yield
    finally:
        for name in unset:
            os.environ.pop(name, None)


def override_params(overrides: Sequence[str]) -> dict[str, str]:
    """A point's overrides as params: key without Hydra's `+`/`++`/`~`, value as typed."""
    params = {}
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep:
            params[clean_name(key.lstrip("+~"))] = value
    return params


@dataclass
class SweepPoint:
    """What the submit side knows of one point."""

    num: int
    overrides: list[str]
    job: JobConfig
    run_dir: Path


@dataclass
class SweepRuns:
    """The parent runs of a sweep (none when no point logs to MLflow)."""

    parents: list[tuple[Any, str]] = field(default_factory=list)
    """(client, parent run id) each."""

    @classmethod
    def open(cls, sweep_dir: Path, points: Sequence[SweepPoint]) -> SweepRuns:
        """Create the parent and the points' children (points with `logger=mlflow` only)."""
        groups: dict[tuple[str, str], list[SweepPoint]] = {}
        for point in points:
            cfg = point.job.logger.mlflow
            if cfg is not None and cfg.tracking_uri is not None:
                groups.setdefault((cfg.tracking_uri, cfg.experiment or point.job.name), []).append(point)
        runs = cls()
        for (uri, experiment), members in groups.items():
            try:
                with _bounded_requests():
                    client = client_for(uri)
                    parent = _parent(client, uri, experiment, sweep_dir, members[0].job)
                    runs.parents.append((client, parent.run_id))
                    for point in members:
                        _child(client, parent, point)
            except Exception as err:  # the store or the server refused: nothing is queued without its runs
                runs.end(ok=False)
                text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise SubmitError(f"MLflow at {uri} could not take the sweep's runs: {text}") from None
            log.info("MLflow: sweep run %s in %s, %d points", parent.run_id, uri, len(members))
        return runs

    def end(self, ok: bool) -> None:
        """The submit side is done with the sweep."""
        for client, run_id in self.parents:
            try:
                with _bounded_requests():
                    client.set_terminated(run_id, status="FINISHED" if ok else "FAILED")
            except Exception as err:  # the points are queued or done whatever the parent's status says
                log.warning("MLflow: could not end the sweep run %s (%s: %s)", run_id, type(err).__name__, err)


def _parent(client: Any, uri: str, experiment: str, sweep_dir: Path, job: JobConfig) -> MlflowRun:
    state = read_state(sweep_dir)
    known = state.mlflow
    if known is not None and known.tracking_uri == uri:
        client.update_run(known.run_id, status="RUNNING")
        return known
    exp = experiment_id(client, experiment)
    tags = {"gpujobs.sweep_dir": str(sweep_dir.absolute())}
    created = client.create_run(exp, run_name=f"{job.name} sweep {sweep_dir.name}", tags=tags)
    parent = MlflowRun(uri, exp, created.info.run_id)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    write_state(sweep_dir, TrackerState(parent, state.tensorboard_log_dir))
    return parent


def _child(client: Any, parent: MlflowRun, point: SweepPoint) -> None:
    state = read_state(point.run_dir)
    if state.mlflow is not None and state.mlflow.tracking_uri == parent.tracking_uri:
        return  # the point's run dir continues its own run
    tags = {"mlflow.parentRunId": parent.run_id, "gpujobs.run_dir": str(point.run_dir.absolute()),
            "gpujobs.overrides": " ".join(point.overrides)}
    created = client.create_run(parent.experiment_id, run_name=run_name(point.job, point.run_dir), tags=tags)
    log_params(client, created.info.run_id, override_params(point.overrides))
    client.update_run(created.info.run_id, status="SCHEDULED")  # RUNNING once its job starts
    point.run_dir.mkdir(parents=True, exist_ok=True)
    child = MlflowRun(parent.tracking_uri, parent.experiment_id, created.info.run_id, parent.run_id)
    write_state(point.run_dir, TrackerState(child, state.tensorboard_log_dir))

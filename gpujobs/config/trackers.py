"""The experiment trackers' schemas (`logger=none|tensorboard|mlflow`): declared like every section
of `gpujobs.config.schema`, which builds `JobConfig.logger` from them (torch-free, and the trackers' packages
are never imported here: `LoggerConfig.check_here` only looks for them)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from gpujobs.base.errors import ConfigError
from gpujobs.config.modes import Tracker
from gpujobs.config.validate import Checked, bounds

#: MLflow tracking URIs gpujobs accepts, by scheme (`postgresql+psycopg2://` counts as postgresql): a tracking
#: server, and MLflow's own stores. A bare path would be MLflow's retired file store, and sqlite's in-memory
#: database would give every process its own.
_MLFLOW_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "file", "databricks")
#: Schemes whose store MLflow reaches through SQLAlchemy (and alembic's migrations), as a tracking server does.
MLFLOW_DB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
_MLFLOW_URI_TEXT = ("an http(s):// tracking server, sqlite:///PATH.db, a postgresql://, mysql:// or mssql:// "
                    "database, file:///PATH or databricks")


def mlflow_scheme(uri: str) -> str:
    """The store kind of an MLflow tracking URI: `sqlite`, `http`, `postgresql` (for `postgresql+psycopg2`), ..."""
    return uri.partition(":")[0].partition("+")[0].lower() if ":" in uri else ""


def _is_tracking_uri(value: Any) -> bool:
    if not isinstance(value, str) or mlflow_scheme(value) not in _MLFLOW_SCHEMES:
        return False
    if mlflow_scheme(value) == "sqlite":
        return value.startswith("sqlite:///") and len(value) > len("sqlite:///")
    return True


def _absolute_uri(uri: str) -> str:
    """A relative sqlite or file path made absolute here (at submit): the ranks may start elsewhere."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return f"sqlite:///{Path(uri[len('sqlite:///'):]).absolute()}"
    if uri.startswith("file:") and not uri.startswith("file:/"):
        return Path(uri[len("file:"):]).absolute().as_uri()
    return uri


def _not_blank(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


@dataclass
class TensorBoardConfig(Checked):
    """TensorBoard (`logger=tensorboard`): rank 0 writes event files, one log dir per run dir for its whole life."""

    log_dir: Optional[str] = field(default=None, metadata=bounds(valid=_not_blank, allowed="a directory path"))
    """Where the event files go (null: RUN_DIR/tensorboard, so `tensorboard --logdir` over a sweep dir shows every
    point in one hparams table). Made absolute at submit. A requeued or restarted attempt appends to it; give each
    run dir a log dir of its own (TensorBoard tells runs apart by their directories)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.log_dir is not None:
            self.log_dir = str(Path(self.log_dir).expanduser().absolute())

    def check_writable(self) -> None:
        """Submit side: the log dir is an existing directory this user may write, or a path to one it may create
        (its nearest existing parent a directory it may write). Rank 0 would find out only when it starts, and a
        tracker that fails never stops training: the run would end well with no events. (Not a check of the
        schema: `status` or `cost` of a colleague's run dir reads its config without writing anything.)"""
        if self.log_dir is None:
            return
        path = Path(self.log_dir)
        allowed = "a directory this user may write, or a path where it may create one"
        existing = next(p for p in (path, *path.parents) if p.exists() or p.is_symlink())
        if not existing.is_dir():
            why = "it is not a directory" if existing == path else f"{existing} is not a directory"
            raise ConfigError("logger.tensorboard.log_dir", self.log_dir, f"{allowed} ({why})")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError("logger.tensorboard.log_dir", self.log_dir,
                              f"{allowed} ({existing} is not writable by this user)")


@dataclass
class MlflowConfig(Checked):
    """MLflow (`logger=mlflow`): rank 0 logs to one MLflow run per run dir for its whole life."""

    tracking_uri: Optional[str] = field(
        default=None, metadata=bounds(valid=_is_tracking_uri, allowed=_MLFLOW_URI_TEXT)
    )
    """Where runs are stored: a tracking server (`http://host:5000`) or a store MLflow opens itself. null: the
    MLFLOW_TRACKING_URI of the submitting shell, else `sqlite:///SUBMIT_DIR/mlflow.db` (MLflow's own default
    place, so `mlflow ui` started there shows the runs). Resolved at submit and kept in config.yaml, a relative
    path made absolute. Slurm: a sqlite file on shared storage serves a few jobs; many want a server."""
    experiment: Optional[str] = field(default=None, metadata=bounds(valid=_not_blank, allowed="a name"))
    """MLflow experiment the run belongs to (null: the job name); created if it does not exist."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tracking_uri is None:
            cwd_store = f"sqlite:///{Path.cwd() / 'mlflow.db'}"
            self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or cwd_store
            if not _is_tracking_uri(self.tracking_uri):
                raise ConfigError("tracking_uri", self.tracking_uri, f"{_MLFLOW_URI_TEXT} (from MLFLOW_TRACKING_URI)")
        self.tracking_uri = _absolute_uri(self.tracking_uri)


#: The trackers `logger` may select, by key, with their schemas.
TRACKERS: dict[Tracker, type[Any]] = {Tracker.tensorboard: TensorBoardConfig, Tracker.mlflow: MlflowConfig}


@dataclass
class LoggerConfig(Checked):
    """Experiment trackers: `logger=none|tensorboard|mlflow`, several with Hydra's list of a group's options
    (`logger=[tensorboard,mlflow]`, which merges each file's key under `logger`). A tracker is on when its key is
    set. Rank 0 logs train and eval metrics, throughput, per-rank timing, GPU readings and the config."""

    tensorboard: Optional[TensorBoardConfig] = None
    """TensorBoard's settings; set (by `logger=tensorboard`) means on."""
    mlflow: Optional[MlflowConfig] = None
    """MLflow's settings; set (by `logger=mlflow`) means on."""

    @property
    def selected(self) -> list[Tracker]:
        """The trackers that are on, in `TRACKERS` order."""
        return [name for name in TRACKERS if getattr(self, name) is not None]

    def check_here(self) -> None:
        """Submit side: refuse a tracker whose package is not installed here (ConfigError, exit 2), without
        importing it (`importlib.util.find_spec`), and a TensorBoard log dir that cannot be one."""
        if self.tensorboard is not None:
            self.tensorboard.check_writable()
        for name in self.selected:
            needed = [name.value]
            if name == Tracker.mlflow and self.mlflow is not None and self.mlflow.tracking_uri is not None and (
                    mlflow_scheme(self.mlflow.tracking_uri) in MLFLOW_DB_SCHEMES):
                needed += ["sqlalchemy", "alembic"]  # mlflow-skinny opens a database store only with these
            missing = [module for module in needed if importlib.util.find_spec(module) is None]
            if missing:
                raise ConfigError("logger", name, f"a tracker whose package is installed: `pip install "
                                  f"'gpujobs[{name}]'` ({', '.join(missing)} not found in this Python)")

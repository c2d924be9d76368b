"""Typed config schemas and their validation: the single source of truth for every key (torch-free).

YAML under `conf/` only sets values. `load_config` turns a composed `DictConfig` into a `JobConfig`
once, at the edge; everything after it takes plain typed objects.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import shutil
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

from gpujobs.errors import ConfigError
from gpujobs.nccl import NcclSettings

CLUSTERS = ("auto", "local", "debug", "slurm")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_NAME_LIST = re.compile(r"^[A-Za-z0-9_.,\[\]-]+$")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?$")
#: slurmctld checks time limits every 30 s and sends a job's --signal at the first check that finds
#: less than the lead + 30 s left, so the signal may come up to 30 s before the lead.
SLURM_LIMIT_CHECK_S = 30


def parse_time_minutes(text: str) -> int:
    """Slurm time string (`MM`, `HH:MM:SS`, `D-HH[:MM[:SS]]`) to whole minutes, rounded up."""
    match = _TIME.match(text.strip())
    if not match:
        raise ConfigError("cluster.time", text, "minutes, HH:MM:SS or D-HH:MM:SS")
    days, first, second, third = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
    elif third is not None:  # HH:MM:SS
        hours, minutes, seconds = int(first), int(second), int(third)
    elif second is not None:  # MM:SS
        hours, minutes, seconds = 0, int(first), int(second)
    else:  # MM
        hours, minutes, seconds = 0, int(first), 0
    if (minutes >= 60 and (days is not None or third is not None)) or seconds >= 60:
        raise ConfigError("cluster.time", text, "minutes and seconds below 60 in HH:MM:SS")
    total_s = ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds
    if total_s <= 0:
        raise ConfigError("cluster.time", text, "a positive duration")
    return -(-total_s // 60)


def _check_name(key: str, value: Optional[str], pattern: re.Pattern[str] = _NAME) -> None:
    if value is not None and not pattern.match(value):
        raise ConfigError(key, value, "letters, digits and _.- (no spaces or shell characters)")


@dataclass
class ClusterConfig:
    """Where the job runs and how long it may take."""

    name: str = "auto"
    """local | debug | slurm; auto picks slurm when sbatch and a Slurm config are found, else local."""
    partition: Optional[str] = None
    """Slurm partition (default: the cluster's default partition)."""
    account: Optional[str] = None
    """Slurm account to charge."""
    qos: Optional[str] = None
    """Slurm quality of service."""
    constraint: Optional[str] = None
    """Slurm node features the job needs (--constraint)."""
    exclude: Optional[str] = None
    """Slurm nodes to avoid (--exclude), e.g. node[3-4]."""
    time: str = "01:00:00"
    """Time limit: minutes, HH:MM:SS or D-HH:MM:SS."""
    signal_lead_s: int = 120
    """Seconds before the time limit at which the job gets USR2 to checkpoint."""
    wait: Optional[bool] = None
    """Follow the job to its end and exit with its status (default: true locally, false on Slurm)."""
    max_restarts: int = 0
    """Failure budget: attempts that failed by themselves (exit code != 0, no signal) that may be retried."""
    max_preemptions: int = 20
    """Preemption budget: times the job may be preempted (USR2 well before its time limit) and requeued."""
    max_timeouts: int = 5
    """Time-limit budget: times the job may hit its time limit (USR2 near it) and be requeued."""
    folder: str = "submitit"
    """Sub-directory of the run dir for submitit's pickles and per-rank logs."""
    dry_run: bool = False
    """Slurm: print the exact sbatch script that would be queued, and write and queue nothing."""
    array_parallelism: Optional[int] = None
    """Slurm sweeps (`-m`): at most this many points of the job array run at once (null: no limit)."""

    def __post_init__(self) -> None:
        if self.name not in CLUSTERS:
            raise ConfigError("name", self.name, f"one of {', '.join(CLUSTERS)}")
        for key in ("partition", "account", "qos", "folder"):
            _check_name(key, getattr(self, key))
        for key in ("constraint", "exclude"):
            _check_name(key, getattr(self, key), _NAME_LIST)
        try:
            parse_time_minutes(self.time)
        except ConfigError as err:
            raise ConfigError("time", self.time, err.allowed) from None
        if self.signal_lead_s < 0:
            raise ConfigError("signal_lead_s", self.signal_lead_s, "an integer >= 0")
        limit_s = self.timeout_min * 60
        if self.signal_lead_s + SLURM_LIMIT_CHECK_S >= limit_s:
            # slurmctld sends --signal at its first limit check with less than lead + 30 s left: a longer
            # lead would stop every attempt as it starts and spend the time-limit budget on nothing
            raise ConfigError(
                "signal_lead_s", self.signal_lead_s,
                f"below {limit_s - SLURM_LIMIT_CHECK_S} s with time={self.time} (the time limit less the "
                f"{SLURM_LIMIT_CHECK_S} s by which Slurm may send the signal early)",
            )
        for key in ("max_restarts", "max_preemptions", "max_timeouts"):
            if getattr(self, key) < 0:
                raise ConfigError(key, getattr(self, key), "an integer >= 0")
        if self.array_parallelism is not None and self.array_parallelism < 1:
            raise ConfigError("array_parallelism", self.array_parallelism, "an integer >= 1, or null")

    @property
    def timeout_min(self) -> int:
        """The time limit in minutes."""
        return parse_time_minutes(self.time)

    @property
    def should_wait(self) -> bool:
        """Whether submit follows the job to its end."""
        return self.wait if self.wait is not None else self.name != "slurm"


@dataclass
class ResourcesConfig:
    """What one job asks for. One rank per GPU; CPU ranks (gloo) where there is no GPU."""

    nodes: int = 1
    """Number of nodes."""
    gpus_per_node: int = 0
    """GPUs per node; each gets one rank."""
    procs_per_node: Optional[int] = None
    """Ranks per node when gpus_per_node is 0 (CPU ranks with gloo); default 1."""
    cpus_per_task: int = 1
    """CPU cores per rank (also the torch thread count)."""
    mem_gb: Optional[float] = None
    """Memory per node in GB (default: the cluster's default)."""
    pick_gpus: bool = False
    """Local runs: false uses GPUs 0..gpus_per_node-1; true picks the least-loaded GPUs (NVML)."""
    min_free_gpu_mem_gb: float = 0.0
    """Local runs with pick_gpus: a GPU needs at least this much free memory to be picked."""

    def __post_init__(self) -> None:
        if self.min_free_gpu_mem_gb < 0:
            raise ConfigError("min_free_gpu_mem_gb", self.min_free_gpu_mem_gb, "a number >= 0")
        if self.nodes < 1:
            raise ConfigError("nodes", self.nodes, "an integer >= 1")
        if self.gpus_per_node < 0:
            raise ConfigError("gpus_per_node", self.gpus_per_node, "an integer >= 0")
        if self.procs_per_node is not None and self.procs_per_node < 1:
            raise ConfigError("procs_per_node", self.procs_per_node, "an integer >= 1, or null")
        if self.cpus_per_task < 1:
            raise ConfigError("cpus_per_task", self.cpus_per_task, "an integer >= 1")
        if self.mem_gb is not None and self.mem_gb <= 0:
            raise ConfigError("mem_gb", self.mem_gb, "a number > 0, or null")

    @property
    def ranks_per_node(self) -> int:
        """One rank per GPU, else procs_per_node CPU ranks."""
        if self.gpus_per_node > 0:
            return self.gpus_per_node
        return self.procs_per_node or 1

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.nodes * self.ranks_per_node


SCHEDULES = ("constant", "cosine", "linear")
OPTIMIZERS = ("adam", "adamw", "sgd")
AMP_MODES = ("auto", "bf16", "off")


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    name: str = "adam"
    """adam | adamw | sgd."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Weight decay (decoupled for adamw)."""
    momentum: float = 0.9
    """SGD momentum."""
    warmup_steps: int = 0
    """Linear warm-up steps from 0 to lr."""
    schedule: str = "constant"
    """After warm-up: constant | cosine | linear (decay to min_lr_ratio * lr at max_steps)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr for cosine and linear schedules."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ConfigError("name", self.name, f"one of {', '.join(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            raise ConfigError("schedule", self.schedule, f"one of {', '.join(SCHEDULES)}")
        if not self.lr > 0:
            raise ConfigError("lr", self.lr, "a number > 0")
        if self.weight_decay < 0:
            raise ConfigError("weight_decay", self.weight_decay, "a number >= 0")
        if self.warmup_steps < 0:
            raise ConfigError("warmup_steps", self.warmup_steps, "an integer >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")


@dataclass
class TrainerConfig:
    """The training loop's length, cadence and numerics."""

    max_steps: int = 400
    """Optimizer steps to train for."""
    seed: int = 0
    """Seed of model init and every random choice of the loop."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (gradients synced on the last only)."""
    grad_clip: Optional[float] = 1.0
    """Clip the global gradient norm to this value (null: no clipping)."""
    amp: str = "auto"
    """auto (bf16 on CUDA, off on CPU) | bf16 | off."""
    eval_every: int = 100
    """Evaluate every N steps (0: only at the end)."""
    log_every: int = 20
    """Log metrics every N steps."""
    deterministic: bool = True
    """Deterministic kernels, so a seed gives bit-identical parameters."""
    pg_timeout_s: int = 120
    """Process-group timeout: a dead rank makes the others fail after this many seconds."""
    stop_check_every: int = 10
    """Steps between the ranks' agreement on a pending USR2 (a tiny all-reduce); the stop itself loses no step."""
    progress: bool = True
    """Show a progress bar when the output is a terminal."""

    def __post_init__(self) -> None:
        for key in ("max_steps", "grad_accum", "stop_check_every"):
            if getattr(self, key) < 1:
                raise ConfigError(key, getattr(self, key), "an integer >= 1")
        for key in ("eval_every", "log_every"):
            if getattr(self, key) < 0:
                raise ConfigError(key, getattr(self, key), "an integer >= 0")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError("grad_clip", self.grad_clip, "a number > 0, or null")
        if self.amp not in AMP_MODES:
            raise ConfigError("amp", self.amp, f"one of {', '.join(AMP_MODES)}")
        if self.pg_timeout_s < 1:
            raise ConfigError("pg_timeout_s", self.pg_timeout_s, "an integer >= 1")


@dataclass
class CheckpointConfig:
    """When checkpoints are written and how many are kept."""

    every_steps: int = 100
    """Save every N optimizer steps (0: only at the end)."""
    keep: int = 2
    """Complete checkpoints kept; older ones are deleted after a newer one is complete."""
    resume: bool = True
    """Start from the newest complete checkpoint in the run dir, if any."""

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ConfigError("every_steps", self.every_steps, "an integer >= 0")
        if self.keep < 1:
            raise ConfigError("keep", self.keep, "an integer >= 1")


@dataclass
class TelemetryConfig:
    """GPU telemetry, straggler detection and the Prometheus endpoint."""

    gpu: bool = True
    """Sample the node's GPUs (NVML) into gpu.jsonl, one sampler per node."""
    interval_s: float = 5.0
    """Seconds between GPU samples."""
    imbalance_threshold: float = 1.25
    """Warn when the slowest rank's local step time (data wait + forward) exceeds the median by this factor."""
    prometheus_port: Optional[int] = None
    """Rank 0 serves metrics for Prometheus on this port (null: off; 0: a free port, see prometheus.json)."""
    prometheus_addr: str = "0.0.0.0"
    """Address the Prometheus endpoint listens on."""
    prometheus_linger_s: float = 0.0
    """Keep the endpoint up this many seconds after training, so a last scrape sees the final values."""
    debug_slow_rank: Optional[int] = None
    """Debug: this rank sleeps debug_slow_ms every step (to see straggler detection work)."""
    debug_slow_ms: float = 200.0
    """Debug: the sleep of debug_slow_rank per step, in milliseconds."""

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ConfigError("interval_s", self.interval_s, "a number > 0")
        if not self.imbalance_threshold >= 1:
            raise ConfigError("imbalance_threshold", self.imbalance_threshold, "a number >= 1")
        if self.prometheus_port is not None and not 0 <= self.prometheus_port <= 65535:
            raise ConfigError("prometheus_port", self.prometheus_port, "0..65535 (0: a free port), or null")
        if self.prometheus_linger_s < 0:
            raise ConfigError("prometheus_linger_s", self.prometheus_linger_s, "a number >= 0")
        if self.debug_slow_rank is not None and self.debug_slow_rank < 0:
            raise ConfigError("debug_slow_rank", self.debug_slow_rank, "a rank >= 0, or null")
        if self.debug_slow_ms < 0:
            raise ConfigError("debug_slow_ms", self.debug_slow_ms, "a number >= 0")


@dataclass
class ScriptConfig:
    """Bring your own script: run a torchrun-style script on every rank instead of the trainer."""

    path: str = ""
    """The script (made absolute at submit time); it reads RANK, WORLD_SIZE, MASTER_ADDR... as under torchrun."""
    args: list[str] = field(default_factory=list)
    """Its command-line arguments."""
    cwd: Optional[str] = None
    """Working directory of the script (default: the job's)."""

    def __post_init__(self) -> None:
        path = Path(self.path).expanduser()
        if not self.path or not path.is_file():
            raise ConfigError("path", self.path, "an existing Python script")
        self.path = str(path.resolve())
        if self.cwd is not None and not Path(self.cwd).is_dir():
            raise ConfigError("cwd", self.cwd, "an existing directory, or null")


_SECTIONS: dict[str, type[Any]] = {
    "cluster": ClusterConfig,
    "resources": ResourcesConfig,
    "nccl": NcclSettings,
    "optim": OptimConfig,
    "trainer": TrainerConfig,
    "checkpoint": CheckpointConfig,
    "telemetry": TelemetryConfig,
}
_PLUGINS = ("model", "data")
_TASK = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass
class JobConfig:
    """A whole job: every section, validated."""

    name: str = "job"
    """Job name (Slurm job name, run-dir prefix)."""
    task: str = "jobs.rec.task:build_task"
    """`module:function` building the job-side task object from (model, data, rank, world, micro)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    nccl: NcclSettings = field(default_factory=NcclSettings)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    model: Any = None
    """The model's schema object (a dataclass named by `_target_`)."""
    data: Any = None
    """The data's schema object (a dataclass named by `_target_`)."""
    script: Optional[ScriptConfig] = None
    """Set to run a user's script on every rank instead of the trainer (`+script.path=train.py`)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the resolved config (what config.yaml holds)."""
        out = dataclasses.asdict(self)
        for key in _PLUGINS:
            out[key] = dataclasses.asdict(getattr(self, key))
        if self.script is None:
            out.pop("script")
        return out


_schemas: dict[type[Any], DictConfig] = {}
_field_types: dict[type[Any], dict[str, tuple[Any, bool]]] = {}
_NO_FIT: Any = object()  # what `_exact` returns for a value it cannot take as it is


def _fields(schema: type[Any]) -> dict[str, tuple[Any, bool]]:
    """Each init field of `schema`: its type hint, and whether it is required (no default)."""
    if schema not in _field_types:
        hints = typing.get_type_hints(schema)
        _field_types[schema] = {
            f.name: (hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(schema)
            if f.init
        }
    return _field_types[schema]


def _exact(hint: Any, value: Any) -> Any:
    """`value` as OmegaConf's merge would give it for a field typed `hint`, where that takes no conversion
    (an int for a float is widened, as OmegaConf does); `_NO_FIT` for anything else: a string, bool
    or None where a number is due, `???`, an unresolved `${...}`, an enum, a nested dataclass."""
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        args = typing.get_args(hint)
        if value is None:
            return None if type(None) in args else _NO_FIT
        inner = [arg for arg in args if arg is not type(None)]
        return _exact(inner[0], value) if len(inner) == 1 else _NO_FIT
    kind = type(value)
    if hint in (int, bool):
        return value if kind is hint else _NO_FIT
    if hint is float:
        return float(value) if kind in (int, float) else _NO_FIT
    if hint is str:
        return value if kind is str and value != "???" and "${" not in value else _NO_FIT
    if origin is list and kind is list:
        (item,) = typing.get_args(hint)
        items = [_exact(item, v) for v in value]
        return _NO_FIT if any(v is _NO_FIT for v in items) else items
    if origin is dict and kind is dict and typing.get_args(hint)[0] is str:
        entries = {k: _exact(typing.get_args(hint)[1], v) for k, v in value.items()}
        fits = all(type(k) is str for k in entries) and all(v is not _NO_FIT for v in entries.values())
        return entries if fits else _NO_FIT
    return _NO_FIT


def _section(key: str, schema: type[Any], values: Any) -> Any:
    """`values` as a `schema` object, turning every OmegaConf complaint into one ConfigError.

    Values that already have their fields' exact types (what a composed config nearly always holds)
    build the dataclass directly: the same object as OmegaConf's merge, at a hundredth of the cost,
    which matters when a sweep validates hundreds of points. Anything else, including every value
    that is wrong, takes the merge, and with it OmegaConf's conversions and errors.
    """
    fields = _fields(schema)
    given = {} if values is None else values
    if isinstance(given, dict) and all(name in given for name, (_, required) in fields.items() if required):
        kwargs = {name: _exact(fields[name][0], value) if name in fields else _NO_FIT for name, value in given.items()}
        if all(value is not _NO_FIT for value in kwargs.values()):
            try:
                return schema(**kwargs)
            except ConfigError as err:
                raise err.under(key) from None
    return _merged_section(key, schema, values)


def _merged_section(key: str, schema: type[Any], values: Any) -> Any:
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(key, values, f"a mapping of {', '.join(f.name for f in dataclasses.fields(schema))}")
    try:
        if schema not in _schemas:  # merge copies it; building it from the dataclass is half the cost
            _schemas[schema] = OmegaConf.structured(schema)
        merged = OmegaConf.merge(_schemas[schema], values)
        return OmegaConf.to_object(merged)
    except MissingMandatoryValue as err:
        raise ConfigError(f"{key}.{err.full_key}", "???", "a value: this key is required, set it") from None
    except ConfigKeyError as err:
        bad = str(err.full_key).split(".")[0].split("[")[0]
        names = ", ".join(f.name for f in dataclasses.fields(schema))
        raise ConfigError(f"{key}.{bad}", values.get(bad), f"keys of {key}: {names}") from None
    except OmegaConfBaseException as err:
        full_key = str(err.full_key)
        field_name = full_key.split(".")[0].split("[")[0]
        ftype = next((f.type for f in dataclasses.fields(schema) if f.name == field_name), "?")
        value = _lookup(values, full_key)
        raise ConfigError(f"{key}.{full_key}", value, f"a value of type {ftype}") from None
    except ConfigError as err:
        raise err.under(key) from None


def _lookup(values: dict[str, Any], dotted: str) -> Any:
    node: Any = values
    for part in re.split(r"\.|\[|\]", dotted):
        if part == "":
            continue
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            return None
    return node


def _plugin(key: str, values: Any) -> Any:
    """Build a plug-in's schema object from its `_target_` (a torch-free dataclass)."""
    if not isinstance(values, dict) or "_target_" not in values:
        raise ConfigError(f"{key}._target_", None, "a dotted path to a config dataclass")
    target = values["_target_"]
    module_name, _, attr = str(target).rpartition(".")
    try:
        schema = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError):
        raise ConfigError(f"{key}._target_", target, "an importable dataclass path") from None
    if not dataclasses.is_dataclass(schema):
        raise ConfigError(f"{key}._target_", target, "a dataclass")
    return _section(key, schema, values)  # type: ignore[arg-type]


def resolve_cluster_name(name: str) -> str:
    """`auto` → slurm when this machine can submit to Slurm, else local."""
    if name != "auto":
        return name
    import os

    has_conf = bool(os.environ.get("SLURM_CONF")) or os.path.exists("/etc/slurm/slurm.conf")
    return "slurm" if shutil.which("sbatch") and has_conf else "local"


def load_config(cfg: DictConfig | dict[str, Any]) -> JobConfig:
    """Validate a composed config and return it as typed objects. Raises ConfigError."""
    raw: Any = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    raw.pop("hydra", None)
    known = {f.name for f in dataclasses.fields(JobConfig)}
    for key in raw:
        if key not in known:
            raise ConfigError(str(key), raw[key], f"top-level keys: {', '.join(sorted(known))}")
    name = raw.get("name", JobConfig.name)
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError("name", name, "letters, digits and _.- (no spaces or shell characters)")
    task = raw.get("task", JobConfig.task)
    if not isinstance(task, str) or not _TASK.match(task):
        raise ConfigError("task", task, "module.path:function")
    sections = {key: _section(key, schema, raw.get(key)) for key, schema in _SECTIONS.items()}
    plugins = {key: _plugin(key, raw.get(key)) for key in _PLUGINS}
    script = _section("script", ScriptConfig, raw["script"]) if raw.get("script") is not None else None
    job = JobConfig(name=name, task=task, **sections, **plugins, script=script)
    job.cluster.name = resolve_cluster_name(job.cluster.name)
    slow = job.telemetry.debug_slow_rank
    if slow is not None and slow >= job.resources.world_size:
        raise ConfigError("telemetry.debug_slow_rank", slow, f"a rank below the world size {job.resources.world_size}")
    return job

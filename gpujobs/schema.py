"""Typed config schemas of gpujobs: every key, its docstring and its bounds, declared together (torch-free).

YAML under `conf/` only sets values. A field's bounds come from what consumes it (Slurm, torch, the
standard library) and are enforced by `gpujobs.validate` when the object is built; `gpujobs.config`
builds these objects from a composed config.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from gpujobs.errors import ConfigError
from gpujobs.nccl import NcclSettings
from gpujobs.schema_trackers import LoggerConfig
from gpujobs.validate import Checked, bounds, is_host

CLUSTERS = ("auto", "local", "debug", "slurm")
NAME = re.compile(r"[A-Za-z0-9_.-]+")
NAME_TEXT = "letters, digits and _.- (no spaces or shell characters)"
_NAME_LIST = re.compile(r"[A-Za-z0-9_.,\[\]-]+")
_NAME_LIST_TEXT = "letters, digits and _.,[]- (no spaces or shell characters)"
_TASK = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?")
#: slurmctld checks time limits every 30 s and sends a job's --signal at the first check that finds
#: less than the lead + 30 s left, so the signal may come up to 30 s before the lead.
SLURM_LIMIT_CHECK_S = 30
#: Slurm's --signal takes a lead of at most 65535 s (a 16-bit field).
SLURM_MAX_SIGNAL_LEAD_S = 65535
#: The longest wait any consumer here takes: Python's sleep and Event.wait and torch's process-group
#: deadlines count nanoseconds in a signed 64 bits (now + timeout), which overflows at 2**63 ns (~292
#: years; `time.sleep(9223372036)` fails, torch's TCPStore connect fails at once). Half of that leaves
#: the clock's own count room.
MAX_WAIT_S = 2**62 // 10**9
#: The longest process-group timeout torch can hand NCCL's heartbeat monitor: it reads
#: TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (set from `trainer.pg_timeout_s`) as a 32-bit int and counts its
#: milliseconds in one, which overflows past 2,147,483 s (24.8 days).
MAX_PG_TIMEOUT_S = (2**31 - 1) // 1000
#: Seconds the hang watchdog needs after `trainer.hang_timeout_s` to notice a hang and take its
#: evidence: torch's own collective timeout (`trainer.pg_timeout_s`) must leave it that long.
HANG_EVIDENCE_S = 30
#: `--mem` is rendered in whole MiB (`--mem=0` would ask for the whole node), and sbatch reads the MiB
#: count as a signed 64-bit integer.
_MEM_GB = bounds(ge=1 / 1024, le=2**53, note="GB: at least 1 MiB, as --mem counts whole MiB")


def parse_time_minutes(text: str) -> int:
    """Slurm time string (`MM`, `HH:MM:SS`, `D-HH[:MM[:SS]]`) to whole minutes, rounded up."""
    match = _TIME.fullmatch(text.strip())
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


@dataclass
class ClusterConfig(Checked):
    """Where the job runs and how long it may take."""

    name: str = field(default="auto", metadata=bounds(one_of=CLUSTERS))
    """local | debug | slurm; auto picks slurm when sbatch and a Slurm config are found, else local
    (on the submit side: `gpujobs.launch.resolve_cluster`; config.yaml holds the name it picked)."""
    partition: Optional[str] = field(default=None, metadata=bounds(pattern=NAME, allowed=NAME_TEXT))
    """Slurm partition (default: the cluster's default partition)."""
    account: Optional[str] = field(default=None, metadata=bounds(pattern=NAME, allowed=NAME_TEXT))
    """Slurm account to charge."""
    qos: Optional[str] = field(default=None, metadata=bounds(pattern=NAME, allowed=NAME_TEXT))
    """Slurm quality of service."""
    constraint: Optional[str] = field(default=None, metadata=bounds(pattern=_NAME_LIST, allowed=_NAME_LIST_TEXT))
    """Slurm node features the job needs (--constraint)."""
    exclude: Optional[str] = field(default=None, metadata=bounds(pattern=_NAME_LIST, allowed=_NAME_LIST_TEXT))
    """Slurm nodes to avoid (--exclude), e.g. node[3-4]."""
    time: str = "01:00:00"
    """Time limit: minutes, HH:MM:SS or D-HH:MM:SS."""
    signal_lead_s: int = field(
        default=120, metadata=bounds(ge=0, le=SLURM_MAX_SIGNAL_LEAD_S, note="Slurm's --signal takes at most 65535 s")
    )
    """Seconds before the time limit at which the job gets USR2 to checkpoint (below the limit less 30 s)."""
    wait: Optional[bool] = None
    """Follow the job to its end and exit with its status (default: true locally, false on Slurm)."""
    max_restarts: int = field(default=0, metadata=bounds(ge=0))
    """Failure budget: attempts that failed by themselves (exit code != 0, no signal) that may be retried."""
    max_preemptions: int = field(default=20, metadata=bounds(ge=0))
    """Preemption budget: times the job may be preempted (USR2 well before its time limit) and requeued."""
    max_timeouts: int = field(default=5, metadata=bounds(ge=0))
    """Time-limit budget: times the job may hit its time limit (USR2 near it) and be requeued."""
    max_unhealthy: int = field(default=3, metadata=bounds(ge=0))
    """Health budget: attempts that a failed health check ended (its node is excluded) before the job gives up."""
    health_check: bool = False
    """Before training, check every node's GPUs through NVML (uncorrectable ECC errors, pending retired
    pages or row remaps, XID events, temperature, thermal or power throttling) and time an all-reduce
    across the ranks; a failing node ends the attempt as `unhealthy`, is excluded, and the job is requeued."""
    health_min_busbw_gbps: float = field(default=0.0, metadata=bounds(ge=0, le=1e6))
    """Health check: the least all-reduce bus bandwidth (GB/s) the probe must reach (0: measured and
    recorded, never failed)."""
    health_probe_mb: float = field(default=16.0, metadata=bounds(gt=0, le=4096))
    """Health check: the size of the probe's all-reduce tensor, in MiB."""
    health_max_temp_c: float = field(default=90.0, metadata=bounds(gt=0, le=200))
    """Health check: the hottest a GPU may be at start (degrees C)."""
    folder: str = field(default="submitit", metadata=bounds(pattern=NAME, allowed=NAME_TEXT))
    """Sub-directory of the run dir for submitit's pickles and per-rank logs."""
    dry_run: bool = False
    """Slurm: print the exact sbatch script that would be queued, and write and queue nothing."""
    array_parallelism: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Slurm sweeps (`-m`): at most this many points of the job array run at once (null: no limit)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            limit_s = parse_time_minutes(self.time) * 60
        except ConfigError as err:
            raise ConfigError("time", self.time, err.allowed) from None
        if self.signal_lead_s + SLURM_LIMIT_CHECK_S >= limit_s:
            # slurmctld sends --signal at its first limit check with less than lead + 30 s left: a longer
            # lead would stop every attempt as it starts and spend the time-limit budget on nothing
            raise ConfigError(
                "signal_lead_s", self.signal_lead_s,
                f"below {limit_s - SLURM_LIMIT_CHECK_S} s with time={self.time} (the time limit less the "
                f"{SLURM_LIMIT_CHECK_S} s by which Slurm may send the signal early)",
            )

    @property
    def timeout_min(self) -> int:
        """The time limit in minutes."""
        return parse_time_minutes(self.time)

    @property
    def should_wait(self) -> bool:
        """Whether submit follows the job to its end."""
        return self.wait if self.wait is not None else self.name != "slurm"


@dataclass
class ResourcesConfig(Checked):
    """What one job asks for. One rank per GPU; CPU ranks (gloo) where there is no GPU."""

    nodes: int = field(default=1, metadata=bounds(ge=1))
    """Number of nodes."""
    gpus_per_node: int = field(default=0, metadata=bounds(ge=0))
    """GPUs per node; each gets one rank."""
    procs_per_node: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Ranks per node when gpus_per_node is 0 (CPU ranks with gloo); default 1."""
    cpus_per_task: int = field(default=1, metadata=bounds(ge=1, le=65533, note="Slurm keeps it in 16 bits"))
    """CPU cores per rank (also the torch thread count)."""
    mem_gb: Optional[float] = field(default=None, metadata=_MEM_GB)
    """Memory per node in GB (default: the cluster's default); at least 1/1024 (1 MiB, see `_MEM_GB`)."""
    pick_gpus: bool = False
    """Local runs: false uses GPUs 0..gpus_per_node-1; true picks the least-loaded GPUs (NVML)."""
    min_free_gpu_mem_gb: float = field(default=0.0, metadata=bounds(ge=0))
    """Local runs with pick_gpus: a GPU needs at least this much free memory to be picked."""
    min_nodes: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Elastic Slurm jobs: start (and come back after a requeue) on as few as this many nodes,
    `--nodes=MIN-MAX` with MAX = nodes; the world size is read from the allocation at start (default:
    nodes, a fixed allocation)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ConfigError("min_nodes", self.min_nodes, f"1..{self.nodes} (resources.nodes is the most)")

    @property
    def least_nodes(self) -> int:
        """The fewest nodes the job runs on (min_nodes, else nodes)."""
        return self.min_nodes if self.min_nodes is not None else self.nodes

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
BALANCE_MODES = ("off", "static", "dynamic", "replay")


@dataclass
class OptimConfig(Checked):
    """Optimizer and learning-rate schedule."""

    name: str = field(default="adam", metadata=bounds(one_of=OPTIMIZERS))
    """adam | adamw | sgd."""
    lr: float = field(default=1e-3, metadata=bounds(gt=0))
    """Peak learning rate."""
    weight_decay: float = field(default=0.0, metadata=bounds(ge=0))
    """Weight decay (decoupled for adamw)."""
    momentum: float = field(default=0.9, metadata=bounds(ge=0))
    """SGD momentum (torch.optim.SGD refuses a negative one)."""
    warmup_steps: int = field(default=0, metadata=bounds(ge=0))
    """Linear warm-up steps from 0 to lr."""
    schedule: str = field(default="constant", metadata=bounds(one_of=SCHEDULES))
    """After warm-up: constant | cosine | linear (decay to min_lr_ratio * lr at max_steps)."""
    min_lr_ratio: float = field(default=0.1, metadata=bounds(ge=0, le=1))
    """Final learning rate as a fraction of lr for cosine and linear schedules."""


@dataclass
class TrainerConfig(Checked):
    """The training loop's length, cadence and numerics."""

    max_steps: int = field(default=400, metadata=bounds(ge=1))
    """Optimizer steps to train for."""
    seed: int = field(default=0, metadata=bounds(ge=-(2**63), le=2**64 - 1, note="what torch.manual_seed takes"))
    """Seed of model init and every random choice of the loop."""
    grad_accum: int = field(default=1, metadata=bounds(ge=1))
    """Micro-batches per optimizer step (gradients synced on the last only)."""
    grad_clip: Optional[float] = field(default=1.0, metadata=bounds(gt=0))
    """Clip the global gradient norm to this value (null: no clipping)."""
    amp: str = field(default="auto", metadata=bounds(one_of=AMP_MODES))
    """auto (bf16 on CUDA, off on CPU) | bf16 | off."""
    eval_every: int = field(default=100, metadata=bounds(ge=0))
    """Evaluate every N steps (0: only at the end)."""
    log_every: int = field(default=20, metadata=bounds(ge=0))
    """Log metrics every N steps."""
    deterministic: bool = True
    """Deterministic kernels, so a seed gives bit-identical parameters."""
    pg_timeout_s: int = field(default=600, metadata=bounds(ge=1, le=MAX_PG_TIMEOUT_S, note="NCCL heartbeat limit"))
    """Process-group timeout: a dead rank makes the others fail after this many seconds. With the hang
    watchdog on, at least `hang_timeout_s` + 30 s, so the watchdog acts (and keeps the evidence) first. At most
    `MAX_PG_TIMEOUT_S` (2,147,483 s, 24.8 days): NCCL's heartbeat monitor counts it in 32-bit milliseconds
    (torch's own deadlines, signed 64-bit nanoseconds on a steady clock, would wrap only past `MAX_WAIT_S`)."""
    hang_timeout_s: int = field(default=300, metadata=bounds(ge=0, le=MAX_WAIT_S))
    """Hang watchdog: an attempt in which no rank changed its step or phase for this many seconds is
    hung; the supervisor takes every rank's stacks, kills the attempt and restarts it from its last
    checkpoint (against `cluster.max_restarts`). 0: no watchdog."""
    hang_slow_phase_s: int = field(default=1800, metadata=bounds(ge=1, le=MAX_WAIT_S))
    """Hang watchdog: how long ranks may stay in a phase that is slow by nature (start-up, a checkpoint
    save, an evaluation) before the attempt counts as hung."""
    stop_check_every: int = field(default=10, metadata=bounds(ge=1))
    """Steps between the ranks' agreement on a pending USR2 (a tiny all-reduce); the stop itself loses no step."""
    progress: bool = True
    """Show a progress bar when the output is a terminal."""
    balance: str = field(default="off", metadata=bounds(one_of=BALANCE_MODES))
    """How each step's global batch is split across ranks: off (equal shares) | static (balance_shares or
    balance_gpu_weights) | dynamic (shares follow each rank's measured compute time per sample) | replay
    (the plan history of the finished dynamic run in balance_replay)."""
    balance_shares: Optional[list[float]] = field(default=None, metadata=bounds(gt=0, min_len=1))
    """static: one relative weight per rank (normalized; as many as ranks)."""
    balance_gpu_weights: dict[str, float] = field(default_factory=dict)
    """static, mixed nodes: relative weight per GPU model name as CUDA reports it (`cpu` for CPU ranks)."""
    balance_every: int = field(default=20, metadata=bounds(ge=1))
    """dynamic: steps between plan updates (each gathers every rank's compute time per sample)."""
    balance_smoothing: float = field(default=0.5, metadata=bounds(gt=0, le=1))
    """dynamic: weight of the newest measurement in the smoothed shares (1: no smoothing)."""
    balance_max_change: float = field(default=0.1, metadata=bounds(gt=0, le=1))
    """dynamic: the most a rank's share moves in one update (a share is a fraction of the global batch)."""
    balance_min_share: float = field(default=0.02, metadata=bounds(gt=0, lt=1))
    """dynamic and static: no rank's share falls below this (times the equal share 1/world)."""
    balance_replay: Optional[str] = None
    """replay: the run dir of a finished dynamic run whose recorded plan history is replayed."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hang_timeout_s and self.pg_timeout_s < self.hang_timeout_s + HANG_EVIDENCE_S:
            raise ConfigError(
                "pg_timeout_s", self.pg_timeout_s,
                f"at least {self.hang_timeout_s + HANG_EVIDENCE_S} with hang_timeout_s={self.hang_timeout_s} "
                f"(torch's collective timeout must leave the hang watchdog {HANG_EVIDENCE_S} s to take the "
                "evidence first), or trainer.hang_timeout_s=0",
            )
        if self.balance == "replay" and not self.balance_replay:
            raise ConfigError("balance_replay", self.balance_replay, "the run dir of a finished dynamic run")
        if self.balance == "static" and not self.balance_shares and not self.balance_gpu_weights:
            raise ConfigError("balance_shares", self.balance_shares, "one weight per rank (or balance_gpu_weights)")
        for name, weight in self.balance_gpu_weights.items():
            if not (math.isfinite(weight) and weight > 0):
                raise ConfigError(f"balance_gpu_weights.{name}", weight, "a finite weight > 0")


#: Config keys that are Python keywords, by section: the key users write -> the schema's field name.
KEY_ALIASES: dict[str, dict[str, str]] = {"checkpoint": {"async": "async_"}}


@dataclass
class CheckpointConfig(Checked):
    """When checkpoints are written and how many are kept."""

    every_steps: int = field(default=100, metadata=bounds(ge=0))
    """Save every N optimizer steps (0: only at the end)."""
    keep: int = field(default=2, metadata=bounds(ge=1))
    """Complete checkpoints kept; older ones are deleted after a newer one is complete."""
    resume: bool = True
    """Start from the newest complete checkpoint in the run dir, if any."""
    async_: bool = False
    """Key `checkpoint.async`: periodic saves block training only while the state is copied to host memory;
    writing, fsync, verification and publishing run in the background (one in flight). A save at a
    preemption or at the end is synchronous."""


@dataclass
class TelemetryConfig(Checked):
    """GPU telemetry, straggler detection and the Prometheus endpoint."""

    gpu: bool = True
    """Sample the node's GPUs (NVML) into gpu.jsonl, one sampler per node."""
    interval_s: float = field(default=5.0, metadata=bounds(gt=0, le=MAX_WAIT_S))
    """Seconds between GPU samples (an Event.wait: at most `MAX_WAIT_S`)."""
    imbalance_threshold: float = field(default=1.25, metadata=bounds(ge=1))
    """Warn when the slowest rank's local step time (data wait + forward) exceeds the median by this factor."""
    prometheus_port: Optional[int] = field(default=None, metadata=bounds(ge=0, le=65535, note="0: a free port"))
    """Rank 0 serves metrics for Prometheus on this port (null: off; 0: a free port, see prometheus.json)."""
    prometheus_addr: str = field(
        default="127.0.0.1",
        metadata=bounds(valid=is_host, allowed="an IP address or a host name (0.0.0.0 or '': every interface)"),
    )
    """Address the Prometheus endpoint listens on: loopback by default, so the job's metrics are not
    served to the whole network unasked; 0.0.0.0 lets another host scrape it."""
    prometheus_linger_s: float = field(default=0.0, metadata=bounds(ge=0, le=MAX_WAIT_S))
    """Keep the endpoint up this many seconds after training, so a last scrape sees the final values (a sleep)."""
    prometheus_sd_dir: Optional[str] = None
    """Also announce the endpoint as a Prometheus file_sd target in this directory (one `gpujobs-*.json` per
    run, removed when the endpoint closes), so a Prometheus whose `file_sd_configs` globs over it finds the
    job. null: none. Made absolute at submit; it must exist and be writable, and, as it may be shared, others
    must not be able to replace files in it (not world-writable unless sticky, like /tmp). Slurm jobs need it
    on storage the nodes and the Prometheus host share."""
    debug_slow_rank: Optional[int] = field(default=None, metadata=bounds(ge=0))
    """Debug: this rank is slowed down by debug_slow_ms and/or debug_slow_factor (to see straggler detection
    and balancing work); below the world size."""
    debug_slow_ms: float = field(default=0.0, metadata=bounds(ge=0, le=MAX_WAIT_S * 1000))
    """Debug: a fixed sleep of debug_slow_rank per step, in milliseconds (like a slow input pipeline)."""
    debug_slow_factor: float = field(default=1.0, metadata=bounds(ge=1, le=1000))
    """Debug: debug_slow_rank spends this many times its own compute time on each micro-batch (it sleeps
    factor - 1 times its measured data + forward + backward time), so its cost grows with its share the way
    a slower GPU's does."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.debug_slow_rank is not None and self.debug_slow_ms == 0 and self.debug_slow_factor == 1:
            allowed = "null, or a rank with debug_slow_ms > 0 or debug_slow_factor > 1"
            raise ConfigError("debug_slow_rank", self.debug_slow_rank, allowed)
        if self.prometheus_sd_dir is not None:
            self.prometheus_sd_dir = _sd_dir(self.prometheus_sd_dir)


def _sd_dir(text: str) -> str:
    """`telemetry.prometheus_sd_dir`, resolved once (a symlink in it is followed now, never later), checked."""
    allowed = "an existing directory this user may write, not world-writable unless sticky (like /tmp)"
    path = Path(text).expanduser().resolve()
    try:
        mode = path.stat().st_mode if text else 0
    except OSError:
        mode = 0
    # world-writable without the sticky bit: anyone could swap a job's target for an address of theirs
    open_to_all = mode & stat.S_IWOTH and not mode & stat.S_ISVTX
    if not stat.S_ISDIR(mode) or open_to_all or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError("prometheus_sd_dir", text, allowed)
    return str(path)


@dataclass
class ScriptConfig(Checked):
    """Bring your own script: run a torchrun-style script on every rank instead of the trainer."""

    path: str = ""
    """The script (made absolute at submit time); it reads RANK, WORLD_SIZE, MASTER_ADDR... as under torchrun."""
    args: list[str] = field(default_factory=list, metadata=bounds(any_text=True))
    """Its command-line arguments (an argv, passed as a list: any text)."""
    cwd: Optional[str] = None
    """Working directory of the script (default: the job's)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        path = Path(self.path).expanduser()
        if not self.path or not path.is_file():
            raise ConfigError("path", self.path, "an existing Python script")
        self.path = str(path.resolve())
        if self.cwd is not None and not Path(self.cwd).is_dir():
            raise ConfigError("cwd", self.cwd, "an existing directory, or null")


#: The sections every job has, by key, with their schemas (model and data are plug-ins: `_target_`).
SECTIONS: dict[str, type[Any]] = {
    "cluster": ClusterConfig,
    "resources": ResourcesConfig,
    "nccl": NcclSettings,
    "optim": OptimConfig,
    "trainer": TrainerConfig,
    "checkpoint": CheckpointConfig,
    "telemetry": TelemetryConfig,
}
PLUGINS = ("model", "data")


@dataclass
class JobConfig(Checked):
    """A whole job: every section, validated."""

    name: str = field(default="job", metadata=bounds(pattern=NAME, allowed=NAME_TEXT))
    """Job name (Slurm job name, run-dir prefix)."""
    task: str = field(
        default="jobs.rec.task:build_task", metadata=bounds(pattern=_TASK, allowed="module.path:function")
    )
    """`module:function` building the job-side task object from (model, data, rank, world, micro)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    nccl: NcclSettings = field(default_factory=NcclSettings)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    model: Any = None
    """The model's schema object (a dataclass named by `_target_`)."""
    data: Any = None
    """The data's schema object (a dataclass named by `_target_`)."""
    script: Optional[ScriptConfig] = None
    """Set to run a user's script on every rank instead of the trainer (`+script.path=train.py`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        slow, world = self.telemetry.debug_slow_rank, self.resources.world_size
        if slow is not None and slow >= world:
            raise ConfigError("telemetry.debug_slow_rank", slow, f"a rank below the world size {world}")
        shares = self.trainer.balance_shares
        # an elastic job's world size is known only job-side, where the same check runs again
        if self.trainer.balance == "static" and shares and self.resources.min_nodes is None and len(shares) != world:
            raise ConfigError("trainer.balance_shares", shares, f"one weight per rank ({world} ranks)")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the resolved config (what config.yaml holds)."""
        out = dataclasses.asdict(self)
        for section, aliases in KEY_ALIASES.items():
            out[section] = {next((k for k, f in aliases.items() if f == name), name): v
                            for name, v in out[section].items()}
        for key in PLUGINS:
            out[key] = dataclasses.asdict(getattr(self, key))
        if self.script is None:
            out.pop("script")
        return out

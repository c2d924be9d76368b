"""Typed config schemas of gpujobs: every key, its docstring and its bounds, declared together (torch-free).

YAML under `conf/` only sets values. A field's bounds come from what consumes it (Slurm, torch, the
standard library) and are enforced by `gpujobs.config.validate` when the object is built; `gpujobs.config.load`
builds these objects from a composed config. Sections with their own module are imported here, and their
public names re-exported (`X as X`): `cluster` and `resources` (`gpujobs.config.cluster`), `container`
(`gpujobs.config.container`), `logger` (`gpujobs.config.trackers`) and `nccl` (`gpujobs.config.nccl`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import stat
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from gpujobs.base.errors import ConfigError
from gpujobs.base.permissions import open_to_others
from gpujobs.config.cluster import CLUSTERS as CLUSTERS
from gpujobs.config.cluster import DIR_NAME, DIR_NAME_TEXT, ClusterConfig, ResourcesConfig
from gpujobs.config.cluster import SLURM_LIMIT_CHECK_S as SLURM_LIMIT_CHECK_S
from gpujobs.config.cluster import SLURM_MAX_SIGNAL_LEAD_S as SLURM_MAX_SIGNAL_LEAD_S
from gpujobs.config.cluster import parse_time_minutes as parse_time_minutes
from gpujobs.config.container import ContainerConfig
from gpujobs.config.modes import Amp, Balance, Optimizer, Schedule, TableOptimizer
from gpujobs.config.nccl import NcclSettings
from gpujobs.config.parallel import ParallelConfig, check_torchrec
from gpujobs.config.trackers import LoggerConfig
from gpujobs.config.validate import NAME_MAX, Checked, bounds, is_host

_TASK = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
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

#: The largest relative weight of a rank or a GPU model in static balancing: the plan divides by the sum
#: of the weights, which must stay finite (two weights of 1e308 add up to inf); a million to one is
#: already more imbalance than any split of a batch can show.
MAX_BALANCE_WEIGHT = 10**6


@dataclass
class OptimConfig(Checked):
    """Optimizer and learning-rate schedule."""

    name: Optimizer = Optimizer.adam
    """adam | adamw | sgd."""
    lr: float = field(default=1e-3, metadata=bounds(gt=0))
    """Peak learning rate."""
    weight_decay: float = field(default=0.0, metadata=bounds(ge=0))
    """Weight decay (decoupled for adamw)."""
    momentum: float = field(default=0.9, metadata=bounds(ge=0))
    """SGD momentum (torch.optim.SGD refuses a negative one)."""
    warmup_steps: int = field(default=0, metadata=bounds(ge=0))
    """Linear warm-up steps from 0 to lr."""
    schedule: Schedule = Schedule.constant
    """After warm-up: constant | cosine | linear (decay to min_lr_ratio * lr at max_steps)."""
    min_lr_ratio: float = field(default=0.1, metadata=bounds(ge=0, le=1))
    """Final learning rate as a fraction of lr for cosine and linear schedules."""
    table_optimizer: TableOptimizer = TableOptimizer.rowwise_adagrad
    """parallel=torchrec: the optimizer fused into the embedding tables' backward (at `lr`), rowwise_adagrad (the
    MLPerf reference's) | adam (GPU ranks only: FBGEMM's CPU kernels have none) | sgd. Its state counts in the
    memory plan: adam keeps two values per table value, rowwise_adagrad one per row, sgd none."""


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
    amp: Amp = Amp.auto
    """auto (bf16 on GPUs of compute capability 8.0+, fp32 on older GPUs and the CPU) | bf16 | off."""
    eval_every: int = field(default=100, metadata=bounds(ge=0))
    """Evaluate every N steps (0: only at the end)."""
    eval_max_rows: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """The periodic evals (every `eval_every` steps) read at most the first N rows of the eval split, shared
    by the ranks (null: all of it); the final eval reads all of it."""
    log_every: int = field(default=20, metadata=bounds(ge=0))
    """Log metrics every N steps."""
    deterministic: bool = True
    """Deterministic kernels, so a seed gives bit-identical parameters."""
    pg_timeout_s: int = field(default=1830, metadata=bounds(ge=1, le=MAX_PG_TIMEOUT_S, note="NCCL heartbeat limit"))
    """Process-group timeout: a dead rank makes the others fail after this many seconds. With the hang
    watchdog on, at least `hang_slow_phase_s` (and `hang_timeout_s`) + 30 s: the others wait in a collective
    while a rank saves or evaluates, and the watchdog must judge that (and keep the evidence) first. At most
    2,147,483 s (24.8 days): NCCL's heartbeat monitor counts it in 32-bit milliseconds (torch's own
    deadlines, signed 64-bit nanoseconds on a steady clock, would wrap only past 4,611,686,018 s)."""
    hang_timeout_s: int = field(default=300, metadata=bounds(ge=0, le=MAX_WAIT_S))
    """Hang watchdog: an attempt in which no rank changed its step or phase for this many seconds is
    hung; the supervisor takes every rank's stacks, kills the attempt and restarts it from its last
    checkpoint (against `cluster.max_restarts`). 0: no watchdog."""
    hang_slow_phase_s: int = field(default=1800, metadata=bounds(ge=1, le=MAX_WAIT_S))
    """Hang watchdog: how long ranks may stay in a phase that is slow by nature (start-up, a checkpoint
    save, an evaluation) before the attempt counts as hung."""
    stop_check_every: int = field(default=10, metadata=bounds(ge=1))
    """Steps between the ranks' votes on a pending USR2 (a tiny all-reduce, read one step later, so no step
    waits for it); the ranks stop after that step, and the stop itself loses no step."""
    progress: bool = True
    """Show a progress bar when the output is a terminal."""
    balance: Balance = Balance.off
    """How each step's global batch is split across ranks: off (equal shares) | static (balance_shares or
    balance_gpu_weights) | dynamic (shares follow each rank's measured compute time per sample) | replay
    (the plan history of the finished dynamic run in balance_replay)."""
    balance_shares: Optional[list[float]] = field(
        default=None, metadata=bounds(gt=0, le=MAX_BALANCE_WEIGHT, min_len=1, note="their sum must stay finite")
    )
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
    """replay: the run dir of a finished dynamic run whose recorded plan history is replayed (made absolute
    at submit, where it must hold a checkpoint with that history)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        longest = max(self.hang_timeout_s, self.hang_slow_phase_s)
        if self.hang_timeout_s and self.pg_timeout_s < longest + HANG_EVIDENCE_S:
            raise ConfigError(
                "pg_timeout_s", self.pg_timeout_s,
                f"at least {longest + HANG_EVIDENCE_S} with hang_timeout_s={self.hang_timeout_s} and "
                f"hang_slow_phase_s={self.hang_slow_phase_s} (the others wait in a collective while a rank saves "
                f"or evaluates: torch's timeout must leave the hang watchdog the slow phase's limit and "
                f"{HANG_EVIDENCE_S} s for the evidence), or trainer.hang_timeout_s=0",
            )
        # each is read by one mode only: set under another, it would be silently ignored
        for name, value, mode in (("balance_shares", self.balance_shares, Balance.static),
                                  ("balance_gpu_weights", self.balance_gpu_weights, Balance.static),
                                  ("balance_replay", self.balance_replay, Balance.replay)):
            if value and self.balance != mode:
                allowed = f"only with trainer.balance={mode}, which reads it (balance is {self.balance})"
                raise ConfigError(name, value, allowed)
        if self.balance == Balance.replay and not self.balance_replay:
            raise ConfigError("balance_replay", self.balance_replay, "the run dir of a finished dynamic run")
        if self.balance_replay:  # the ranks may start in another directory
            self.balance_replay = str(Path(self.balance_replay).expanduser().absolute())
        if self.balance == Balance.static and not self.balance_shares and not self.balance_gpu_weights:
            raise ConfigError("balance_shares", self.balance_shares, "one weight per rank (or balance_gpu_weights)")
        for name, weight in self.balance_gpu_weights.items():
            if not (math.isfinite(weight) and 0 < weight <= MAX_BALANCE_WEIGHT):
                raise ConfigError(f"balance_gpu_weights.{name}", weight, f"a weight in (0, {MAX_BALANCE_WEIGHT}]")


#: Config keys that are Python keywords, by section: the key users write -> the schema's field name. The one
#: place where a key and its field's name differ (`gpujobs.config.load` renames going in, `to_dict` going out).
KEY_ALIASES: dict[str, dict[str, str]] = {"checkpoint": {"async": "background"}}


@dataclass
class CheckpointConfig(Checked):
    """When checkpoints are written and how many are kept."""

    every_steps: int = field(default=100, metadata=bounds(ge=0))
    """Save every N optimizer steps (0: only at the end)."""
    keep: int = field(default=2, metadata=bounds(ge=1))
    """Complete checkpoints kept; older ones are deleted after a newer one is complete."""
    resume: bool = True
    """Start from the newest complete checkpoint in the run dir, if any. false: this submission starts
    from scratch, refused where the run dir holds checkpoints; its own later attempts (a requeue, a
    restart) still resume from what it saved."""
    background: bool = False
    """Key `checkpoint.async`: periodic saves block training only while the state is copied to host memory;
    writing, fsync, verification and publishing run in the background (one in flight). A save at a
    preemption or at the end is synchronous."""


@dataclass
class TelemetryConfig(Checked):
    """GPU telemetry, straggler detection and the Prometheus endpoint."""

    gpu: bool = True
    """Sample the node's GPUs (NVML) into gpu.<node>.jsonl, one sampler and one file per node."""
    interval_s: float = field(default=5.0, metadata=bounds(gt=0, le=MAX_WAIT_S))
    """Seconds between GPU samples (at most 4,611,686,018 s: the sampler's wait counts nanoseconds in 64 bits)."""
    imbalance_threshold: float = field(default=1.25, metadata=bounds(ge=1))
    """Warn when the slowest rank's local step time (data wait + forward) exceeds the median by this factor."""
    prometheus_port: Optional[int] = field(default=None, metadata=bounds(ge=0, le=65535, note="0: a free port"))
    """Rank 0 serves metrics for Prometheus on this port (null: off; 0: a free port, see prometheus.json)."""
    prometheus_addr: str = field(
        default="127.0.0.1",
        metadata=bounds(valid=is_host, allowed="an IPv4 or IPv6 address or a host name, not a dotted all-numeric "
                                               "one (0.0.0.0 or '': every interface)"),
    )
    """Address the Prometheus endpoint listens on: loopback by default, so the job's metrics are not
    served to the whole network unasked; 0.0.0.0 lets another host scrape it."""
    prometheus_linger_s: float = field(default=0.0, metadata=bounds(ge=0, le=MAX_WAIT_S))
    """Keep the endpoint up this many seconds after training, so a last scrape sees the final values (a sleep)."""
    prometheus_sd_dir: Optional[str] = None
    """Also announce the endpoint as a Prometheus file_sd target in this directory (one `gpujobs-*.json` per
    run, removed when the endpoint closes), so a Prometheus whose `file_sd_configs` globs over it finds the
    job. null: none. Made absolute at submit; it must exist and be writable, and, as it may be shared, no one
    else may replace files in it: writable by group or others only if sticky (like /tmp, or a team directory
    made with `chmod 1770`). Slurm jobs need it on storage the nodes and the Prometheus host share."""
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
    allowed = "an existing directory this user may write, writable by no one else unless sticky (chmod +t, like /tmp)"
    path = Path(text).expanduser().resolve()
    try:
        mode = path.stat().st_mode if text else 0
    except OSError:
        mode = 0
    # open to others: any of them could rename a file of theirs over a job's target and have Prometheus
    # scrape their address
    if not stat.S_ISDIR(mode) or open_to_others(mode) or not os.access(path, os.W_OK | os.X_OK):
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


def _plain_values(items: list[tuple[str, Any]]) -> dict[str, Any]:
    """`dataclasses.asdict`'s dict, a choice (`gpujobs.config.modes`) as its plain value."""
    return {name: value.value if isinstance(value, Enum) else value for name, value in items}


#: The sections every job has, by key, with their schemas (model and data are plug-ins: `_target_`).
SECTIONS: dict[str, type[Any]] = {
    "cluster": ClusterConfig,
    "resources": ResourcesConfig,
    "nccl": NcclSettings,
    "optim": OptimConfig,
    "trainer": TrainerConfig,
    "checkpoint": CheckpointConfig,
    "telemetry": TelemetryConfig,
    "container": ContainerConfig,
    "parallel": ParallelConfig,
}
PLUGINS = ("model", "data")
#: What a file_sd target's name adds to the job name: `gpujobs-NAME-<16 hex>.json`, and `-<16 hex>` more
#: where a squatter holds that name (`gpujobs.rank.observe.prometheus.FileSdTarget`); the whole must fit NAME_MAX.
FILE_SD_NAME_EXTRA = len("gpujobs--0123456789abcdef-0123456789abcdef.json")


@dataclass
class JobConfig(Checked):
    """A whole job: every section, validated."""

    name: str = field(default="job", metadata=bounds(pattern=DIR_NAME, allowed=DIR_NAME_TEXT))
    """Job name (Slurm job name; a directory of the default run dir, `outputs/NAME/...`)."""
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
    container: ContainerConfig = field(default_factory=ContainerConfig)
    """The image the ranks run in (`container=none|pyxis|apptainer|charliecloud|podman|oci`)."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the model is spread over the ranks (`parallel=ddp|torchrec`)."""
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
        if self.telemetry.prometheus_sd_dir is not None and len(self.name) > NAME_MAX - FILE_SD_NAME_EXTRA:
            raise ConfigError(
                "name", self.name,
                f"at most {NAME_MAX - FILE_SD_NAME_EXTRA} characters with telemetry.prometheus_sd_dir set (its "
                f"file_sd target gpujobs-NAME-<hash>.json must fit Linux's {NAME_MAX}-byte file name)",
            )
        self._check_shares()
        check_torchrec(self)
        for key in PLUGINS if self.script is None else ():  # a plug-in's rules across sections; a script has none
            check = getattr(getattr(self, key), "check_job", None)
            if check is not None:
                check(self)

    def _check_shares(self) -> None:
        """Static shares are one weight per rank of the one world size the job can start at."""
        shares, res = self.trainer.balance_shares, self.resources
        if self.trainer.balance != Balance.static or not shares:
            return
        if res.least_nodes < res.nodes:
            sizes = f"{res.least_nodes * res.ranks_per_node} to {res.world_size}"
            raise ConfigError(
                "trainer.balance_shares", shares,
                f"none for an elastic job (resources.min_nodes={res.min_nodes} < nodes={res.nodes}: it starts at "
                f"{sizes} ranks, as Slurm allocates, and one list has one length): balance_gpu_weights or "
                "trainer.balance=dynamic",
            )
        if len(shares) != res.world_size:
            raise ConfigError("trainer.balance_shares", shares, f"one weight per rank ({res.world_size} ranks)")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the resolved config (what config.yaml holds): keys as users write them, a choice as
        its value."""
        out = dataclasses.asdict(self, dict_factory=_plain_values)
        for section, aliases in KEY_ALIASES.items():
            out[section] = {next((k for k, f in aliases.items() if f == name), name): v
                            for name, v in out[section].items()}
        for key in PLUGINS:
            out[key] = dataclasses.asdict(getattr(self, key), dict_factory=_plain_values)
        if self.script is None:
            out.pop("script")
        return out

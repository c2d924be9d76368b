"""The config's fixed choices, one `StrEnum` each (torch-free).

A field typed with one of these takes its members' values and nothing else: `gpujobs.config.validate` turns
the text a config holds into the member (refusing any other in one line that lists the values), and
`JobConfig.to_dict` writes the value back, so config.yaml and `--cfg job` read as plain text. A member is a
`str`: `cfg.balance == "dynamic"` holds, and it prints as its value, `repr` included (an error message says
`logger='mlflow'`, as it did when the field was text). The members are named by their values (OmegaConf's
merge knows an enum's members by name).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Optional


class Choice(StrEnum):
    """A fixed choice of the config: a `str` that is one of its members' values."""

    def __repr__(self) -> str:
        return repr(self.value)


class Balance(Choice):
    """`trainer.balance`: how each step's global batch is split across ranks."""

    off = "off"
    static = "static"
    dynamic = "dynamic"
    replay = "replay"


class Amp(Choice):
    """`trainer.amp`: mixed precision."""

    auto = "auto"
    bf16 = "bf16"
    off = "off"


class Optimizer(Choice):
    """`optim.name`."""

    adam = "adam"
    adamw = "adamw"
    sgd = "sgd"


class Schedule(Choice):
    """`optim.schedule`: the learning rate after warm-up."""

    constant = "constant"
    cosine = "cosine"
    linear = "linear"


class NcclPreset(Choice):
    """`nccl.preset`: the `nccl=` group option the settings came from."""

    default = "default"
    ethernet = "ethernet"
    infiniband = "infiniband"
    debug = "debug"


class NcclDebug(Choice):
    """`nccl.debug` (NCCL_DEBUG), taken in any case as NCCL does (`info` is INFO)."""

    VERSION = "VERSION"
    WARN = "WARN"
    INFO = "INFO"
    TRACE = "TRACE"

    @classmethod
    def _missing_(cls, value: Any) -> Optional[NcclDebug]:
        return cls.__members__.get(value.upper()) if isinstance(value, str) else None


class Tracker(Choice):
    """An experiment tracker `logger` may select (`logger=none|tensorboard|mlflow`, or a list)."""

    tensorboard = "tensorboard"
    mlflow = "mlflow"


class Runtime(Choice):
    """`container=`: the runtime the ranks' step runs in (`none`: the submitting Python, no container)."""

    none = "none"
    pyxis = "pyxis"
    apptainer = "apptainer"
    charliecloud = "charliecloud"
    podman = "podman"
    oci = "oci"


class Parallel(Choice):
    """`parallel=`: how the model is spread over the ranks."""

    ddp = "ddp"
    torchrec = "torchrec"


class TableOptimizer(Choice):
    """`optim.table_optimizer`: the optimizer fused into the tables' backward under `parallel=torchrec`."""

    rowwise_adagrad = "rowwise_adagrad"
    adam = "adam"
    sgd = "sgd"

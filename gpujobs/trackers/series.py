"""What the trackers log, named once for all of them: series from metrics records and GPU samples, the
config as flat params, and the history an attempt replays (torch-free).

Series names: `train/loss`, `train/lr`, `train/samples_per_s`, `train/imbalance`, `train/slowest_rank`;
`timing/<step_time_s|local_time_s|data_time_s>/<max|median>` and, up to `RANK_SERIES` ranks, `.../rank_<r>`
(plus `balance/rows/rank_<r>` and `balance/compute_s_per_sample/rank_<r>` where balancing uses them);
`eval/<metric>`; `gpu/<node>/gpu<i>/<reading>` (every numeric field of a gpu.jsonl sample, and
`throttle_reasons`, how many NVML reports).
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any, Union

from gpujobs.rundir.gpu_files import GpuFilesTail
from gpujobs.rundir.records import EvalRecord, TrainRecord, read_metrics

#: Per-rank series are logged for jobs of up to this many ranks; larger ones log max and median only
#: (an MLflow batch holds at most 1000 values, and a thousand per-rank lines help no one).
RANK_SERIES = 64
#: Fields of a gpu.jsonl sample that say where it is, not what it reads.
_GPU_IDENTITY = ("time", "node", "rank", "gpu", "cuda_index", "uuid", "xid")
#: What a series or param name may hold (MLflow's rule for keys; TensorBoard takes any): anything else is `_`.
_NOT_IN_NAME = re.compile(r"[^\w\-. /]")


def clean_name(text: str) -> str:
    """`text` with what a series or param name may not hold replaced by `_` (`model@m` -> `model_m`)."""
    return _NOT_IN_NAME.sub("_", text)


def series_name(*parts: str) -> str:
    """`a/b/c` from parts that may hold any text (a task's metric name, a node's name)."""
    return "/".join(clean_name(part) for part in parts)

StepRecord = Union[TrainRecord, EvalRecord]


def values_of(record: StepRecord) -> dict[str, float]:
    """The series a record adds at its step."""
    if isinstance(record, EvalRecord):
        return {series_name("eval", name): value for name, value in record.metrics.items()}
    out: dict[str, float] = {}
    for name, per_rank in (("step_time_s", record.step_time_s), ("local_time_s", record.local_time_s),
                           ("data_time_s", record.data_time_s)):
        if per_rank:
            out[f"timing/{name}/max"] = max(per_rank)
            out[f"timing/{name}/median"] = statistics.median(per_rank)
            if len(per_rank) <= RANK_SERIES:
                out.update({f"timing/{name}/rank_{rank}": value for rank, value in enumerate(per_rank)})
    if record.balance not in (None, "off") and len(record.counts) <= RANK_SERIES:
        out.update({f"balance/rows/rank_{rank}": float(rows) for rank, rows in enumerate(record.counts)})
    if len(record.compute_s_per_sample) <= RANK_SERIES:
        out.update({f"balance/compute_s_per_sample/rank_{rank}": value
                    for rank, value in enumerate(record.compute_s_per_sample)})
    if record.lr is not None:
        out["train/lr"] = record.lr
    out["train/samples_per_s"] = record.samples_per_s
    if record.imbalance is not None:
        out["train/imbalance"] = record.imbalance
    if record.slowest_rank is not None:
        out["train/slowest_rank"] = float(record.slowest_rank)
    out["train/loss"] = record.loss
    return out


def history(run_dir: Path, before_step: int) -> list[StepRecord]:
    """The train and eval records of earlier attempts below `before_step`, oldest step first: for each
    (kind, step) the last one written (an attempt that trained a step again after a crash wrote it again)."""
    latest: dict[tuple[str, int], StepRecord] = {}
    for record in read_metrics(run_dir):
        if isinstance(record, (TrainRecord, EvalRecord)) and record.step < before_step:
            latest[(record.kind, record.step)] = record
    # train before eval at the same step, as the trainer logs them
    return [latest[key] for key in sorted(latest, key=lambda key: (key[1], key[0] != "train"))]


def flat_config(config: dict[str, Any]) -> dict[str, Union[str, float, bool]]:
    """The resolved config as `section.key` params: numbers and booleans as they are, lists and maps as JSON,
    null as "null"."""
    out: dict[str, Union[str, float, bool]] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        elif isinstance(node, (bool, int, float, str)):
            out[prefix] = node
        else:
            out[prefix] = json.dumps(node)

    walk(config, "")
    return out


class GpuTail:
    """The GPU samples appended to the run dir's files (`gpu.<node>.jsonl`, a node each) since the attempt began;
    `read` returns the newest reading of each GPU as series."""

    def __init__(self, tail: GpuFilesTail) -> None:
        self._tail = tail

    @classmethod
    def from_now(cls, run_dir: Path) -> GpuTail:
        """Start at the files' ends: earlier attempts' samples were theirs to log."""
        return cls(GpuFilesTail(run_dir))

    def read(self) -> dict[str, float]:
        """The newest reading of each GPU sampled since the last call, as `gpu/<node>/gpu<i>/<field>` series."""
        latest: dict[tuple[str, str], dict[str, Any]] = {}
        for sample in self._tail.poll():
            latest[(str(sample.get("node")), str(sample.get("gpu")))] = sample
        out: dict[str, float] = {}
        for (node, gpu), sample in sorted(latest.items()):
            prefix = series_name("gpu", node, f"gpu{gpu}")
            for name, value in sample.items():
                if name not in _GPU_IDENTITY and isinstance(value, (int, float)) and not isinstance(value, bool):
                    out[f"{prefix}/{name}"] = float(value)
            if isinstance(sample.get("throttle"), list):
                out[f"{prefix}/throttle_reasons"] = float(len(sample["throttle"]))
        return out



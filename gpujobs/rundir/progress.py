"""Show a job's progress from its metrics records (torch-free: used on both sides)."""

from __future__ import annotations

import sys
from typing import Any, Optional, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from gpujobs.rundir.records import (
    CheckpointRecord,
    EvalRecord,
    HealthRecord,
    MetricsRecord,
    PlanRecord,
    TrainRecord,
    metrics_record,
)


def describe(record: MetricsRecord) -> str:
    """One short line for a metrics record."""
    if isinstance(record, EvalRecord):
        metrics = " ".join(f"{k} {v:.4f}" for k, v in record.metrics.items())
        return f"step {record.step}: eval {metrics}"
    if isinstance(record, PlanRecord):
        shares = "/".join(f"{share:.2f}" for share in record.shares)
        return f"step {record.step}: plan {record.mode} ({record.reason}) shares {shares}"
    if isinstance(record, CheckpointRecord):
        return f"step {record.step}: checkpoint blocked training {record.blocking_s:.3f} s"
    if isinstance(record, HealthRecord):
        bandwidth = f", all-reduce {record.busbw_gbps:.3g} GB/s" if record.busbw_gbps is not None else ""
        return f"health check {'passed' if record.healthy else 'failed'} in {record.health_s:.2f} s{bandwidth}"
    return f"step {record.step} loss {record.loss:.4f} {record.samples_per_s:.0f} samples/s"


class ProgressView:
    """A progress bar on a terminal, plain lines elsewhere (logs, CI, pipes)."""

    def __init__(self, total_steps: int, label: str, stream: Optional[TextIO] = None, enabled: bool = True) -> None:
        self.stream = stream or sys.stdout
        self.total = total_steps
        self.label = label
        self.enabled = enabled
        self._bar: Optional[Progress] = None
        self._task: Any = None
        if enabled and self.stream.isatty():
            console = Console(file=self.stream)
            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
                console=console,
                transient=False,
            )
            self._task = self._bar.add_task(label, total=total_steps, info="")
            self._bar.start()

    def update(self, line: MetricsRecord | dict[str, Any]) -> None:
        """Take one metrics record (train or eval), or a metrics.jsonl line as read; any other (a plan, a
        checkpoint, a health check, a line that holds no record) is passed over."""
        record = metrics_record(line) if isinstance(line, dict) else line
        if not self.enabled or not isinstance(record, (TrainRecord, EvalRecord)):
            return
        if self._bar is not None:
            if isinstance(record, EvalRecord):
                self._bar.console.print(describe(record))
            else:
                self._bar.update(self._task, completed=record.step, info=describe(record))
            return
        print(f"[{self.label}] {describe(record)}", file=self.stream, flush=True)

    def close(self) -> None:
        """Stop the bar (leaving its last state on screen)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

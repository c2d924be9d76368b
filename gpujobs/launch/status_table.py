"""`status`'s table: one row per point, readable at any terminal width (submit side, torch-free).

The cells come from each run dir's files (`attempts.jsonl`, `metrics.jsonl`, `result.json`) and the
point's Slurm state (`manage.refresh`); the caption adds the nodes a job excludes and the container image
its last attempt ran in (the ledger's `image`, with its `image_id` where the runtime reported one). The
layout is worked out when the table is printed, for the terminal it is printed on.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpujobs.launch.manage import PointState, current_result
from gpujobs.rundir.attempts import AttemptLog
from gpujobs.rundir.records import EvalRecord, TrainRecord, read_metrics


def progress(run_dir: Path) -> tuple[str, str]:
    """(last step, last metric): the result's AUC when there is a current one (not that of a run trained
    further since, `current_result`), else the last logged loss."""
    result = current_result(run_dir)
    # plan and checkpoint records say nothing of how far training got in loss or AUC
    records = [r for r in read_metrics(run_dir) if isinstance(r, (TrainRecord, EvalRecord))]
    last = records[-1] if records else None
    step = result.steps if result is not None and result.steps is not None else last.step if last else ""
    if result is not None and "auc" in result.metrics:
        return str(step), f"auc={result.metrics['auc']:.4f}"
    if isinstance(last, EvalRecord) and "auc" in last.metrics:
        return str(step), f"auc={last.metrics['auc']:.4f}"
    return str(step), f"loss={last.loss:.4f}" if isinstance(last, TrainRecord) else ""


def attempts_text(run_dir: Path) -> str:
    """How many attempts ran, why the last one ended, and each one's world size where the ledger has it
    (`3 (completed) world 4→2→2`; `?` for an attempt recorded without one)."""
    attempts = AttemptLog(run_dir).read()
    if not attempts:
        return "0"
    text = f"{len(attempts)} ({attempts[-1].reason})"
    sizes = [str(a.world_size) if a.world_size is not None else "?" for a in attempts]
    return text if set(sizes) == {"?"} else f"{text} world {'→'.join(sizes)}"


def excluded_nodes(run_dir: Path) -> list[str]:
    """The nodes the run's current Slurm job excludes after hangs or failed health checks (with
    `cluster.exclude`): the last list its attempts recorded. An earlier job's list does not carry over."""
    attempts = AttemptLog(run_dir).read()
    current = attempts[-1].job_id if attempts else None
    lists = [a.excluded for a in attempts if a.excluded and a.job_id == current]
    return lists[-1] if lists else []


def image_text(run_dir: Path) -> str:
    """The container image the run's last attempt that names one ran in (`rec:1 (id 0123456789ab)` where
    the runtime reported its ID), or "" for a run without one, or none recorded yet."""
    named = [a for a in AttemptLog(run_dir).read() if a.image]
    if not named:
        return ""
    last = named[-1]
    image_id = (last.image_id or "").removeprefix("sha256:")
    return f"{last.image} (id {image_id[:12]})" if image_id else str(last.image)


def world_size_now(run_dir: Path) -> str:
    """The run's world size: the current result's once it has one, else that of the attempt whose
    training records came last (the one running, or the last that ran: the ranks of its last logged
    window), else the last attempt's; `-` when nothing says."""
    result = current_result(run_dir)
    if result is not None and result.world_size is not None:
        return str(result.world_size)
    for record in reversed(read_metrics(run_dir)):
        if isinstance(record, TrainRecord) and record.step_time_s:
            return str(len(record.step_time_s))
    attempts = AttemptLog(run_dir).read()
    return str(attempts[-1].world_size) if attempts and attempts[-1].world_size is not None else "-"


#: The status table's columns; those in `_WRAPS` wrap at spaces, the others never wrap.
_COLUMNS = ("point", "overrides", "job id", "state", "world", "attempts", "step", "metric")
_WRAPS = ("overrides", "state", "attempts")
#: What a narrow terminal hides, in this order (after any of them that is empty for every point): the
#: world size is also in the attempts' history, the job id in the run dir; state and metric always stay.
_HIDE_ORDER = ("world", "job id", "attempts", "step")
#: Columns are hidden until the overrides get this many characters (fewer if their longest is shorter).
_OVERRIDES_MIN = 20


def status_table(points: list[PointState]) -> Any:
    """A rich renderable: one row per point, laid out for the width it is printed at (`StatusTable`)."""
    # Only what tells the points apart: overrides every point shares go in the title.
    shared = set.intersection(*(set(p.overrides) for p in points)) if len(points) > 1 else set()
    # below the table, not a column: a node list would squeeze every other column of an 80-column table
    excluded = [(p, nodes) for p in points if (nodes := excluded_nodes(p.run_dir))]
    caption = "; ".join(f"{_label(p)}{', '.join(nodes)}" for p, nodes in excluded)
    cells: dict[str, list[str]] = {name: [] for name in _COLUMNS if name != "overrides"}
    for point in points:
        step, metric = progress(point.run_dir)
        row = ("-" if point.num is None else str(point.num), point.job_id or "-", point.state,
               world_size_now(point.run_dir), attempts_text(point.run_dir), step, metric)
        for name, cell in zip(cells, row, strict=True):
            cells[name].append(cell)
    return StatusTable(
        title=[o for o in points[0].overrides if o in shared],
        overrides=[[o for o in p.overrides if o not in shared] or [p.run_dir.name] for p in points],
        cells=cells, notes=([f"excluded nodes: {caption}"] if caption else []) + _image_notes(points),
    )


def _label(point: PointState) -> str:
    """How a caption names a point of a sweep ("#3 "; "" for a single run)."""
    return "" if point.num is None else f"#{point.num} "


def _image_notes(points: list[PointState]) -> list[str]:
    """The caption's image line, where attempts name one: the image every point ran in last, or each
    point's where they differ (a sweep over `container.image`)."""
    images = [(p, text) for p in points if (text := image_text(p.run_dir))]
    if not images:
        return []
    if len({text for _, text in images}) == 1 and len(images) == len(points):
        return [f"image: {images[0][1]}"]
    return ["image: " + "; ".join(f"{_label(p)}{text}" for p, text in images)]


@dataclass
class StatusTable:
    """The status table's cells, laid out only when printed: then the width is known.

    Where the whole table does not fit, override keys are shortened (`shorten_keys`), then the columns
    of `_HIDE_ORDER` are hidden until the overrides column is wide enough to wrap between overrides (one
    still longer than the column breaks after its `=`); the caption names what was hidden.
    """

    title: list[str]
    """The overrides every point shares."""
    overrides: list[list[str]]
    """Each point's own overrides (its run dir's name when it has none)."""
    cells: dict[str, list[str]]
    """Every other column's cells, by column."""
    notes: list[str]
    """Caption lines."""

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield self.render(options.max_width)

    def render(self, width: int) -> Any:
        """The rich Table for a terminal `width` columns wide."""
        from rich.cells import cell_len
        from rich.table import Table

        cells = {"overrides": [" ".join(row) for row in self.overrides], **self.cells}
        widths: dict[str, int] = {}
        hidden: list[str] = []
        if _table_width(cells, cells, full=True) > width:
            short = shorten_keys([self.title, *self.overrides])[1:]
            cells["overrides"] = [" ".join(row) for row in short]
            widths, hidden = _fit(cells, width)
            # one too wide for the column breaks after its `=` (no space in it to wrap at), not anywhere
            cells["overrides"] = [" ".join(o.replace("=", "= ", 1) if cell_len(o) > widths["overrides"] else o
                                           for o in row) for row in short]
        notes = [f"hidden to fit {width} columns: {', '.join(hidden)}"] if hidden else []
        table = Table(title=" ".join(self.title) or None, caption="\n".join(notes + self.notes) or None,
                      caption_justify="left")
        shown = [name for name in _COLUMNS if name not in hidden]
        for name in shown:
            table.add_column(name, width=widths.get(name), no_wrap=name not in _WRAPS, overflow="fold")
        for index in range(len(self.overrides)):
            table.add_row(*(cells[name][index] for name in shown))
        return table


def shorten_keys(rows: list[list[str]]) -> list[list[str]]:
    """Each override's key cut to the shortest dotted tail that no other key of `rows` ends with:
    `optim.lr=0.1` becomes `lr=0.1`, while `model.dim` and `data.dim` stay whole."""

    def parts(override: str) -> tuple[str, str, str]:
        body = override.lstrip("+~")
        key, sep, value = body.partition("=")
        return override[: len(override) - len(body)], key, sep + value

    keys = {parts(o)[1] for row in rows for o in row}

    def tail(key: str) -> str:
        names = key.split(".")
        for n in range(1, len(names)):
            short = ".".join(names[-n:])
            if not any(other != key and (other == short or other.endswith("." + short)) for other in keys):
                return short
        return key

    return [[prefix + tail(key) + rest for prefix, key, rest in map(parts, row)] for row in rows]


def _column_width(name: str, cells: list[str], *, full: bool) -> int:
    """The width of a column's longest cell (or header); unless `full`, of its longest word, for a
    column that wraps."""
    from rich.cells import cell_len

    texts = [name, *cells]
    if full or name not in _WRAPS:
        return max(cell_len(text) for text in texts)
    return max(cell_len(word) for text in texts for word in text.split() or [""])


def _table_width(cells: dict[str, list[str]], shown: Collection[str], *, full: bool) -> int:
    """The width of a table of the `shown` columns: contents, one space of padding each side, borders."""
    return sum(_column_width(name, cells[name], full=full) for name in shown) + 3 * len(shown) + 1


def _fit(cells: dict[str, list[str]], width: int) -> tuple[dict[str, int], list[str]]:
    """Column widths for a `width`-column table, and the columns hidden to get there (see StatusTable)."""
    empty = [name for name in _HIDE_ORDER if all(cell in ("", "-") for cell in cells[name])]
    order = empty + [name for name in _HIDE_ORDER if name not in empty]
    shown, hidden = list(_COLUMNS), []
    wanted = min(_column_width("overrides", cells["overrides"], full=False), _OVERRIDES_MIN)
    while True:
        others = [name for name in shown if name != "overrides"]
        space = width - _table_width(cells, others, full=False) - 3
        if space >= wanted or not order:
            break
        hidden.append(order.pop(0))
        shown.remove(hidden[-1])
    widths = {name: _column_width(name, cells[name], full=False) for name in others}
    widths["overrides"] = max(1, min(space, _column_width("overrides", cells["overrides"], full=True)))
    spare = space - widths["overrides"]
    for name in (n for n in _WRAPS if n in others):  # what is left lets state and attempts wrap less
        grow = min(spare, _column_width(name, cells[name], full=True) - widths[name])
        widths[name] += grow
        spare -= grow
    return widths, hidden

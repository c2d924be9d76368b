"""The `gpujobs cost` table: one row per point and one per unit's total, within 80 columns (rich).

Each part is a share of its row's hours; the JSON (`gpujobs.cli.cost.to_json`) has the unit-seconds.
"""

from __future__ import annotations

from typing import Any

from gpujobs.cli.cost import UNACCOUNTED

#: The table's columns after point, source and hours: each a share of the row's hours, and its parts.
COLUMNS = {
    "train": ("training",), "redo": ("redone",), "ckpt": ("checkpoint",), "eval": ("eval",),
    "start": ("launch", "startup", "health"), "hung": ("hung",), "stop": ("stopping", "teardown"),
    "unacc": (UNACCOUNTED,),
}
LEGEND = (
    "% of each row's hours: train steps that counted, redo steps redone after a failure, ckpt checkpoint "
    "blocking, eval evaluations, start launch + start-up + health check, hung hung before detection, "
    "stop stopping + teardown, unacc not accounted for"
)


def _hours(hours: float) -> str:
    """At most 6 characters (below 99 999 500 hours)."""
    if hours >= 100_000:
        return f"{hours / 1000:.0f}k"
    return f"{hours:.0f}" if hours >= 100 else f"{hours:.2f}" if hours >= 1 else f"{hours:.4f}"


def _share(percent: float) -> str:
    """At most 5 characters: one decimal where it fits (a part beyond -10..100 % is a finding, not a digit)."""
    return f"{percent:.1f}" if -10 < percent < 100 else f"{percent:.0f}"


def table(document: dict[str, Any]) -> Any:
    """A rich table of `to_json`'s document that fits 80 columns: one row per point, one per unit's total."""
    from rich import box
    from rich.table import Table

    units = sorted(t["unit"] for t in document["totals"])
    hours = f"{units[0].upper()}-h" if len(units) == 1 else "hours"
    # no edges, a space and the separator between columns: 5-character shares, 6-character hours and
    # 5-character labels stay within 80 columns
    grid = Table(title=f"cost of {document['dir']}", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                 padding=(0, 1, 0, 0))
    for name in ("point", "src", hours, *COLUMNS):
        grid.add_column(name, justify="left" if name in ("point", "src") else "right", no_wrap=True)
    sources = {"sacct": "sacct", "attempts": "local", "sacct+attempts": "both", "none": "-"}
    rows = [("-" if p["point"] is None else str(p["point"]), sources[p["source"]], p) for p in document["points"]]
    rows += [("total", t["unit"], t) for t in document["totals"]]
    for number, (label, source, row) in enumerate(rows):
        # mixed units: each row says its own (g or c)
        cells = [_hours(row["hours"]) + (f" {row['unit'][0]}" if len(units) > 1 and row["unit"] else "")]
        for names in COLUMNS.values():
            value = sum(row["parts"][name] for name in names)
            cells.append(_share(100 * value / row["seconds"]) if row["seconds"] else "-")
        grid.add_row(label, source, *cells, end_section=number == len(document["points"]) - 1)
    return grid


def print_cost(document: dict[str, Any], console: Any) -> None:
    """Print the table, its legend and every point's notes on a rich `console`."""
    console.print(table(document))
    console.print(LEGEND, highlight=False)
    for point in document["points"]:
        for note in point["notes"]:
            console.print(f"point {'-' if point['point'] is None else point['point']}: {note}", highlight=False)

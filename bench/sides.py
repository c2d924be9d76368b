"""What every bench asks of each side it times: that the side did its work (the jobs queued, the steps
trained). A side that failed at once is fast, and timed as a result it would make the other side look slow
or fast; so instead the bench stops, one line naming the side and why, exit 1 (`SystemExit`'s message).

Imported by the benches as `sides` (each runs as `python bench/bench_X.py`, with bench/ first on the path).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn


def last_line(text: str) -> str:
    """The last non-empty line of a command's output (where a traceback or a gpujobs error says why)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def fail(side: str, why: str) -> NoReturn:
    """Stop the bench: `side` did not do its work (exit 1, one line on stderr)."""
    raise SystemExit(f"{Path(sys.argv[0]).stem}: {side} failed: {why}")


def expect(side: str, done: bool, why: str) -> None:
    """`fail(side, why)` unless `done`."""
    if not done:
        fail(side, why)


def ran(side: str, cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run `cmd` (output captured as text); a non-zero exit fails `side`, naming its last line of output."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, check=False, **kwargs)
    if proc.returncode != 0:
        fail(side, f"{' '.join(cmd[:4])} ... exited {proc.returncode}: {last_line(proc.stderr or proc.stdout)}")
    return proc

"""What a submit says last: where its outputs went and the commands that read them (torch-free).

A new user's next question after a submit is "where is it, and how do I look at it": every submit (a run,
a sweep, queued or run here) ends with its directory and the `gpujobs` lines that answer, each one a line
to copy. A path under the submit directory is written relative to it, as the user would type it there.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path


def shown(path: Path) -> str:
    """`path` as a command line takes it: relative to the working directory where it lies under it, quoted."""
    absolute, here = path.absolute(), Path.cwd()
    text = os.path.relpath(absolute, here) if here in absolute.parents else str(absolute)
    return shlex.quote(text)


def next_steps(target: Path, *, queued: bool, sweep: bool = False) -> str:
    """The closing lines of a submit of `target` (a run dir, or with `sweep` a sweep dir): the directory, then
    one command a line. `queued`: the job waits in a scheduler's queue (it may be followed and cancelled)."""
    where = shown(target)
    point = " --point 0" if sweep else ""
    commands = [f"gpujobs status {where}" + (" --watch 10" if queued else ""),
                f"gpujobs logs {where}{point} --rank 0" + (" --follow" if queued else "")]
    if queued:
        commands.append(f"gpujobs cancel {where}")
    commands.append(f"gpujobs cost {where}" if sweep else f"gpujobs report {where}")
    kind = "sweep dir" if sweep else "run dir"
    return "\n".join([f"gpujobs: {kind} {target.absolute()}; next:", *(f"  {line}" for line in commands)])

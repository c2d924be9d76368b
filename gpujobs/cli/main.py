"""`gpujobs COMMAND ...`: the one command; each subcommand is one of the `python -m` entry points.

`gpujobs submit ...` is `python -m gpujobs.submit ...` (Hydra's flags and `-m` included),
`gpujobs prepare ...` is `python -m gpujobs.prepare ...`, `gpujobs plan ...` is `python -m gpujobs.plan ...`,
`gpujobs status|logs|cancel|resubmit|cost ...` is `python -m gpujobs ...`, and `gpujobs report ...` is
`python -m gpujobs.report ...`: the same arguments, output and exit codes. A later subcommand is one more
entry in `COMMANDS`. Only the chosen subcommand's module is imported, so `gpujobs --help` stays fast
(no Hydra, no torch).
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Optional

PROG = "gpujobs"
DESCRIPTION = "Hydra config -> preemption-safe PyTorch DDP jobs, on Slurm or on this machine."
#: `gpujobs` without a subcommand, or with one it does not know: the usage on stderr.
EXIT_BAD_INPUT = 2


@dataclass(frozen=True)
class Command:
    """One subcommand of `gpujobs`."""

    summary: str
    """Its line in `gpujobs --help` (and in `python -m gpujobs --help` for the management commands)."""
    target: str
    """`module:function`, imported when the subcommand runs: called as `function(argv, prog)`, it returns
    the exit code (None: 0) or raises SystemExit."""
    named: bool = False
    """The function is a parser of several subcommands (`gpujobs.__main__`): argv starts with the name."""


COMMANDS: dict[str, Command] = {
    "submit": Command("compose and validate a config, then run or queue the job (-m: sweep)", "gpujobs.submit:main"),
    "status": Command("a table of the points: job id, state, attempts, step, metric",
                      "gpujobs.__main__:main", named=True),
    "logs": Command("a rank's log of a point", "gpujobs.__main__:main", named=True),
    "cancel": Command("scancel every point, or one", "gpujobs.__main__:main", named=True),
    "resubmit": Command("queue the failed points again, as one new array", "gpujobs.__main__:main", named=True),
    "cost": Command("where the GPU-hours went: per point and in total", "gpujobs.__main__:main", named=True),
    "report": Command("PNG plots of a run and a short text summary", "gpujobs.report:main"),
    "prepare": Command("prepare raw input files into a sample store (data.store), once", "gpujobs.prepare:main"),
    "plan": Command("will the model fit: where each table goes, the bytes a rank holds", "gpujobs.plan:main"),
}


def usage() -> str:
    """`gpujobs --help`: one line per subcommand, within 80 columns."""
    width = max(len(name) for name in COMMANDS)
    lines = [f"usage: {PROG} COMMAND [ARGS...]", "", DESCRIPTION, "", "commands:"]
    lines += [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
    lines += ["", f"`{PROG} COMMAND --help`: its arguments (submit's are Hydra's: overrides, -m)"]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """Run one subcommand; returns its exit code (2 for an unknown one, with one line naming it)."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else EXIT_BAD_INPUT
    if args[0] == "--version":
        from gpujobs import __version__

        print(f"{PROG} {__version__}")
        return 0
    name, rest = args[0], args[1:]
    command = COMMANDS.get(name)
    if command is None:
        from gpujobs.base.errors import ConfigError

        print(f"{PROG}: {ConfigError('command', name, 'one of ' + ', '.join(COMMANDS))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    module, _, function = command.target.partition(":")
    run = getattr(importlib.import_module(module), function)
    code = run([name, *rest], PROG) if command.named else run(rest, f"{PROG} {name}")
    return 0 if code is None else int(code)


if __name__ == "__main__":
    raise SystemExit(main())

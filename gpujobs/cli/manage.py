"""`python -m gpujobs status|logs|cancel|resubmit|cost DIR`: watch and manage submitted runs and sweeps.

DIR is a run dir or a sweep dir (`-m`). Exit codes: 0 done, 1 nothing matched or a command failed,
2 bad input. `status --watch` and `logs --follow` end once every point is final: Slurm says so or,
when `sacct` cannot be asked, the run dirs' files do.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from gpujobs.base.errors import GpujobsError, SchedulerError
from gpujobs.cli.main import COMMANDS
from gpujobs.config.schema import MAX_WAIT_S
from gpujobs.launch import manage

if TYPE_CHECKING:
    from gpujobs.launch.sweep import Outcome


def _seconds(text: str) -> float:
    """An option's seconds: a finite number > 0 (argparse turns the refusal into one line and exit 2)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_WAIT_S):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: allowed a number of seconds > 0")
    return value


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help=COMMANDS["status"].summary)
    status.add_argument("--watch", type=_seconds, metavar="S", help="redraw every S seconds until all are final")
    logs = commands.add_parser("logs", help=COMMANDS["logs"].summary)
    logs.add_argument("--point", type=int, default=0)
    logs.add_argument("--rank", type=int, default=0)
    logs.add_argument("--err", action="store_true", help="stderr instead of stdout")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    cancel = commands.add_parser("cancel", help=COMMANDS["cancel"].summary)
    cancel.add_argument("--point", type=int)
    resubmit = commands.add_parser("resubmit", help=COMMANDS["resubmit"].summary)
    resubmit.add_argument("--failed", action="store_true", required=True, help="the failed points (required)")
    resubmit.add_argument("--cancelled", action="store_true", help="also the cancelled points")
    cost = commands.add_parser("cost", help=COMMANDS["cost"].summary)
    cost.add_argument("--json", action="store_true", help="the JSON document instead of the table")
    for sub in (status, logs, cancel, resubmit, cost):
        sub.add_argument("dir", type=Path, help="a run dir or a sweep dir")
        sub.add_argument("--sacct-timeout", type=_seconds, default=10.0, metavar="S")
    return parser


def _status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from gpujobs.launch.status_table import status_table

    console = Console()
    while True:
        points = manage.points_of(args.dir)
        warning = manage.refresh(points, args.sacct_timeout)
        if warning:
            print(f"gpujobs: {warning}", file=sys.stderr)
        console.print(status_table(points))
        if not args.watch or all(p.final for p in points):
            return 0
        time.sleep(args.watch)


def _logs(args: argparse.Namespace) -> int:
    """A rank's log of a queued job (Slurm, Kubernetes) or of a run here (cluster=local: its last attempt's);
    `--follow` prints on until the job is final, moving to each new attempt's file of a run here."""
    point = manage.select(manage.points_of(args.dir), args.point)[0]
    path = manage.log_path(point, args.rank, err=args.err)
    if not args.follow:
        if path is None or not path.exists():
            raise GpujobsError(f"no log yet: {path or point.run_dir / 'submitit'} (rank {args.rank})")
        _print_from(path, 0, whole=True)
        return 0
    offset, warned = 0, False
    while True:
        now = manage.log_path(point, args.rank, err=args.err)
        if now != path:  # a run here started its next attempt: the last one's rest, then the new file
            if path is not None:
                _print_from(path, offset, whole=True)
            path, offset = now, 0
        if path is not None:
            offset = _print_from(path, offset, whole=False)
        warning = manage.refresh([point], args.sacct_timeout)
        if warning and not warned:
            print(f"gpujobs: {warning}", file=sys.stderr)
            warned = True
        if point.final and not manage.launcher_live(point):
            if path is not None:
                _print_from(path, offset, whole=True)  # what the job wrote while its state was asked
            if path is None or not path.exists():
                job = point.job_id or point.run_dir
                print(f"gpujobs: {job} ended ({point.state}) without writing the log of rank {args.rank}",
                      file=sys.stderr)
                return 1
            return 0
        time.sleep(1.0)


def _print_from(path: Path, offset: int, *, whole: bool) -> int:
    """Print `path` from byte `offset` on (nothing if it does not exist yet); returns the new offset.

    Unless `whole`, only up to the last newline: a line still being written (perhaps cut inside a
    character) is printed once complete.
    """
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            chunk = handle.read()
    except FileNotFoundError:
        return offset
    if not whole:
        chunk = chunk[: chunk.rfind(b"\n") + 1]
    sys.stdout.write(chunk.decode(errors="replace"))
    sys.stdout.flush()
    return offset + len(chunk)


def _cost(args: argparse.Namespace) -> int:
    import json

    from gpujobs.cli import cost

    costs = cost.cost_of(manage.points_of(args.dir), args.sacct_timeout)
    if not any(c.segments for c in costs):
        print(f"gpujobs: nothing to account in {args.dir}: no Slurm job started and no attempt recorded",
              file=sys.stderr)
        return 1
    document = cost.to_json(args.dir, costs)
    if args.json:
        print(json.dumps(document, indent=2))
        return 0
    from rich.console import Console

    from gpujobs.cli.cost_table import print_cost

    print_cost(document, Console())
    return 0


def _cancel(points: list[manage.PointState]) -> int:
    """Cancel, then say which ids were cancelled, had already ended, or could not be cancelled (exit 1)."""
    outcome = manage.cancel(points)
    if outcome.cancelled or not (outcome.ended or outcome.failed):
        print(f"gpujobs: cancelled {', '.join(outcome.cancelled) or 'nothing (no Slurm job)'}")
    for job_id, why in outcome.ended.items():
        print(f"gpujobs: {job_id} had already ended ({why})")
    for job_id, why in outcome.failed.items():
        print(f"gpujobs: could not cancel {job_id}: {why}", file=sys.stderr)
    return 1 if outcome.failed else 0


def _resubmitted(outcomes: list[Outcome], single: bool) -> int:
    """Say which points were queued or run again; 1 when none was, or one run here failed (a single
    run's launcher has said why)."""
    from gpujobs.launch.sweep import summary

    if not outcomes:
        print("gpujobs: no failed points to resubmit")
        return 1
    if any(o.code for o in outcomes):
        if not single:
            print(summary(outcomes), file=sys.stderr)
        return 1
    print(f"gpujobs: resubmitted {outcomes[0].point.run_dir}" if single
          else f"gpujobs: resubmitted points {', '.join(str(o.point.num) for o in outcomes)}")
    return 0


def main(argv: Optional[list[str]] = None, prog: str = "python -m gpujobs") -> int:
    """Run one management command; returns the exit code. `prog` names the command in usage lines
    (`gpujobs` runs these as its own subcommands)."""
    args = _parser(prog).parse_args(argv)
    try:
        if args.command == "status":
            return _status(args)
        if args.command == "logs":
            return _logs(args)
        if args.command == "cost":
            return _cost(args)
        points = manage.select(manage.points_of(args.dir), getattr(args, "point", None))
        if args.command == "cancel":
            return _cancel(points)
        warning = manage.refresh(points, args.sacct_timeout)
        if warning:  # exit 1, as a Slurm command that failed: not bad input
            print(f"gpujobs: {warning}; resubmit needs the scheduler's view of the states, try again", file=sys.stderr)
            return 1
        outcomes = manage.resubmit(args.dir, points, cancelled=args.cancelled)
        return _resubmitted(outcomes, single=points[0].num is None)
    except SchedulerError as err:
        print(f"gpujobs: {err}", file=sys.stderr)
        return 1
    except GpujobsError as err:
        print(f"gpujobs: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

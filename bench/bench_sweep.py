"""Time to queue a 100-point sweep on the live Slurm cluster: gpujobs against Hydra's submitit launcher.

    SLURM_CONF=... python bench/bench_sweep.py [--points 100] [--rounds 3] [--singles 100] [--before DIR]

(a) `python -m gpujobs.submit -m ... trainer.seed=range(0,N)` with the gpujobs sweeper and launcher (the
defaults), until it returns: the config composed once, every point derived from it, validated and queued
as one job array. (a') the same with `hydra/sweeper=basic`, which composes every point (twice). (b) the
same command with `hydra/launcher=submitit_slurm` (hydra-submitit-launcher, the `dev` extra), timed until
`squeue` shows all N array tasks (it then blocks until they end, so it is stopped there). (c) N separate
`python -m gpujobs.submit` single submissions, one after another. (a) and (b) run side by side for
`--rounds` rounds, alternating which goes first, and the median of their per-round ratios b/a is printed;
a'/a and c/a come from one round. With `--before DIR` (a checkout of an earlier commit), (a) is also
timed with DIR's gpujobs in the same rounds, so that a change is measured side by side. Everything queued
is cancelled at once (array parallelism 1, so at most one task runs meanwhile).

Each side must do its work to be timed (`sides`): (b) needs hydra-submitit-launcher, asked first; a side
whose command fails, or that queues fewer than N tasks, stops the bench naming it, exit 1.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from sides import expect, fail, last_line, ran

REPO = Path(__file__).resolve().parent.parent
BASE = ["+experiment=rec", "+debug=tiny", "cluster=slurm", "resources.procs_per_node=1"]


def _submit(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpujobs.submit", *args]


def _array_tasks(name: str) -> tuple[int, set[str]]:
    """Queued tasks of jobs named `name` (pending ranges counted), and their array ids."""
    out = subprocess.run(["squeue", "-h", "-r", "-n", name, "-o", "%i"], capture_output=True, text=True).stdout
    ids = out.split()
    return len(ids), {i.split("_")[0] for i in ids}


def _cancel(ids: set[str]) -> None:
    if ids:
        subprocess.run(["scancel", *sorted(ids)], check=False)


def time_gpujobs(points: int, tmp: Path, sweeper: str = "gpujobs", checkout: Optional[Path] = None) -> float:
    """(a), or (a') with `sweeper="basic"`; with `checkout`, that checkout's gpujobs (first on the path)."""
    tmp.mkdir(parents=True, exist_ok=True)
    env = None if checkout is None else {**os.environ, "PYTHONPATH": str(checkout)}
    side = f"(a) gpujobs, {sweeper} sweeper" + ("" if checkout is None else f", {checkout}")
    start = time.perf_counter()
    proc = ran(side, _submit("-m", f"hydra.sweep.dir={tmp / (sweeper if checkout is None else 'before')}", *BASE,
                             "name=bench_gj", "cluster.array_parallelism=1", f"hydra/sweeper={sweeper}",
                             f"trainer.seed=range(0,{points})"), cwd=tmp, env=env)
    elapsed = time.perf_counter() - start
    arrays = re.findall(r"job array (\d+) \((\d+) points", proc.stdout)
    _cancel({array for array, _ in arrays})
    queued = sum(int(count) for _, count in arrays)
    expect(side, queued == points, f"queued {queued} of {points} points: {last_line(proc.stdout)}")
    return elapsed


#: Side (b), as the bench names it when it fails.
_HYDRA_SIDE = "(b) Hydra's submitit launcher (hydra-submitit-launcher)"


def check_hydra_submitit() -> None:
    """Side (b) needs hydra-submitit-launcher (the `dev` extra): without it, its command fails at once."""
    try:
        import hydra_plugins.hydra_submitit_launcher.submitit_launcher  # noqa: F401
    except ImportError as err:
        fail(_HYDRA_SIDE, f"it is not installed ({err}): pip install hydra-submitit-launcher, or the dev extra")


def time_hydra_submitit(points: int, tmp: Path) -> float:
    tmp.mkdir(parents=True, exist_ok=True)
    cmd = _submit("-m", f"hydra.sweep.dir={tmp / 'hydra'}", *BASE, "name=bench_hs",
                  "hydra/launcher=submitit_slurm", "hydra.launcher.name=bench_hs",
                  f"hydra.launcher.submitit_folder={tmp / 'hydra' / 'submitit'}", "hydra.launcher.array_parallelism=1",
                  "hydra.launcher.timeout_min=5", f"trainer.seed=range(0,{points})")
    errors = tmp / "hydra.stderr"
    start = time.perf_counter()
    with open(errors, "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.DEVNULL, stderr=stderr)
    ids: set[str] = set()
    count = 0
    try:
        while proc.poll() is None:
            count, ids = _array_tasks("bench_hs")
            if count >= points:
                break
            time.sleep(0.05)
        elapsed = time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait()
        _cancel(ids | _array_tasks("bench_hs")[1])
    # it ends only once its tasks do: an end before all were queued is a failure, not a fast round
    expect(_HYDRA_SIDE, count >= points, f"exited {proc.returncode} with {count} of {points} tasks queued: "
                                         f"{last_line(errors.read_text())}")
    return elapsed


def time_singles(count: int, tmp: Path) -> float:
    """The summed time of `count` single submissions; each job is cancelled once its submission is timed,
    so that no queued job runs beside the next submission."""
    elapsed = 0.0
    for i in range(count):
        start = time.perf_counter()
        proc = ran("(c) single submissions", _submit(f"hydra.run.dir={tmp / 'single' / str(i)}", *BASE,
                                                    "name=bench_single", f"trainer.seed={i}"), cwd=tmp)
        elapsed += time.perf_counter() - start
        queued = set(re.findall(r"submitted Slurm job (\d+)", proc.stdout))
        _cancel(queued)
        expect("(c) single submissions", bool(queued), f"submission {i} queued no job: {last_line(proc.stdout)}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (a) and (b) side by side; medians reported")
    parser.add_argument("--singles", type=int, default=100, help="single submissions to time (scaled to --points)")
    parser.add_argument("--before", type=Path, help="a checkout of an earlier commit, timed beside this one")
    args = parser.parse_args()
    check_hydra_submitit()  # first: a side that cannot run is said before anything is timed
    if not os.environ.get("SLURM_CONF"):
        raise SystemExit("needs the live cluster: eval \"$(bash scripts/local-slurm.sh up)\"")
    gj: list[float] = []
    hs: list[float] = []
    before: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench_sweep_", ignore_cleanup_errors=True) as tmp:
        for round_ in range(args.rounds):
            here = Path(tmp) / str(round_)
            for which in ("gj", "hs") if round_ % 2 == 0 else ("hs", "gj"):  # alternate which goes first
                if which == "gj":
                    gj.append(time_gpujobs(args.points, here))
                else:
                    hs.append(time_hydra_submitit(args.points, here))
            if args.before:
                before.append(time_gpujobs(args.points, here, checkout=args.before))
        basic = time_gpujobs(args.points, Path(tmp) / "basic", sweeper="basic")
        singles = time_singles(args.singles, Path(tmp)) * args.points / max(args.singles, 1)
    ratios = sorted(h / g for g, h in zip(gj, hs, strict=True))
    fast = statistics.median(gj)
    print(f"{args.points}-point sweep, until all points are queued (median of {args.rounds} rounds where so marked):")
    print(f"  gpujobs sweeper + launcher (one array): {fast:7.2f} s   rounds {', '.join(f'{g:.2f}' for g in gj)}")
    print(f"  hydra submitit launcher (one array):    {statistics.median(hs):7.2f} s   "
          f"ratio {statistics.median(ratios):5.2f}x (rounds {', '.join(f'{r:.1f}' for r in ratios)})")
    print(f"  basic sweeper + gpujobs launcher:       {basic:7.2f} s   ratio {basic / fast:5.2f}x (one round)")
    if before:
        print(f"  the same, before (--before):            {statistics.median(before):7.2f} s   rounds "
              f"{', '.join(f'{b:.2f}' for b in before)} ({args.before})")
    print(f"  {args.points} single gpujobs submissions:       {singles:7.2f} s   ratio {singles / fast:5.2f}x"
          + (f" (timed {args.singles}, scaled)" if args.singles != args.points else ""))


if __name__ == "__main__":
    main()

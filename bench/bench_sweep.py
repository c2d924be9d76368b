"""Time to queue a 100-point sweep on the live Slurm cluster: gpujobs against Hydra's submitit launcher.

    SLURM_CONF=... python bench/bench_sweep.py [--points 100] [--singles 100]

(a) `python -m gpujobs.submit -m ... trainer.seed=range(0,N)` with the gpujobs sweeper and launcher (the
defaults), until it returns: the config composed once, every point derived from it, validated and queued
as one job array. (a') the same with `hydra/sweeper=basic`, which composes every point (twice). (b) the
same command with `hydra/launcher=submitit_slurm` (hydra-submitit-launcher, the `dev` extra), timed until `squeue` shows
all N array tasks (it then blocks until they end, so it is stopped there). (c) N separate
`python -m gpujobs.submit` single submissions, one after another. Ratios a'/a, b/a and c/a are printed;
everything queued is cancelled (array parallelism 1, so at most one task runs meanwhile).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def time_gpujobs(points: int, tmp: Path, sweeper: str = "gpujobs") -> float:
    start = time.perf_counter()
    proc = subprocess.run(
        _submit("-m", f"hydra.sweep.dir={tmp / sweeper}", *BASE, "name=bench_gj", "cluster.array_parallelism=1",
                f"hydra/sweeper={sweeper}", f"trainer.seed=range(0,{points})"),
        cwd=tmp, capture_output=True, text=True, check=True,
    )
    elapsed = time.perf_counter() - start
    _cancel(set(re.findall(r"job array (\d+)", proc.stdout)))
    return elapsed


def time_hydra_submitit(points: int, tmp: Path) -> float:
    cmd = _submit("-m", f"hydra.sweep.dir={tmp / 'hydra'}", *BASE, "name=bench_hs",
                  "hydra/launcher=submitit_slurm", "hydra.launcher.name=bench_hs",
                  f"hydra.launcher.submitit_folder={tmp / 'hydra' / 'submitit'}", "hydra.launcher.array_parallelism=1",
                  "hydra.launcher.timeout_min=5", f"trainer.seed=range(0,{points})")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ids: set[str] = set()
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
    return elapsed


def time_singles(count: int, tmp: Path) -> float:
    ids: set[str] = set()
    start = time.perf_counter()
    for i in range(count):
        proc = subprocess.run(_submit(f"hydra.run.dir={tmp / 'single' / str(i)}", *BASE, "name=bench_single",
                                      f"trainer.seed={i}"), cwd=tmp, capture_output=True, text=True, check=True)
        ids |= set(re.findall(r"submitted Slurm job (\d+)", proc.stdout))
    elapsed = time.perf_counter() - start
    _cancel(ids)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=100)
    parser.add_argument("--singles", type=int, default=100, help="single submissions to time (scaled to --points)")
    args = parser.parse_args()
    if not os.environ.get("SLURM_CONF"):
        raise SystemExit("needs the live cluster: eval \"$(bash scripts/local-slurm.sh up)\"")
    with tempfile.TemporaryDirectory(prefix="bench_sweep_", ignore_cleanup_errors=True) as tmp:
        gj = time_gpujobs(args.points, Path(tmp))
        basic = time_gpujobs(args.points, Path(tmp), sweeper="basic")
        hs = time_hydra_submitit(args.points, Path(tmp))
        singles = time_singles(args.singles, Path(tmp)) * args.points / max(args.singles, 1)
    print(f"{args.points}-point sweep, until all points are queued:")
    print(f"  gpujobs sweeper + launcher (one array): {gj:7.2f} s")
    print(f"  basic sweeper + gpujobs launcher:       {basic:7.2f} s   ratio {basic / gj:5.2f}x")
    print(f"  hydra submitit launcher (one array):    {hs:7.2f} s   ratio {hs / gj:5.2f}x")
    print(f"  {args.points} single gpujobs submissions:       {singles:7.2f} s   ratio {singles / gj:5.2f}x"
          + (f" (timed {args.singles}, scaled)" if args.singles != args.points else ""))


if __name__ == "__main__":
    main()

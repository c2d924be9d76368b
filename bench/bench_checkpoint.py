"""Checkpoint blocking time against a plain `torch.save` of the same state to the same disk.

    python bench/bench_checkpoint.py [--sizes-mb 10 1024] [--rounds 5] [--dir DIR] [--device cpu|cuda]

For each state size, rounds alternate (a) `CheckpointManager.save` (temp dir, fsync, rename, marker,
prune) and (b) `torch.save` into a new file per step followed by fsync, deleting the previous one (what
a hand-written keep-1 loop does), so both pay for durability and for fresh pages; (c) the same without
fsync, as the floor a non-durable save costs; (d) `CheckpointManager.save_async`: the time it blocks
its caller (the host snapshot), then, not counted in it, the wait for the background save to be
published (`async_total_s` is both). Median ratios; the acceptance lines are `async_vs_sync` <= 0.1
(issue 12) and `ratio_vs_torch_save_fsync` <= 1.3 (issue 26) for 1 GB. On a disk whose speed drifts
from one second to the next, `ratio_paired` (the median of each round's (a)/(b), measured back to
back) is the steadier figure. `--device cuda` puts the state
on the GPU (snapshots go to pinned host memory). Each line also says how loaded the machine was (the
load average before and after, and the cores) and what memory and disk space it had: on a shared
machine only ratios measured side by side mean anything.

`--crash-trials N` instead runs the crash test (tests/test_checkpoint_crash.py) with N SIGKILLs at
random moments of saving, and reports how many checkpoints were checked whole and how long it took.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gpujobs.rank.checkpoint import CheckpointManager


def state_of(megabytes: int, device: str = "cpu") -> dict[str, Any]:
    floats = megabytes * 1024 * 1024 // 4
    return {
        "model": {"w": torch.randn(floats // 2, device=device)},
        "optimizer": {"m": torch.randn(floats - floats // 2, device=device)},
        "step": 1,
    }


def _machine(where: Path) -> dict[str, Any]:
    """How loaded the machine is and what it has: the 1-minute load average, cores, free memory and disk."""
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {"cores": os.cpu_count(), "load_before": round(os.getloadavg()[0], 2),
            "free_ram_gb": round(pages / 2**30, 1), "free_disk_gb": round(shutil.disk_usage(where).free / 2**30, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[10, 1024])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the state lives")
    parser.add_argument("--crash-trials", type=int, default=0, help="run N kill-while-saving trials instead")
    args = parser.parse_args()
    if args.crash_trials:
        start = time.perf_counter()
        test = Path(__file__).resolve().parent.parent / "tests" / "test_checkpoint_crash.py"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", str(test)], check=False,
                              env={**os.environ, "GPUJOBS_CRASH_TRIALS": str(args.crash_trials)})
        print(json.dumps({"crash_trials": args.crash_trials, "passed": proc.returncode == 0,
                          "seconds": round(time.perf_counter() - start, 1)}))
        raise SystemExit(proc.returncode)
    report = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for size in args.sizes_mb:
            machine = _machine(Path(tmp))
            state = state_of(size, args.device)

            def shared(state: dict[str, Any] = state) -> dict[str, Any]:
                return state

            times: dict[str, list[float]] = {
                "gpujobs": [], "torch_save_fsync": [], "torch_save": [], "async_blocking": [], "async_total": [],
            }
            manager = CheckpointManager(Path(tmp) / f"ck{size}", every_steps=1, keep=1)
            background = CheckpointManager(Path(tmp) / f"async{size}", every_steps=1, keep=1, background=True)
            for step in range(1, args.rounds + 1):
                # Every measurement starts with no dirty pages of another's: `torch.save` without fsync
                # leaves a GB for the kernel to write back, which whatever runs next would pay for.
                os.sync()
                start = time.perf_counter()
                manager.save(step, shared, {"rng": torch.get_rng_state()})
                times["gpujobs"].append(time.perf_counter() - start)

                for kind in ("torch_save_fsync", "torch_save"):
                    plain = Path(tmp) / f"{kind}{size}_{step}.pt"
                    os.sync()
                    start = time.perf_counter()
                    with open(plain, "wb") as handle:
                        torch.save(state, handle)
                        if kind == "torch_save_fsync":
                            handle.flush()
                            os.fsync(handle.fileno())
                    Path(tmp, f"{kind}{size}_{step - 1}.pt").unlink(missing_ok=True)
                    times[kind].append(time.perf_counter() - start)

                os.sync()
                start = time.perf_counter()
                background.save_async(step, shared, {"rng": torch.get_rng_state()})
                times["async_blocking"].append(background.last_blocking_s)
                background.wait()  # not overlapping the next round's measurements
                times["async_total"].append(time.perf_counter() - start)
            background.close()
            load_after = os.getloadavg()[0]
            med = {k: statistics.median(v) for k, v in times.items()}
            report.append({
                "state_mb": size,
                "gpujobs_s": round(med["gpujobs"], 4),
                "torch_save_fsync_s": round(med["torch_save_fsync"], 4),
                "torch_save_s": round(med["torch_save"], 4),
                "ratio_vs_torch_save_fsync": round(med["gpujobs"] / med["torch_save_fsync"], 3),
                "ratio_vs_torch_save": round(med["gpujobs"] / med["torch_save"], 3),
                # each round's two saves ran back to back: their ratio sees the same disk, however it drifts
                "ratio_paired": round(statistics.median(
                    g / t for g, t in zip(times["gpujobs"], times["torch_save_fsync"], strict=True)), 3),
                "async_blocking_s": round(med["async_blocking"], 4),
                "async_total_s": round(med["async_total"], 4),
                "async_vs_sync": round(med["async_blocking"] / med["gpujobs"], 3),
                "device": args.device,
                **machine,
                "load_after": round(load_after, 2),
            })
            print(json.dumps(report[-1]), flush=True)


if __name__ == "__main__":
    main()

"""Checkpoint blocking time against a plain `torch.save` of the same state to the same disk.

    python bench/bench_checkpoint.py [--sizes-mb 10 1024] [--rounds 5] [--dir DIR]

For each state size, rounds alternate (a) `CheckpointManager.save` (temp dir, fsync, rename, marker,
prune) and (b) `torch.save` into a new file per step followed by fsync, deleting the previous one (what
a hand-written keep-1 loop does), so both pay for durability and for fresh pages; (c) the same without
fsync, as the floor a non-durable save costs. Median ratios.

`--crash-trials N` instead runs the crash test (tests/test_checkpoint_crash.py) with N SIGKILLs at
random moments of saving, and reports how many checkpoints were checked whole and how long it took.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpujobs.run.checkpoint import CheckpointManager


def state_of(megabytes: int) -> dict[str, object]:
    floats = megabytes * 1024 * 1024 // 4
    return {"model": {"w": torch.randn(floats // 2)}, "optimizer": {"m": torch.randn(floats - floats // 2)}, "step": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[10, 1024])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
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
            state = state_of(size)
            times: dict[str, list[float]] = {"gpujobs": [], "torch_save_fsync": [], "torch_save": []}
            manager = CheckpointManager(Path(tmp) / f"ck{size}", every_steps=1, keep=1)
            for step in range(1, args.rounds + 1):
                start = time.perf_counter()
                manager.save(step, lambda state=state: state, {"rng": torch.get_rng_state()})
                times["gpujobs"].append(time.perf_counter() - start)

                for kind in ("torch_save_fsync", "torch_save"):
                    plain = Path(tmp) / f"{kind}{size}_{step}.pt"
                    start = time.perf_counter()
                    with open(plain, "wb") as handle:
                        torch.save(state, handle)
                        if kind == "torch_save_fsync":
                            handle.flush()
                            os.fsync(handle.fileno())
                    Path(tmp, f"{kind}{size}_{step - 1}.pt").unlink(missing_ok=True)
                    times[kind].append(time.perf_counter() - start)
            med = {k: statistics.median(v) for k, v in times.items()}
            report.append({
                "state_mb": size,
                "gpujobs_s": round(med["gpujobs"], 4),
                "torch_save_fsync_s": round(med["torch_save_fsync"], 4),
                "torch_save_s": round(med["torch_save"], 4),
                "ratio_vs_torch_save_fsync": round(med["gpujobs"] / med["torch_save_fsync"], 3),
                "ratio_vs_torch_save": round(med["gpujobs"] / med["torch_save"], 3),
            })
            print(json.dumps(report[-1]), flush=True)


if __name__ == "__main__":
    main()

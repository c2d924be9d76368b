"""A user's own training script, written for torchrun: it knows nothing about gpujobs.

It joins the process group from the torchrun variables, all-reduces its rank, and writes what it saw.
With `--fail-rank N`, rank N raises instead of joining the all-reduce (a bug on one rank): the
others fail of it, in the collective. With `--fail-late N`, rank N does its work, then exits 3 a
moment after the others are done (a last save that fails, on that rank only). With
`--fail-first-attempt`, every rank exits 4 on the job's first attempt (Slurm's SLURM_RESTART_COUNT unset
or 0) and works on the next: a fault that a requeue outlives.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if "--fail-first-attempt" in sys.argv and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
    sys.exit(4)
dist.init_process_group("gloo", rank=rank, world_size=world)  # env:// from MASTER_ADDR / MASTER_PORT
if "--fail-rank" in sys.argv and int(sys.argv[sys.argv.index("--fail-rank") + 1]) == rank:
    raise ValueError(f"rank {rank} cannot go on")
total = torch.tensor([float(rank)])
dist.all_reduce(total)
seen = {
    key: os.environ[key]
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
}
seen["gpus"] = {key: os.environ.get(key) for key in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
seen["rank_sum"] = total.item()
seen["args"] = sys.argv[1:]
seen["node"] = os.environ.get("SLURMD_NODENAME", "local")
Path(os.environ["GPUJOBS_RUN_DIR"], f"seen_rank{rank}.json").write_text(json.dumps(seen))
dist.destroy_process_group()
if "--fail-late" in sys.argv and int(sys.argv[sys.argv.index("--fail-late") + 1]) == rank:
    time.sleep(1.5)
    sys.exit(3)

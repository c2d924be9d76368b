"""A user's script that saves and stops on SIGTERM, and resumes from what it saved (no gpujobs inside).

Usage: stoppable.py STEPS [RANK0_STEPS]. Each rank counts to STEPS (rank 0 to RANK0_STEPS where given),
50 ms a step, keeping its count in the run dir.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

run, rank = Path(os.environ["GPUJOBS_RUN_DIR"]), os.environ["RANK"]
stop = False


def on_term(signum: int, frame: object) -> None:
    global stop
    stop = True


signal.signal(signal.SIGTERM, on_term)
state = run / f"progress_rank{rank}.json"
done = json.loads(state.read_text())["step"] if state.exists() else 0
total = int(sys.argv[2]) if rank == "0" and len(sys.argv) > 2 else int(sys.argv[1])
while done < total and not stop:
    time.sleep(0.05)
    done += 1
    partial = state.with_suffix(".tmp")  # readers never see a half-written count
    partial.write_text(json.dumps({"step": done}))
    os.replace(partial, state)
with open(run / f"exits_rank{rank}.txt", "a") as log:
    log.write(f"{'stopped' if stop else 'finished'} at {done}\n")

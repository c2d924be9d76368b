"""Preemption round trip on the live Slurm cluster: USR2 → saved and requeued → first resumed step.

    SLURM_CONF=... python bench/bench_preemption.py [--rounds 3]

Each round runs a 2-node rec job, sends `scancel --signal=USR2` once it is training, and reads the
story back from attempts.jsonl and metrics.jsonl: seconds from the signal to the requeue (agreed stop +
checkpoint + `scontrol requeue`), to the resumed attempt's start, and to its first logged step; and the
steps lost (resumed start step minus the step saved: 0 means nothing was redone). The requeue wait is
mostly Slurm's own (a requeued job may start again only after cred_expire + 1 s, 11 s on the test cluster).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sides import expect

REPO = Path(__file__).resolve().parent.parent
JOB = ("+experiment=rec", "+debug=tiny", "cluster=slurm", "resources.nodes=2", "resources.procs_per_node=1",
       "trainer.max_steps=200", "trainer.log_every=1", "checkpoint.every_steps=50", "cluster.wait=true",
       "telemetry.debug_slow_rank=0", "telemetry.debug_slow_ms=40")


def one_round(run_dir: Path) -> dict[str, float]:
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([sys.executable, "-m", "gpujobs.submit", f"hydra.run.dir={run_dir}", *JOB],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 20):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the job never reached step 20: see {run_dir.parent / f'{run_dir.name}.log'}")
        time.sleep(0.05)
    job_id = re.findall(r"submitted Slurm job (\d+)", (run_dir.parent / f"{run_dir.name}.log").read_text())[0]
    signalled = time.time()
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    proc.wait(timeout=300)
    log.close()
    lines = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
    reasons = [line["reason"] for line in lines]
    # only a preemption that requeued and then completed measures a preemption
    expect("the preempted job", proc.returncode == 0 and reasons[:2] == ["preempted", "completed"],
           f"exit {proc.returncode}, attempts {reasons} (see {run_dir.parent / f'{run_dir.name}.log'})")
    first, second = lines[:2]
    resumed = [json.loads(line) for line in metrics.read_text().splitlines()]
    first_resumed = next(r["time"] for r in resumed if r["time"] > second["start"] and r.get("kind") == "train")
    return {
        "to_requeue_s": first["end"] - signalled,
        "to_resumed_start_s": second["start"] - signalled,
        "to_first_resumed_step_s": first_resumed - signalled,
        "steps_lost": second["start_step"] - first["steps_done"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not os.environ.get("SLURM_CONF"):
        sys.exit("set SLURM_CONF (eval \"$(bash scripts/local-slurm.sh up)\")")
    with tempfile.TemporaryDirectory(dir=REPO) as tmp:
        rounds = [one_round(Path(tmp) / f"run{i}") for i in range(args.rounds)]
    summary = {key: round(statistics.median(r[key] for r in rounds), 3) for key in rounds[0]}
    print(json.dumps({"rounds": args.rounds, "median": summary, "max_steps_lost": max(r["steps_lost"] for r in rounds)},
                     indent=2))


if __name__ == "__main__":
    main()

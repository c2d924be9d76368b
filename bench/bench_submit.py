"""Submit latency on the live Slurm cluster: gpujobs against raw `sbatch --wrap` + a Python start.

    SLURM_CONF=... python bench/bench_submit.py [--rounds 7]

Each round times, side by side: (a) `python -m gpujobs.submit +experiment=rec +debug=tiny cluster=slurm`
until it returns (job queued, config validated, preflight done); (b) a bare `python -c pass` plus
`sbatch --wrap` of a trivial job (the floor any Python tool that calls sbatch pays); and (c) a Python
start that composes the same config with Hydra's compose API, plus the same `sbatch` (the floor of any
Hydra-configured submitter). Rounds rotate the order; median ratios a/b and a/c are reported. Queued
jobs are cancelled at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMPOSE = (
    "from hydra import compose, initialize_config_dir\n"
    f"with initialize_config_dir(config_dir={str(REPO / 'conf')!r}, version_base='1.3'):\n"
    "    compose(config_name='config', overrides=['+experiment=rec', '+debug=tiny', 'cluster=slurm'])\n"
)


def timed(cmd: list[str], cwd: Path) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=True)
    return time.perf_counter() - start, proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    jobs: list[str] = []
    times: dict[str, list[float]] = {"gpujobs": [], "raw": [], "hydra": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            def gpujobs(round_: int = round_) -> None:
                seconds, out = timed(
                    [sys.executable, "-m", "gpujobs.submit", f"hydra.run.dir={tmp}/run{round_}",
                     "+experiment=rec", "+debug=tiny", "cluster=slurm"], REPO)
                jobs.extend(re.findall(r"submitted Slurm job (\d+)", out))
                times["gpujobs"].append(seconds)

            def raw() -> None:
                python_s, _ = timed([sys.executable, "-c", "pass"], REPO)
                sbatch_s, out = timed(["sbatch", "--parsable", f"--output={tmp}/raw-%j.out", "--wrap", "true"], REPO)
                jobs.append(out.strip().split(";")[0])
                times["raw"].append(python_s + sbatch_s)

            def hydra() -> None:
                python_s, _ = timed([sys.executable, "-c", COMPOSE], REPO)
                sbatch_s, out = timed(["sbatch", "--parsable", f"--output={tmp}/raw-%j.out", "--wrap", "true"], REPO)
                jobs.append(out.strip().split(";")[0])
                times["hydra"].append(python_s + sbatch_s)

            steps = [gpujobs, raw, hydra]
            for step in steps[round_ % 3:] + steps[: round_ % 3]:
                step()
    subprocess.run(["scancel", *jobs], check=False)
    def ratio(base: str) -> float:
        return round(statistics.median(a / b for a, b in zip(times["gpujobs"], times[base], strict=True)), 3)

    print(json.dumps({
        "rounds": args.rounds,
        "gpujobs_submit_s": round(statistics.median(times["gpujobs"]), 3),
        "raw_sbatch_plus_python_s": round(statistics.median(times["raw"]), 3),
        "hydra_compose_plus_sbatch_s": round(statistics.median(times["hydra"]), 3),
        "ratio_vs_raw": ratio("raw"),
        "ratio_vs_hydra_compose": ratio("hydra"),
    }, indent=2))


if __name__ == "__main__":
    main()

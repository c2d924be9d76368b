"""Submit latency on the live Slurm cluster: gpujobs against raw `sbatch --wrap` + a Python start.

    SLURM_CONF=... python bench/bench_submit.py [--rounds 7] [--before DIR]

Each round times, side by side: (a) `python -m gpujobs.submit +experiment=rec +debug=tiny cluster=slurm`
until it returns (job queued, config validated, preflight done); (b) a bare `python -c pass` plus
`sbatch --wrap` of a trivial job (the floor any Python tool that calls sbatch pays); (c) a Python start
that composes the same config with Hydra's compose API, plus the same `sbatch` (the floor of any
Hydra-configured submitter); and (d) a Hydra main over the same config that does nothing, plus the same
`sbatch` (the floor of a submitter that is a Hydra main, as `gpujobs.submit` is). Rounds rotate the
order; median ratios a/b, a/c and a/d are reported. With `--before DIR` (a checkout of an earlier
commit, e.g. `git worktree add DIR COMMIT`), (a) is also timed with DIR's gpujobs, in the same rounds, so
that a change is measured side by side. Every queued job is cancelled as soon as its timing ends, so that
none runs beside a later measurement.
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

from sides import expect, last_line, ran

REPO = Path(__file__).resolve().parent.parent
COMPOSE = (
    "from hydra import compose, initialize_config_dir\n"
    f"with initialize_config_dir(config_dir={str(REPO / 'conf')!r}, version_base='1.3'):\n"
    "    compose(config_name='config', overrides=['+experiment=rec', '+debug=tiny', 'cluster=slurm'])\n"
)
#: A Hydra main over the same config that does nothing: what `python -m gpujobs.submit` pays before its own work
#: (Hydra 1.3's main composes the config twice: once to read `hydra.mode`, once to run).
HYDRA_MAIN = (
    "import hydra\n"
    f"@hydra.main(version_base='1.3', config_path={str(REPO / 'conf')!r}, config_name='config')\n"
    "def noop(cfg):\n"
    "    pass\n"
    "noop()\n"
)


def cancel(jobs: list[str]) -> None:
    """Cancel at once, outside the timing: a queued job left to start would share the CPUs with the next round."""
    subprocess.run(["scancel", *jobs], check=False)


def timed(side: str, cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[float, str]:
    """`cmd`'s wall time and stdout; one that fails stops the bench naming `side` (`sides.ran`)."""
    start = time.perf_counter()
    proc = ran(side, cmd, cwd=cwd, env=env)
    return time.perf_counter() - start, proc.stdout


def with_path(checkout: Path) -> dict[str, str]:
    """This environment with `checkout`'s gpujobs (and its conf/) first on the path (`python -m` in `checkout`
    puts it first anyway: the working directory comes before PYTHONPATH)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(checkout), os.environ.get("PYTHONPATH")] if p)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--before", type=Path, help="a checkout of an earlier commit, timed beside this one")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"gpujobs": [], "raw": [], "hydra": [], "hydra_main": [], "before": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            def gpujobs(round_: int = round_, name: str = "gpujobs", checkout: Path = REPO) -> None:
                seconds, out = timed(
                    name, [sys.executable, "-m", "gpujobs.submit", f"hydra.run.dir={tmp}/{name}{round_}",
                           "+experiment=rec", "+debug=tiny", "cluster=slurm"], checkout, with_path(checkout))
                queued = re.findall(r"submitted Slurm job (\d+)", out)
                cancel(queued)
                expect(name, bool(queued), f"queued no job: {last_line(out)}")
                times[name].append(seconds)

            def before(round_: int = round_) -> None:
                gpujobs(round_, "before", args.before)

            def python_then_sbatch(name: str, *python: str) -> None:
                python_s, _ = timed(name, [sys.executable, *python], REPO)
                sbatch_s, out = timed(name, ["sbatch", "--parsable", f"--output={tmp}/raw-%j.out", "--wrap", "true"],
                                      REPO)
                job_id = out.strip().split(";")[0]
                cancel([job_id])
                expect(name, job_id.isdigit(), f"sbatch queued no job: {last_line(out)}")
                times[name].append(python_s + sbatch_s)

            def raw() -> None:
                python_then_sbatch("raw", "-c", "pass")

            def hydra() -> None:
                python_then_sbatch("hydra", "-c", COMPOSE)

            def hydra_main(round_: int = round_) -> None:
                python_then_sbatch("hydra_main", "-c", HYDRA_MAIN, f"hydra.run.dir={tmp}/noop{round_}",
                                   "+experiment=rec", "+debug=tiny", "cluster=slurm")

            steps = [gpujobs, raw, hydra, hydra_main] + ([before] if args.before else [])
            for step in steps[round_ % len(steps):] + steps[: round_ % len(steps)]:
                step()

    def ratio(base: str, of: str = "gpujobs") -> float:
        return round(statistics.median(a / b for a, b in zip(times[of], times[base], strict=True)), 3)

    was = {} if not args.before else {
        "before_submit_s": round(statistics.median(times["before"]), 3),
        "before_ratio_vs_noop_hydra_main": ratio("hydra_main", "before"),
    }
    print(json.dumps({
        "rounds": args.rounds,
        "gpujobs_submit_s": round(statistics.median(times["gpujobs"]), 3),
        "raw_sbatch_plus_python_s": round(statistics.median(times["raw"]), 3),
        "hydra_compose_plus_sbatch_s": round(statistics.median(times["hydra"]), 3),
        "noop_hydra_main_plus_sbatch_s": round(statistics.median(times["hydra_main"]), 3),
        "ratio_vs_raw": ratio("raw"),
        "ratio_vs_hydra_compose": ratio("hydra"),
        "ratio_vs_noop_hydra_main": ratio("hydra_main"),
        **was,
    }, indent=2))


if __name__ == "__main__":
    main()

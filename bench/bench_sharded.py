"""`parallel=torchrec` against `parallel=ddp` on the Criteo-format job, side by side in one invocation.

    python bench/bench_sharded.py [--steps 40] [--rows 200000] [--json]

Every side is a real `python -m gpujobs.submit` on 2 local CPU ranks, as a user runs it, from one store that
`gpujobs prepare` makes here of generated Criteo-format lines:

1. 100,000 hash buckets x 26 tables (41.6M table parameters), each mode: samples/s, each rank's peak resident
   memory (result.json's `ranks[].peak_rss_mb`), the bytes each rank writes into a checkpoint (its files in
   the step's marker); bars: torchrec >= 10x ddp's samples/s, <= 0.6x its peak RSS and checkpoint bytes a rank.
2. 2,000,000 buckets a table (~13 GB a DDP rank with Adam): refused at submit under ddp in one line, exit 2;
   trained under torchrec on 2 ranks, each under 4 GB of peak RSS.
3. The torchrec job killed mid-run (SIGKILL of rank 1) and resumed: the same `param_digest` as straight;
   preempted at 2 ranks, then at 1, completed at 3: the same samples, the AUC within 0.005 of straight.
4. `gpujobs plan` of MLPerf's DLRM-DCNv2 for 3 16-GiB GPUs a node: 4 nodes fit, 1 node is one line; seconds.

Exits 1 naming each side or bar that failed (a side that did not train counts as failed, never as fast).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "bench"), str(REPO / "tests")]  # neither is a package: the generators and job control
from bench_data import write_criteo_file  # noqa: E402

SPEEDUP, RSS_RATIO, CKPT_RATIO, BIG_RSS_MB, AUC_DELTA, PLAN_S = 10.0, 0.6, 0.6, 4000.0, 0.005, 10.0


def run(*args: str, cwd: Path, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def prepare(scratch: Path, buckets: int, name: str = "") -> Path:
    """The store of `scratch`'s train{name}.tsv and eval{name}.tsv at `buckets` a table."""
    store = scratch / f"store{name}-{buckets}"
    done = run("-m", "gpujobs.prepare", "+experiment=rec", "data=criteo", "cluster=local",
               f"data.hash_buckets={buckets}", f"data.train_files={scratch / f'train{name}.tsv'}",
               f"data.eval_files={scratch / f'eval{name}.tsv'}", f"data.store={store}", cwd=scratch)
    if done.returncode != 0:
        sys.exit(f"bench_sharded: gpujobs prepare of {buckets} buckets failed: {done.stderr.strip()[-400:]}")
    return store


def job(store: Path, buckets: int, steps: int, *more: str) -> tuple[str, ...]:
    return ("+experiment=rec", "data=criteo", "cluster=local", f"data.store={store}", f"data.hash_buckets={buckets}",
            f"trainer.max_steps={steps}", "trainer.eval_every=0", f"checkpoint.every_steps={max(1, steps // 4)}",
            "trainer.log_every=5", "data.global_batch_size=512", *more)


def submit(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return run("-m", "gpujobs.submit", f"hydra.run.dir={run_dir}", *overrides, cwd=run_dir.parent)


def result(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "result.json"
    return json.loads(path.read_text()) if path.exists() else {}


def checkpoint_bytes(run_dir: Path) -> list[int]:
    """The bytes each rank wrote into the run's newest checkpoint, from its marker's file list."""
    steps = sorted((run_dir / "checkpoints").glob("step_*"))
    files = json.loads((steps[-1] / "COMPLETE").read_text())["files"]
    world = result(run_dir)["world_size"]
    mine = [0] * world
    for name, entry in files.items():
        base = name.rsplit("/", 1)[-1]
        if base.startswith("rank_"):
            owner = int(base[5:].split(".")[0])
        elif base.startswith("__"):
            owner = int(base[2:].split("_")[0])
        else:  # state.pt, the DCP metadata: rank 0's
            owner = 0
        mine[owner] += int(entry["size"])
    return mine


def side(run_dir: Path, name: str, overrides: tuple[str, ...], failed: list[str]) -> dict[str, Any]:
    """One mode's run and its figures; a run that did not complete is a failed side."""
    started = time.monotonic()
    done = submit(run_dir, *overrides)
    figures = result(run_dir)
    if done.returncode != 0 or figures.get("status") != "completed":
        failed.append(f"{name}: did not train ({done.stderr.strip().splitlines()[-1:] or done.returncode})")
        return {}
    measured = {"samples_per_s": figures["samples_per_s"], "wall_s": round(time.monotonic() - started, 1),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in figures["ranks"]), "auc": figures.get("auc"),
                "checkpoint_bytes_a_rank": max(checkpoint_bytes(run_dir)), "param_digest": figures["param_digest"]}
    print(f"bench_sharded: {name}: {measured}", file=sys.stderr, flush=True)
    return measured


def resume_figures(scratch: Path, steps: int, failed: list[str]) -> dict[str, Any]:
    """On lines whose clicks follow a rule (an AUC to compare): the torchrec job straight, then killed (SIGKILL
    of rank 1) mid-run and restarted from its checkpoint, then preempted at 2 and 1 ranks and done at 3."""
    from jobctl import RunningJob, attempts
    from rec_store import criteo_text

    (scratch / "train-rule.tsv").write_text(criteo_text(40_000, seed=0))
    (scratch / "eval-rule.tsv").write_text(criteo_text(4_000, seed=1))
    store = prepare(scratch, 100_000, "-rule")
    sharded = job(store, 100_000, steps, "parallel=torchrec", "telemetry.debug_slow_rank=0",
                  "telemetry.debug_slow_ms=20")
    straight = side(scratch / "rule", "torchrec on the rule's lines", sharded, failed)
    def interrupt(run_dir: Path, after: int, rank: int, signum: int, *more: str) -> None:
        running = RunningJob(run_dir, *sharded, *more)
        try:
            running.wait_for_step(after, timeout=900)
            running.signal_rank(rank, signum)
            running.wait()
        except (AssertionError, TimeoutError) as err:  # a run that ended (or hung) before its signal
            failed.append(f"{run_dir.name}: not interrupted at step {after} ({err!r}): {running.output()[-600:]}")
            running.wait()  # its end, whatever it is: the next run of the run dir must find its lease free

    interrupt(scratch / "killed", steps // 2 + 1, 1, signal.SIGKILL, "cluster.max_restarts=1")
    same = result(scratch / "killed").get("param_digest") == straight.get("param_digest")
    if not same:
        failed.append("kill and resume: another param_digest than straight")
    elastic = scratch / "elastic"
    for ranks in (2, 1):  # each caught a few steps after where the last attempt stopped (its steps are logged)
        after = (attempts(elastic)[-1]["steps_done"] if elastic.exists() else 0) + steps // 4 + 1
        interrupt(elastic, after, 0, signal.SIGUSR2, "cluster.max_preemptions=0", f"resources.procs_per_node={ranks}")
    done = submit(elastic, *sharded, "resources.procs_per_node=3")
    last = result(elastic)
    worlds = [a["world_size"] for a in attempts(elastic)]
    auc_delta = abs(last.get("auc", 0.0) - straight.get("auc", 1.0))
    if done.returncode != 0 or worlds != [2, 1, 3] or last.get("samples") != steps * 512 or auc_delta > AUC_DELTA:
        failed.append(f"elastic 2 -> 1 -> 3: worlds {worlds}, samples {last.get('samples')}, "
                      f"AUC off by {auc_delta:.4f}")
    return {"straight_auc": straight.get("auc"), "killed_same_digest": same, "elastic_worlds": worlds,
            "elastic_auc": last.get("auc"), "elastic_auc_delta": round(auc_delta, 5)}


def plan_figures(scratch: Path, failed: list[str]) -> dict[str, Any]:
    reference = ("-m", "gpujobs.plan", "+experiment=dlrm_dcnv2", "resources.gpus_per_node=3",
                 "resources.gpu_mem_gib=16")
    figures = {}
    for nodes, code in ((4, 0), (1, 2)):
        started = time.monotonic()
        done = run(*reference, f"resources.nodes={nodes}", cwd=scratch)
        seconds = round(time.monotonic() - started, 2)
        figures[f"plan_{nodes}_nodes_s"] = seconds
        if done.returncode != code or seconds > PLAN_S:
            failed.append(f"gpujobs plan on {nodes} node(s): exit {done.returncode} in {seconds} s")
    return figures


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--steps", type=int, default=40)
    args.add_argument("--rows", type=int, default=200_000)
    args.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    opts = args.parse_args()
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench_sharded-") as tmp:
        scratch = Path(tmp)
        write_criteo_file(scratch / "train.tsv", opts.rows, seed=0)
        write_criteo_file(scratch / "eval.tsv", max(2048, opts.rows // 10), seed=1)
        store = prepare(scratch, 100_000)
        ddp = side(scratch / "ddp", "ddp", job(store, 100_000, opts.steps), failed)
        sharded = side(scratch / "torchrec", "torchrec", job(store, 100_000, opts.steps, "parallel=torchrec"), failed)
        figures: dict[str, Any] = {"ddp": ddp, "torchrec": sharded}
        if ddp and sharded:
            figures["speedup"] = round(sharded["samples_per_s"] / ddp["samples_per_s"], 2)
            figures["peak_rss_ratio"] = round(sharded["peak_rss_mb"] / ddp["peak_rss_mb"], 3)
            figures["checkpoint_bytes_ratio"] = round(
                sharded["checkpoint_bytes_a_rank"] / ddp["checkpoint_bytes_a_rank"], 3)
            for key, bar, above in (("speedup", SPEEDUP, True), ("peak_rss_ratio", RSS_RATIO, False),
                                    ("checkpoint_bytes_ratio", CKPT_RATIO, False)):
                if (figures[key] < bar) if above else (figures[key] > bar):
                    failed.append(f"{key} {figures[key]} against a bar of {bar}")
        big = prepare(scratch, 2_000_000)
        refused = submit(scratch / "big-ddp", *job(big, 2_000_000, opts.steps))
        lines = refused.stderr.strip().splitlines()
        figures["big_ddp_refusal"] = lines[-1] if lines else ""
        if refused.returncode != 2 or len(lines) != 1 or "parallel='ddp'" not in lines[0]:
            failed.append(f"2,000,000 buckets under ddp: exit {refused.returncode}, not one refusal line")
        big_sharded = side(scratch / "big-torchrec", "torchrec at 2,000,000 buckets",
                           job(big, 2_000_000, max(4, opts.steps // 4), "parallel=torchrec"), failed)
        figures["big_torchrec"] = big_sharded
        if big_sharded and big_sharded["peak_rss_mb"] > BIG_RSS_MB:
            failed.append(f"torchrec at 2,000,000 buckets: {big_sharded['peak_rss_mb']} MB peak RSS a rank")
        figures.update(resume_figures(scratch, opts.steps, failed))
        figures.update(plan_figures(scratch, failed))
    figures["failed"] = failed
    print(json.dumps(figures, indent=None if opts.json else 2))
    for line in failed:
        print(f"bench_sharded: FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

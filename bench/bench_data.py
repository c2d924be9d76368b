"""The sample store against today's Criteo path, side by side in one invocation (issue 27).

    python bench/bench_data.py [--rows 200000] [--rounds 5] [--store-rows 1000000] [--steps 400] [--json PATH]

On generated Criteo-format files (the Kaggle release's 26 category cardinalities, Zipf-skewed values, a
tenth of the fields missing; about 240 bytes a line, as the real logs):

1. prepare, rows/s of one worker process: today's `read_criteo_tsv`; the `CriteoParser` (pyarrow's
   stream, the compiled scan); the parser plus writing the shard (`prepare_shard`: column files,
   checksums, fsync, publish); pyarrow's bare `read_csv` of the same file (the library floor: same
   delimiter and types, categoricals as strings or as bytes, no transform); the parser and the floor on
   the gzip file. Single-threaded readers are timed by CPU time (a core's rate: this machine is shared);
   the parser and `prepare_shard` with a thread per CPU, and today's reader beside them, by wall time.
   Acceptance: parser >= 10x today (a core each, and a worker's threads) and >= 0.5x the floor; the
   `prepare_shard` figures are reported (their writes cost what the machine's page cache costs).
   Rounds interleave; medians.
2. reading: a rank's rows/s from a `SampleStore` (`take` of a step's rows in `IndexShuffle` order, made
   into the model's tensors) against the rec trainer's consumption (DLRM of the rec defaults forward +
   backward + Adam at batch 256 on one CPU thread). Acceptance: reading >= 3x consumption.
3. opening: in a fresh process per figure (median of three), the time from process start to step 0
   served, the time of the open alone and of open + step 0, and the growth of peak RSS (VmHWM: file-backed
   pages of the maps included) and of anonymous RSS, for a store of `--store-rows` rows and one ten times
   larger, both written directly as shards of `--store-rows` rows through the store's layout and records
   (not by parsing that many lines). Acceptance: RSS grows < 100 MB more, the time to the first step (from
   process start) <= 1.2x. Reported: the open alone (O(shards): a manifest record and a few stats a shard,
   under a millisecond) and open + step 0, whose step reads 256 rows from a cold page cache: in the
   smaller store rows share more pages of the 1-byte label column (666 distinct pages against 755).

Prints a table and one JSON object (also to --json); exit 1 when an acceptance line fails.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import torch

from gpujobs.base.atomic import write_json_atomic
from gpujobs.data.layout import StoreLayout, shard_name
from gpujobs.data.manifest import FORMAT_VERSION, ColumnFile, Manifest, ShardRecord, SourceFile
from gpujobs.data.prepare import PreparePlan, prepare_shard
from gpujobs.data.reader import SampleStore
from gpujobs.data.shuffle import IndexShuffle
from jobs.rec.config import DLRMConfig
from jobs.rec.criteo import criteo_features, read_criteo_tsv
from jobs.rec.criteo_store import NUM_CATEGORICAL, NUM_COLUMNS, NUM_INTEGER, CriteoParser

REPO = Path(__file__).resolve().parent.parent
HASH_BUCKETS = 100_000  # conf/data/criteo.yaml
BATCH = 256  # conf/data/criteo.yaml: per rank
#: The Kaggle (Display Advertising Challenge) release's distinct values of C1..C26.
CARDINALITIES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
MIN_VS_TODAY, MIN_VS_FLOOR, MIN_READ_VS_TRAIN, MAX_RSS_GROWTH_MB, MAX_TIME_RATIO = 10.0, 0.5, 3.0, 100.0, 1.2


# --- generated inputs ---------------------------------------------------------------------------


def write_criteo_file(path: Path, rows: int, seed: int, block: int = 50_000) -> None:
    """`rows` Criteo-format lines: label, 13 heavy-tailed counts (a fifth missing), 26 hex categories."""
    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as out:
        for start in range(0, rows, block):
            count = min(block, rows - start)
            columns: list[np.ndarray] = [rng.integers(0, 2, count).astype(str)]
            for _ in range(NUM_INTEGER):
                counts = np.minimum(rng.zipf(1.5, count) - 1, 10**6).astype(str).astype(object)
                counts[rng.random(count) < 0.2] = ""
                columns.append(counts)
            for cardinality in CARDINALITIES:
                value = np.minimum(rng.zipf(1.2, count), cardinality).astype(np.uint64)
                scrambled = (value * np.uint64(2654435761) + np.uint64(cardinality)) & np.uint64(0xFFFFFFFF)
                text = np.char.mod("%08x", scrambled).astype(object)
                text[rng.random(count) < 0.1] = ""
                columns.append(text)
            out.write("".join("\t".join(fields) + "\n" for fields in zip(*columns, strict=True)))


def write_store(root: Path, rows: int, shard_rows: int, seed: int) -> None:
    """A finished store of `rows` random rows in shards of `shard_rows`, written through the store's layout
    and records (what prepare leaves, without parsing): column files, shard.json each, manifest.json last."""
    parser = CriteoParser(hash_buckets=HASH_BUCKETS)
    layout = StoreLayout(root)
    rng = np.random.default_rng(seed)
    shards = []
    for index, start in enumerate(range(0, rows, shard_rows)):
        count = min(shard_rows, rows - start)
        name = shard_name("train", index)
        values = {"label": rng.integers(0, 2, count, dtype=np.uint8),
                  "dense": rng.random((count, NUM_INTEGER), dtype=np.float32),
                  "sparse": rng.integers(0, HASH_BUCKETS + 1, (count, NUM_CATEGORICAL), dtype=np.int32)}
        layout.shard_dir(name).mkdir(parents=True)
        files = []
        for spec in parser.columns():
            path = layout.column_file(name, spec.name)
            data = np.ascontiguousarray(values[spec.name], dtype=spec.dtype).tobytes()
            path.write_bytes(data)
            info = path.stat()
            files.append(ColumnFile(spec.name, info.st_size, info.st_mtime_ns, hashlib.sha256(data).hexdigest()))
        record = ShardRecord(name, "train", count, SourceFile(f"generated:{seed}:{index}", 0, 0), 0, tuple(files))
        write_json_atomic(layout.shard_record(name), record.to_json())
        shards.append(record)
    manifest = Manifest(FORMAT_VERSION, parser.name, parser.settings(), parser.columns(), tuple(shards))
    write_json_atomic(layout.manifest, manifest.to_json())


# --- 1. prepare ---------------------------------------------------------------------------------


def _rate(work: Callable[[], int], clock: Callable[[], float]) -> float:
    """Rows per second of `clock` (CPU time of this process, or wall time) doing `work` (which returns its rows)."""
    start = clock()
    rows = work()
    return rows / (clock() - start)


def _bare_read(path: Path, categories: pa.DataType) -> int:
    """pyarrow's read of the file with the parser's delimiter and types, but plain columns and no transform."""
    names = [f"c{i}" for i in range(NUM_COLUMNS)]
    types = {name: pa.int64() if i <= NUM_INTEGER else categories for i, name in enumerate(names)}
    table = pa_csv.read_csv(
        path, read_options=pa_csv.ReadOptions(column_names=names, use_threads=False),
        parse_options=pa_csv.ParseOptions(delimiter="\t", quote_char=False, ignore_empty_lines=False),
        convert_options=pa_csv.ConvertOptions(column_types=types, null_values=[""], strings_can_be_null=False))
    return table.num_rows


def _today(path: Path) -> int:
    return len(read_criteo_tsv(path, HASH_BUCKETS).label)


def _parse(path: Path, threads: int = 1) -> int:
    chunks = CriteoParser(HASH_BUCKETS, threads=threads).parse(path, "fail")
    return sum(len(chunk.columns["label"]) for chunk in chunks)


def _prepare_one(path: Path, store: Path, threads: int = 1) -> int:
    plan = PreparePlan(store, {"train": (path,), "eval": ()}, CriteoParser(HASH_BUCKETS, threads=threads), "fail")
    return prepare_shard(plan, "train", 0).rows


def bench_prepare(plain: Path, packed: Path, rounds: int, scratch: Path) -> dict[str, float]:
    """Median rows/s of each way to read the file (plain, and gzip: `packed`), rounds interleaved.

    Single-threaded readers are timed by this process's CPU time (a core's rate, whatever else runs here);
    the parser with a thread per CPU by wall time (a worker process's rate when it has the node to itself).
    """
    cpu, wall = time.process_time, time.perf_counter
    threads = len(os.sched_getaffinity(0))
    cases: dict[str, tuple[Callable[[int], int], Callable[[], float]]] = {
        "read_criteo_tsv": (lambda r: _today(plain), cpu),
        "bare read_csv, string": (lambda r: _bare_read(plain, pa.string()), cpu),
        "bare read_csv, binary": (lambda r: _bare_read(plain, pa.binary()), cpu),
        "CriteoParser": (lambda r: _parse(plain), cpu),
        "CriteoParser + prepare_shard": (lambda r: _prepare_one(plain, scratch / f"store-{r}"), cpu),
        "bare read_csv, string, .gz": (lambda r: _bare_read(packed, pa.string()), cpu),
        "CriteoParser, .gz": (lambda r: _parse(packed), cpu),
        f"CriteoParser, {threads} threads (wall)": (lambda r: _parse(plain, threads), wall),
        f"CriteoParser + prepare_shard, {threads} threads (wall)": (
            lambda r: _prepare_one(plain, scratch / f"store-wall-{r}", threads), wall),
        "read_criteo_tsv (wall)": (lambda r: _today(plain), wall),
    }
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds + 1):  # round 0 warms up (numba's compiled scan, the page cache) and is not kept
        for name, (case, clock) in cases.items():
            rate = _rate(functools.partial(case, r), clock)
            if r:
                rates[name].append(rate)
    return {name: statistics.median(values) for name, values in rates.items()}


# --- 2. reading against training ----------------------------------------------------------------


def _as_model_inputs(rows: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's columns as the rec model takes them: float32 dense, int64 sparse, float32 labels."""
    return (torch.from_numpy(rows["dense"]), torch.from_numpy(rows["sparse"]).long(),
            torch.from_numpy(rows["label"]).float())


def bench_reading(store_path: Path, steps: int) -> float:
    """A rank's rows/s from the store: `steps` steps of BATCH rows, in an epoch's shuffled order."""
    parser = CriteoParser(HASH_BUCKETS)
    store = SampleStore.open(store_path, parser.name, parser.settings())
    order = IndexShuffle(store.rows("train"), key=12345)
    start = time.perf_counter()
    for step in range(steps):
        positions = np.arange(step * BATCH, (step + 1) * BATCH, dtype=np.int64) % store.rows("train")
        _as_model_inputs(store.take("train", order(positions)))
    return steps * BATCH / (time.perf_counter() - start)


def bench_training(steps: int) -> float:
    """Samples/s of the rec model (DLRM, rec defaults) training at BATCH on one CPU thread: forward, backward, Adam."""
    torch.set_num_threads(1)  # a rank's share of a CPU node; the reading side is single-threaded too
    torch.manual_seed(0)
    model = DLRMConfig().build(criteo_features(HASH_BUCKETS))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.002)  # conf/optim/adam.yaml
    generator = torch.Generator().manual_seed(0)
    dense = torch.rand(BATCH, NUM_INTEGER, generator=generator)
    sparse = torch.randint(0, HASH_BUCKETS + 1, (BATCH, NUM_CATEGORICAL), generator=generator)
    labels = torch.randint(0, 2, (BATCH,), generator=generator).float()
    times = []
    for _ in range(3 + steps):  # the first three warm up
        start = time.perf_counter()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return BATCH / statistics.median(times[3:])


# --- 3. opening a store: a fresh process per figure ---------------------------------------------


def first_step(store_path: Path, started: float) -> dict[str, float]:
    """Open the store and serve step 0 of epoch 0 in this fresh process, started at `started` (time.time())."""
    baseline_mb, baseline_anon_mb = _memory_mb("VmRSS"), _memory_mb("RssAnon")  # interpreter, imports
    start = time.perf_counter()
    parser = CriteoParser(HASH_BUCKETS)
    store = SampleStore.open(store_path, parser.name, parser.settings())
    opened = time.perf_counter()
    order = IndexShuffle(store.rows("train"), key=12345)
    _as_model_inputs(store.take("train", order(np.arange(BATCH, dtype=np.int64))))
    return {"process_start_to_step_s": time.time() - started, "open_s": opened - start,
            "open_and_step_s": time.perf_counter() - start,
            "rss_growth_mb": _memory_mb("VmHWM") - baseline_mb, "peak_rss_mb": _memory_mb("VmHWM"),
            "anon_rss_growth_mb": _memory_mb("RssAnon") - baseline_anon_mb}


def _memory_mb(field: str) -> float:
    """VmRSS (resident now), VmHWM (peak resident) or RssAnon (resident, not file-backed) of this process,
    from /proc (ru_maxrss would carry the parent's peak across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _drop_cached(stores: list[Path]) -> None:
    """Ask the kernel to drop the stores' files from its page cache (clean pages go; no root needed)."""
    for store in stores:
        for path in store.rglob("*.bin"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def bench_opening(stores: list[Path], tries: int = 3) -> list[dict[str, float]]:
    """For each store, medians over `tries` fresh processes of `first_step`; the stores take turns, so that
    both meet the same page cache (writing the larger one evicts the interpreter's libraries)."""
    runs: list[list[dict[str, float]]] = [[] for _ in stores]
    os.sync()  # the stores' pages clean, so that the kernel may drop them
    for _ in range(tries):
        for number, store in enumerate(stores):
            _drop_cached(stores)  # every try reads its rows from the disk: a warm small store is no baseline
            command = [sys.executable, __file__, "--first-step", str(store), "--started", repr(time.time())]
            done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO)
            runs[number].append(json.loads(done.stdout))
    return [{key: statistics.median(run[key] for run in store_runs) for key in store_runs[0]} for store_runs in runs]


# --- the report ---------------------------------------------------------------------------------


def report(prepare: dict[str, float], read: float, train: float, small: dict[str, float],
           large: dict[str, float], store_rows: int) -> tuple[dict[str, Any], list[str]]:
    """The JSON result, and the failed acceptance lines."""
    threaded = next(name for name in prepare if name.startswith("CriteoParser, ") and "threads" in name)
    checks = {
        "parser / read_criteo_tsv, a core each": (
            prepare["CriteoParser"] / prepare["read_criteo_tsv"], MIN_VS_TODAY, ">="),
        "parser threads / read_criteo_tsv, wall": (
            prepare[threaded] / prepare["read_criteo_tsv (wall)"], MIN_VS_TODAY, ">="),
        "parser / bare read (string)": (prepare["CriteoParser"] / prepare["bare read_csv, string"], MIN_VS_FLOOR, ">="),
        "parser / bare read (binary)": (prepare["CriteoParser"] / prepare["bare read_csv, binary"], MIN_VS_FLOOR, ">="),
        "parser / bare read (string), .gz": (
            prepare["CriteoParser, .gz"] / prepare["bare read_csv, string, .gz"], MIN_VS_FLOOR, ">="),
        "store read / training": (read / train, MIN_READ_VS_TRAIN, ">="),
        "peak RSS growth, 10x store - 1x (MB)": (
            large["rss_growth_mb"] - small["rss_growth_mb"], MAX_RSS_GROWTH_MB, "<"),
        "anonymous RSS growth, 10x - 1x (MB)": (
            large["anon_rss_growth_mb"] - small["anon_rss_growth_mb"], MAX_RSS_GROWTH_MB, "<"),
        "process start to step 0, 10x / 1x": (
            large["process_start_to_step_s"] / small["process_start_to_step_s"], MAX_TIME_RATIO, "<="),
    }
    failed = [name for name, (value, bar, op) in checks.items()
              if not (value >= bar if op == ">=" else value < bar if op == "<" else value <= bar)]
    result = {"prepare_rows_per_s": prepare, "read_rows_per_s": read, "train_samples_per_s": train,
              "open_first_step": {str(store_rows): small, str(10 * store_rows): large},
              "checks": {name: {"value": value, "bar": f"{op} {bar}"} for name, (value, bar, op) in checks.items()},
              "reported": {"open alone, 10x - 1x (ms)": 1e3 * (large["open_s"] - small["open_s"]),
                           "open + step 0, 10x / 1x": large["open_and_step_s"] / small["open_and_step_s"]},
              "failed": failed}
    return result, failed


def print_table(result: dict[str, Any]) -> None:
    print(f"{'prepare (rows per CPU s, or per wall s)':<44}{'rows/s':>14}")
    for name, rate in result["prepare_rows_per_s"].items():
        print(f"  {name:<42}{rate:>14,.0f}")
    print(f"{'read from store (take + tensors)':<44}{result['read_rows_per_s']:>14,.0f} rows/s")
    print(f"{'train (DLRM, batch 256, 1 CPU thread)':<44}{result['train_samples_per_s']:>14,.0f} samples/s")
    for rows, figures in result["open_first_step"].items():
        print(f"  store of {int(rows):>11,} rows: start to step 0 {figures['process_start_to_step_s']:6.2f} s, "
              f"open {figures['open_s'] * 1e3:5.1f} ms, open + step 0 {figures['open_and_step_s'] * 1e3:6.1f} ms, "
              f"peak RSS +{figures['rss_growth_mb']:.1f} MB "
              f"(to {figures['peak_rss_mb']:.0f}; anonymous +{figures['anon_rss_growth_mb']:.1f})")
    for name, check in result["checks"].items():
        mark = "FAIL" if name in result["failed"] else "ok"
        print(f"  {mark:<5}{name:<40}{check['value']:>10.2f}  (bar {check['bar']})")
    for name, value in result["reported"].items():
        print(f"  {'info':<5}{name:<40}{value:>10.2f}  (no bar)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000, help="lines of the generated Criteo file")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of part 1 (medians)")
    parser.add_argument("--store-rows", type=int, default=1_000_000, help="the smaller store; the larger is 10x")
    parser.add_argument("--steps", type=int, default=400, help="steps of the reading side (training: 20)")
    parser.add_argument("--json", type=Path, help="also write the JSON result here")
    parser.add_argument("--first-step", type=Path, help=argparse.SUPPRESS)  # the child of part 3
    parser.add_argument("--started", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_step:
        print(json.dumps(first_step(args.first_step, args.started)))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-data-") as scratch_dir:
        scratch = Path(scratch_dir)
        plain, packed = scratch / "day_0.tsv", scratch / "day_0.tsv.gz"
        write_criteo_file(plain, args.rows, seed=0)
        packed.write_bytes(gzip.compress(plain.read_bytes(), compresslevel=6, mtime=0))
        prepare = bench_prepare(plain, packed, args.rounds, scratch)
        write_store(scratch / "small", args.store_rows, args.store_rows, seed=2)
        read, train = bench_reading(scratch / "small", args.steps), bench_training(20)
        write_store(scratch / "large", 10 * args.store_rows, args.store_rows, seed=3)
        small, large = bench_opening([scratch / "small", scratch / "large"])
    result, failed = report(prepare, read, train, small, large, args.store_rows)
    print_table(result)
    print(json.dumps(result, indent=2))
    if args.json:
        write_json_atomic(args.json, result)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

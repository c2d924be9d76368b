"""`gpujobs prepare` as users run it: real Criteo-format day files (plain and gzip) prepared into a store in a
subprocess, then a real local training run from that store.

The config is refused as submit refuses it (one line, exit 2, the same words); the prepare never imports
torch; a rerun touches nothing; a bad line fails naming its file and line, or is skipped and counted under
`data.bad_lines=skip`; a second prepare of a store that one is preparing is refused, naming the first.
"""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, read_result, submit

from gpujobs.cli.main import COMMANDS
from gpujobs.data.manifest import read_manifest

#: Rows per generated day file: enough for a few steps of two ranks, small enough for seconds per prepare.
DAY_ROWS = 1500
EVAL_ROWS = 600
#: A tiny local training run from a store: CPU, 2 gloo ranks (the rec experiment's), a handful of steps.
TINY_TRAIN = ("resources.gpus_per_node=0", "trainer.max_steps=6", "trainer.eval_every=6", "trainer.log_every=3",
              "checkpoint.every_steps=3", "data.batch_size=32")


def criteo_lines(rows: int, seed: int) -> list[str]:
    """`rows` Criteo-format lines: a label, 13 counts (some missing), 26 hex categories (some missing).

    The label leans on the first count and the first category, so a model has something to learn.
    """
    rng = np.random.default_rng(seed)
    counts = rng.geometric(0.2, size=(rows, 13)) - 1
    categories = rng.integers(0, 50, size=(rows, 26))
    labels = (rng.random(rows) < np.where((counts[:, 0] > 3) | (categories[:, 0] < 10), 0.7, 0.15)).astype(int)
    lines = []
    for row in range(rows):
        ints = ["" if (row + col) % 11 == 0 else str(counts[row, col]) for col in range(13)]
        hexes = [f"{value * 2654435761 % 2**32:08x}" for value in categories[row]]
        cats = ["" if (row + col) % 13 == 0 else hexes[col] for col in range(26)]
        lines.append("\t".join([str(labels[row]), *ints, *cats]) + "\n")
    return lines


def write_day(path: Path, lines: list[str]) -> Path:
    """The lines as a day file: gzip where the name ends in .gz, plain text otherwise."""
    data = "".join(lines).encode()
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
    return path


def write_days(folder: Path) -> Path:
    """Two train days (one plain, one gzip) and one gzip eval file in `folder`."""
    write_day(folder / "day_0.tsv", criteo_lines(DAY_ROWS, 0))
    write_day(folder / "day_1.tsv.gz", criteo_lines(DAY_ROWS, 1))
    write_day(folder / "eval_0.tsv.gz", criteo_lines(EVAL_ROWS, 2))
    return folder


@pytest.fixture(scope="module")
def days(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_days(tmp_path_factory.mktemp("days"))


def criteo(days: Path, store: Path, *more: str) -> tuple[str, ...]:
    """The overrides of the rec job on these days and this store."""
    return ("+experiment=rec", "data=criteo", f"data.train_files={days}/day_*",
            f"data.eval_files=[{days}/eval_0.tsv.gz]", f"data.store={store}", "data.hash_buckets=1000", *more)


def here(overrides: tuple[str, ...] | list[str]) -> list[str]:
    """`overrides` with `cluster=local` unless they name a cluster: on a machine that can submit to Slurm
    (CI's, with the test cluster up) the default cluster would queue the prepare as a job array."""
    return [*overrides] if any(o.startswith("cluster=") for o in overrides) else [*overrides, "cluster=local"]


def prepare(*overrides: str, cwd: Path, module: bool = True) -> subprocess.CompletedProcess[str]:
    """`python -m gpujobs.prepare OVERRIDES` (or the `gpujobs prepare` console script) in a subprocess,
    here (`cluster=local`) unless the overrides name a cluster."""
    command = [sys.executable, "-m", "gpujobs.prepare"] if module else [str(Path(sys.executable).with_name("gpujobs")),
                                                                         "prepare"]
    return subprocess.run([*command, *here(overrides)], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The one line a refusal prints, checked to be one line and no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def shard_files(store: Path) -> dict[str, tuple[int, int]]:
    """Each file under the store's shards/: (inode, mtime_ns), which a rewrite or a republish changes."""
    return {str(path.relative_to(store)): (path.stat().st_ino, path.stat().st_mtime_ns)
            for path in sorted((store / "shards").rglob("*")) if path.is_file()}


def test_prepare_is_a_gpujobs_command_with_its_own_help(tmp_path: Path) -> None:
    assert "prepare" in COMMANDS
    listed = subprocess.run([sys.executable, "-m", "gpujobs.cli.main", "--help"], capture_output=True, text=True,
                            check=True).stdout
    assert "\n  prepare " in listed
    module = prepare("--help", cwd=tmp_path)
    command = prepare("--help", cwd=tmp_path, module=False)
    assert module.returncode == command.returncode == 0, module.stderr + command.stderr
    assert "data.store" in command.stdout and "OVERRIDE" in command.stdout
    assert module.stdout.replace("prepare.py", "gpujobs prepare") == command.stdout


@pytest.mark.parametrize("overrides", [
    ("+experiment=rec", "data=nope"),
    ("+experiment=rec", "data=criteo", "data.batch_size=0"),
    ("+experiment=rec", "data.no_such_key=1"),
    ("+experiment=rec", "optim.lr=${oops}"),
    ("+experiment=rec", "resources.nodes=0"),
])
def test_a_bad_config_is_refused_in_the_words_of_submit(tmp_path: Path, overrides: tuple[str, ...]) -> None:
    refused = prepare(*overrides, cwd=tmp_path)
    submitted = submit(tmp_path / "run", *overrides, "cluster=local")
    assert refused.returncode == submitted.returncode == 2, refused.stderr + submitted.stderr
    assert one_line(refused) == one_line(submitted)
    assert not (tmp_path / "run").exists() and not (tmp_path / "outputs").exists()  # a prepare makes no run dir


def test_a_data_config_with_nothing_to_prepare_is_refused_without_torch(tmp_path: Path) -> None:
    script = """
import sys
from gpujobs.cli.prepare import main
code = main(["+experiment=rec", "data=synthetic"])
assert "torch" not in sys.modules, "gpujobs prepare imported torch"
sys.exit(code)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert one_line(proc) == ("gpujobs: config error: data='synthetic' is invalid: allowed a data config with input "
                              "files to prepare into a store (data=criteo); this one has nothing to prepare")


def test_prepare_then_train_from_the_store_and_a_rerun_touches_nothing(days: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    script = f"""
import sys
from gpujobs.cli.prepare import main
code = main({here(criteo(days, store, 'data.prepare_workers=1'))!r})
assert "torch" not in sys.modules, "gpujobs prepare imported torch"
sys.exit(code)
"""
    first = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "1 worker process," in first.stdout
    final = first.stdout.strip().splitlines()[-1]
    assert final.startswith("gpujobs prepare: done in ") and final.endswith(
        f" s: train {2 * DAY_ROWS} rows in 2 shards, eval {EVAL_ROWS} rows in 1 shard, 0 bad lines skipped"), final
    manifest = read_manifest(store)
    assert (manifest.rows("train"), manifest.rows("eval")) == (2 * DAY_ROWS, EVAL_ROWS)
    assert [shard.source.path for shard in manifest.shards] == [
        str(days / "day_0.tsv"), str(days / "day_1.tsv.gz"), str(days / "eval_0.tsv.gz")]

    published, manifest_bytes = shard_files(store), (store / "manifest.json").read_bytes()
    again = prepare(*criteo(days, store), "cluster=slurm", cwd=tmp_path, module=False)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "every shard was prepared already: nothing queued" in again.stdout  # nothing reached sbatch
    assert shard_files(store) == published and (store / "manifest.json").read_bytes() == manifest_bytes

    run_dir = tmp_path / "run"
    trained = submit(run_dir, *criteo(days, store), "cluster=local", *TINY_TRAIN)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    result = read_result(run_dir)
    assert result["status"] == "completed" and result["steps"] == 6
    assert 0.0 <= result["auc"] <= 1.0 and result["logloss"] > 0


def test_a_bad_line_fails_naming_its_file_and_line_and_publishes_no_store(days: Path, tmp_path: Path) -> None:
    lines = criteo_lines(40, 5)
    lines[2] = "2" + lines[2][1:]  # line 3: a label that is neither 0 nor 1
    write_day(tmp_path / "bad.tsv.gz", lines)
    store = tmp_path / "store"
    proc = prepare("+experiment=rec", "data=criteo", f"data.train_files={tmp_path}/bad.tsv.gz",
                   f"data.eval_files={days}/eval_0.tsv.gz", f"data.store={store}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_line(proc)
    assert line.startswith("gpujobs: ") and "bad.tsv.gz:3:" in line and "label" in line, line
    assert not (store / "manifest.json").exists()


def test_bad_lines_skip_counts_them_in_the_manifest_and_the_output(days: Path, tmp_path: Path) -> None:
    lines = criteo_lines(60, 6)
    lines[4] = "1\t2\t3\n"  # line 5: 3 fields, not 40
    lines[9] = lines[9].replace("\t", "\tx", 1)  # line 10: the first count is not an integer
    write_day(tmp_path / "bad.tsv", lines)
    store = tmp_path / "store"
    proc = prepare("+experiment=rec", "data=criteo", f"data.train_files={tmp_path}/bad.tsv",
                   f"data.eval_files={days}/eval_0.tsv.gz", f"data.store={store}", "data.bad_lines=skip", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "train 58 rows in 1 shard, eval" in proc.stdout and "2 bad lines skipped" in proc.stdout, proc.stdout
    manifest = read_manifest(store)
    assert [(shard.name, shard.rows, shard.bad_lines) for shard in manifest.shards] == [
        ("train-00000", 58, 2), ("eval-00000", EVAL_ROWS, 0)]
    assert json.loads((store / "manifest.json").read_text())["shards"][0]["bad_lines"] == 2


def test_a_store_that_cannot_be_made_is_refused_naming_data_store(days: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    store = tmp_path / "file" / "store"  # under a file: no directory can be made there
    proc = prepare(*criteo(days, store), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_line(proc)
    assert line.startswith(f"gpujobs: config error: data.store='{store}'") and "Not a directory" in line, line


def stop_holding_the_lock(proc: subprocess.Popen[str], lock: Path) -> None:
    """SIGSTOP `proc` at a moment it holds the store's lock (flock'ed, its pid written), so that it is surely
    preparing while another prepare asks: stopped, it cannot finish meanwhile."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the first prepare ended before the second could ask: give it more to do"
        if lock.exists() and str(proc.pid) in lock.read_text():
            os.kill(proc.pid, signal.SIGSTOP)
            with lock.open() as probe:
                try:
                    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return  # held: the moment sought
                fcntl.flock(probe, fcntl.LOCK_UN)
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.002)
    raise AssertionError("the first prepare never held the store's lock")


def test_a_second_prepare_of_a_store_being_prepared_is_refused(days: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = subprocess.Popen([sys.executable, "-m", "gpujobs.prepare", *here(criteo(days, store))], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stop_holding_the_lock(first, store / ".prepare.lock")
        second = prepare(*criteo(days, store), cwd=tmp_path)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out, err = first.communicate(timeout=120)
    assert second.returncode == 2, second.stdout + second.stderr
    line = one_line(second)
    assert line.startswith("gpujobs: config error: data.store=") and f"pid {first.pid}" in line, line
    assert first.returncode == 0, out + err  # the first, let go, finishes its store
    assert read_manifest(store).rows("train") == 2 * DAY_ROWS


def test_the_readme_one_liner_prepares_and_trains(days: Path, tmp_path: Path) -> None:
    """A plain TSV one command away: the README's prepare-then-train line, run by a shell as written."""
    readme = (REPO / "README.md").read_text()
    (line,) = [text for text in readme.splitlines() if text.startswith("gpujobs prepare ") and "&&" in text]
    command = (line.replace("a.tsv", str(days / "day_0.tsv")).replace("b.tsv", str(days / "eval_0.tsv.gz"))
               .replace("/tmp/store", str(tmp_path / "store"))
               .replace("data=criteo", "data=criteo data.hash_buckets=1000")  # both commands: small tables
               .replace("gpujobs prepare", "gpujobs prepare cluster=local")  # CI's machine can submit to Slurm
               .replace("gpujobs submit", f"gpujobs submit hydra.run.dir={tmp_path / 'run'} cluster=local "
                        + " ".join(TINY_TRAIN)))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, command + "\n" + proc.stdout + proc.stderr
    assert read_result(tmp_path / "run")["status"] == "completed"

"""Criteo-format files: today's in-memory reader and the store's parser, which must agree with it."""

from __future__ import annotations

import gzip
import hashlib
import math
import random
import re
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from gpujobs.data.prepare import BadLineError, PreparePlan, prepare_store
from gpujobs.data.reader import SampleStore
from jobs.rec.criteo import CriteoFormatError, read_criteo_tsv
from jobs.rec.criteo_scan import _compile
from jobs.rec.criteo_store import CriteoParser
from jobs.rec.features import HASH_BUCKETS_ALLOWED, MAX_HASH_BUCKETS, criteo_features

REPO = Path(__file__).resolve().parent.parent


def _criteo_line(label: str, ints: list[str], cats: list[str]) -> str:
    return "\t".join([label, *ints, *cats]) + "\n"


def _random_lines(count: int, seed: int) -> list[str]:
    """Lines with what real logs hold: missing fields, negatives, huge counts, hex and non-ASCII categories."""
    rng = random.Random(seed)
    ints = ["", "0", "-2", "7", "123456", "99999999999999999999", " 5", "007"]
    cats = ["", "68fd1e64", "a", "05db9164", "é€", "x" * 40, "0x1f"]
    return [
        _criteo_line(rng.choice("01"), [rng.choice(ints) for _ in range(13)], [rng.choice(cats) for _ in range(26)])
        for _ in range(count)
    ]


def _fast_lines(count: int, seed: int) -> list[str]:
    """Lines in the plain form (no 0x, no 19-digit count, no space): the compiled pass, not the fallback."""
    rng = random.Random(seed)
    return [_criteo_line(rng.choice("01"), [rng.choice(["", "0", "-3", "41", "65535"]) for _ in range(13)],
                         [rng.choice(["", "68fd1e64", "b", "é€", "y" * 33]) for _ in range(26)])
            for _ in range(count)]


def _parse_all(parser: CriteoParser, path: Path, bad_lines: str = "fail") -> tuple[dict[str, np.ndarray], int]:
    """Every chunk of `path` joined: (column name -> array, lines skipped), checked against the ColumnSpecs."""
    chunks = list(parser.parse(path, bad_lines))
    columns = {}
    for spec in parser.columns():
        parts = [chunk.columns[spec.name] for chunk in chunks]
        for part in parts:
            assert part.dtype == np.dtype(spec.dtype)
            assert part.shape[1:] == (() if spec.width == 1 else (spec.width,))
        columns[spec.name] = np.concatenate(parts) if parts else np.empty(0)
    return columns, sum(chunk.bad_lines for chunk in chunks)


def _assert_same_as_today(columns: dict[str, np.ndarray], path: Path, hash_buckets: int | list[int]) -> None:
    today = read_criteo_tsv(path, hash_buckets)
    np.testing.assert_array_equal(columns["label"].astype(np.float32), today.label.numpy())
    np.testing.assert_array_equal(columns["dense"], today.dense.numpy())
    np.testing.assert_array_equal(columns["sparse"].astype(np.int64), today.sparse.numpy())


# --- read_criteo_tsv (today's reader) -------------------------------------------------------------


def test_criteo_reader_transforms_and_hashes(tmp_path: Path) -> None:
    ints = ["5", "", "-2", *["0"] * 10]
    cats = ["68fd1e64", "", *["a" * 8] * 24]
    path = tmp_path / "day.tsv"
    path.write_text(_criteo_line("1", ints, cats) + _criteo_line("0", [""] * 13, [""] * 26))
    batch = read_criteo_tsv(path, hash_buckets=1000)
    assert batch.label.tolist() == [1.0, 0.0]
    assert batch.dense.shape == (2, 13) and batch.sparse.shape == (2, 26)
    assert batch.dense[0, :3].tolist() == pytest.approx([math.log1p(5), 0.0, 0.0])
    assert batch.dense[1].abs().sum() == 0
    assert batch.sparse[0, 0] == 1 + zlib.crc32(b"68fd1e64") % 1000  # stable across runs, unlike hash()
    assert batch.sparse[0, 1] == 0  # missing
    assert (batch.sparse[1] == 0).all()


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("1\t2\t3\n", "expected 40 tab-separated fields"),
        (_criteo_line("1", ["7", "x1", *["0"] * 11], [""] * 26), "integer feature I2 is 'x1'"),
        (_criteo_line("yes", ["0"] * 13, [""] * 26), "label 'yes' is not 0 or 1"),
    ],
)
def test_criteo_reader_names_file_and_line_of_a_bad_line(tmp_path: Path, bad_line: str, message: str) -> None:
    good = _criteo_line("0", ["1"] * 13, ["ab"] * 26)
    path = tmp_path / "bad.tsv"
    path.write_text(good + good + bad_line + good)
    with pytest.raises(CriteoFormatError, match=f"bad.tsv:3: {message}"):
        read_criteo_tsv(path, hash_buckets=10)


# --- CriteoParser (the store's) ---------------------------------------------------------------------


def test_parser_columns_and_settings() -> None:
    parser = CriteoParser(hash_buckets=1000)
    assert [(c.name, c.dtype, c.width) for c in parser.columns()] == [
        ("label", "|u1", 1), ("dense", "<f4", 13), ("sparse", "<i4", 26)]
    assert parser.settings() == {"hash_buckets": 1000, "hash": "crc32", "dense": "log1p"}
    assert parser.name == "jobs.rec.criteo_store:CriteoParser"


#: Per-column buckets as MLPerf's tables vary them (3 to millions), a column of one bucket among them.
PER_COLUMN = [1 << 20, 3, 977, 1, 50, 7, 2, 100003, 63, 1 << 30, 10, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 15, 16, 17,
              18, 19]


@pytest.mark.parametrize("block_bytes", [1 << 20, 3000])
def test_parser_hashes_each_column_into_its_own_buckets(tmp_path: Path, block_bytes: int) -> None:
    path = tmp_path / "day.tsv"
    path.write_text("".join(_random_lines(300, seed=5) + _fast_lines(300, seed=6)), encoding="utf-8")
    parser = CriteoParser(hash_buckets=PER_COLUMN, block_bytes=block_bytes)
    columns, _ = _parse_all(parser, path)
    _assert_same_as_today(columns, path, PER_COLUMN)  # the compiled pass and the line rules, column by column
    assert (columns["sparse"].max(axis=0) <= PER_COLUMN).all()
    assert (columns["sparse"].max(axis=0)[[1, 3, 6]] == [3, 1, 2]).all()  # a small table's buckets are all used
    assert criteo_features(PER_COLUMN).cardinalities == tuple(b + 1 for b in PER_COLUMN)  # "missing" is row 0
    assert parser.settings()["hash_buckets"] == PER_COLUMN
    # the same count for every column hashes as that int does, and is recorded as an int config's store is
    assert CriteoParser(hash_buckets=[977] * 26).settings() == CriteoParser(hash_buckets=977).settings()


@pytest.mark.parametrize(("block_bytes", "threads"), [(1 << 20, 1), (3000, 1), (3000, 3)])  # many blocks: lines
def test_parser_gives_the_values_of_read_criteo_tsv(tmp_path: Path, block_bytes: int, threads: int) -> None:
    path = tmp_path / "day.tsv"  # straddle block ends; threads: blocks parsed side by side, joined in order
    path.write_text("".join(_random_lines(500, seed=1)), encoding="utf-8")
    columns, skipped = _parse_all(CriteoParser(hash_buckets=977, block_bytes=block_bytes, threads=threads), path)
    assert skipped == 0 and len(columns["label"]) == 500
    _assert_same_as_today(columns, path, 977)
    sparse = columns["sparse"]
    assert sparse.min() >= 0 and sparse.max() <= 977


def test_parser_fast_path_matches_the_line_rules(tmp_path: Path) -> None:
    path = tmp_path / "day.tsv"
    path.write_text("".join(_fast_lines(400, seed=2)), encoding="utf-8")
    parser = CriteoParser(hash_buckets=1 << 20)
    block = path.read_bytes()
    fast = parser._fast_block(block)
    assert fast is not None
    careful = parser._careful_block(path, block, first_line=1, bad_lines="fail")
    for name in ("label", "dense", "sparse"):
        np.testing.assert_array_equal(fast.columns[name], careful.columns[name])
    _assert_same_as_today(fast.columns, path, 1 << 20)


def test_crlf_line_ends_read_as_read_criteo_tsv_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "day.tsv"
    path.write_bytes(b"".join(line.encode().replace(b"\n", b"\r\n") for line in _fast_lines(50, seed=9)))
    parser = CriteoParser(hash_buckets=77, block_bytes=1000)
    assert parser._fast_block(path.read_bytes()) is not None  # the compiled pass, not the fallback
    columns, _ = _parse_all(parser, path)
    assert len(columns["label"]) == 50
    _assert_same_as_today(columns, path, 77)


PLAIN = _criteo_line("1", ["3"] * 13, ["ab"] * 26).encode()


def _one_in_plain(line: str, *, crlf: bool = False) -> bytes:
    return PLAIN * 3 + (line.replace("\n", "\r\n") if crlf else line).encode() + PLAIN


@pytest.mark.parametrize(("content", "compiled"), [
    pytest.param(_one_in_plain(_criteo_line("0", ["+5", "-0", "999999999999999999", "65535", *["0"] * 9],
                                            ["é€", "", "68fd1e64", *["z"] * 23])), True, id="sign-18-digits-utf8"),
    pytest.param(_one_in_plain(_criteo_line("0", ["4"] * 13, ["c"] * 26), crlf=True), True, id="crlf"),
    pytest.param(PLAIN * 2 + PLAIN.replace(b"\n", b"\r"), True, id="last-line-ends-in-return"),
    pytest.param(PLAIN * 2 + PLAIN[:-1], True, id="last-line-unended"),
    pytest.param(_one_in_plain(_criteo_line("0", ["9999999999999999999", *["0"] * 12], [""] * 26)), False,
                 id="19-digits"),
    pytest.param(_one_in_plain(_criteo_line("0", [" 5", *["0"] * 12], [""] * 26)), False, id="space"),
    pytest.param(_one_in_plain(_criteo_line("0", ["1_000", *["0"] * 12], [""] * 26)), False, id="underscore"),
    pytest.param(_one_in_plain(_criteo_line("0", ["\u0663", *["0"] * 12], [""] * 26)), False, id="arabic-digit"),
    pytest.param(_one_in_plain(_criteo_line("1", ["0"] * 13, ["a\rb", *[""] * 25])), False, id="return-inside"),
    pytest.param(PLAIN * 3 + PLAIN.replace(b"\n", b"\r\r\n"), False, id="two-returns"),
])
def test_the_compiled_pass_reads_plain_lines_and_leaves_the_rest_to_the_line_rules(
        tmp_path: Path, content: bytes, compiled: bool) -> None:
    """Whichever way a block goes, its values are read_criteo_tsv's: the pass takes only the plain form."""
    path = tmp_path / "day.tsv"
    path.write_bytes(content)
    parser = CriteoParser(hash_buckets=1 << 20)
    assert (parser._fast_block(content) is not None) == compiled
    columns, skipped = _parse_all(parser, path)
    assert skipped == 0 and len(columns["label"]) == content.count(b"\n") + (not content.endswith(b"\n"))
    _assert_same_as_today(columns, path, 1 << 20)


def test_a_byte_order_mark_is_a_bad_first_line_as_for_read_criteo_tsv(tmp_path: Path) -> None:
    path = tmp_path / "day.tsv"
    path.write_bytes(b"\xef\xbb\xbf" + PLAIN * 2)
    message = re.escape(f"{path}:1: label {chr(0xFEFF) + '1'!r} is not 0 or 1")  # kept in the label: not utf-8-sig
    with pytest.raises(CriteoFormatError, match=message):
        read_criteo_tsv(path, 10)
    with pytest.raises(BadLineError, match=f"^{message}"):
        list(CriteoParser(hash_buckets=10).parse(path, "fail"))


def test_a_scan_numba_cannot_cache_is_compiled_all_the_same() -> None:
    """Where no cache can be written (here: a function without a source file), the pass still compiles."""
    namespace: dict[str, object] = {}
    exec("def twice(x):\n    return 2 * x\n", namespace)
    assert _compile(namespace["twice"])(21) == 42


def test_parser_hash_is_the_same_in_another_process(tmp_path: Path) -> None:
    """crc32 of the bytes, not Python's hash(): another interpreter with another hash seed gives the same indices."""
    path = tmp_path / "day.tsv"
    path.write_text("".join(_random_lines(200, seed=3)), encoding="utf-8")
    here, _ = _parse_all(CriteoParser(hash_buckets=MAX_HASH_BUCKETS), path)
    code = ("import sys, hashlib, numpy as np; from pathlib import Path;"
            "from jobs.rec.criteo_store import CriteoParser;"
            "chunks = CriteoParser(hash_buckets=int(sys.argv[2])).parse(Path(sys.argv[1]), 'fail');"
            "print(hashlib.sha256(np.concatenate([c.columns['sparse'] for c in chunks]).tobytes()).hexdigest())")
    there = subprocess.run([sys.executable, "-c", code, str(path), str(MAX_HASH_BUCKETS)], capture_output=True,
                           text=True, check=True, cwd=REPO, env={"PYTHONPATH": str(REPO), "PYTHONHASHSEED": "12345"})
    assert there.stdout.strip() == hashlib.sha256(here["sparse"].tobytes()).hexdigest()
    assert here["sparse"].max() <= MAX_HASH_BUCKETS  # the widest table still fits int32
    _assert_same_as_today(here, path, MAX_HASH_BUCKETS)


def test_gzip_file_gives_the_same_columns_as_plain(tmp_path: Path) -> None:
    text = "".join(_random_lines(300, seed=4))
    plain, packed = tmp_path / "day.tsv", tmp_path / "day.tsv.gz"
    plain.write_text(text, encoding="utf-8")
    packed.write_bytes(gzip.compress(text.encode()))
    parser = CriteoParser(hash_buckets=100, block_bytes=5000)
    columns_plain, _ = _parse_all(parser, plain)
    columns_gz, _ = _parse_all(parser, packed)
    for name in columns_plain:
        np.testing.assert_array_equal(columns_plain[name], columns_gz[name])


GOOD = _criteo_line("0", ["1"] * 13, ["ab"] * 26)
BAD_LINES = [
    pytest.param(b"1\t2\t3\n", "expected 40 tab-separated fields .* got 3", id="columns"),
    pytest.param(_criteo_line("1", ["0"] * 13, ["a"] * 27).encode(), "expected 40 tab-separated fields .* got 41",
                 id="41-fields"),
    pytest.param(b"\n", "expected 40 tab-separated fields .* got 1", id="empty-line"),
    pytest.param(_criteo_line("2", ["0"] * 13, [""] * 26).encode(), "label '2' is not 0 or 1", id="label"),
    pytest.param(_criteo_line("", ["0"] * 13, [""] * 26).encode(), "label '' is not 0 or 1", id="no-label"),
    pytest.param(_criteo_line("00", ["0"] * 13, [""] * 26).encode(), "label '00' is not 0 or 1", id="label-00"),
    pytest.param(_criteo_line("1", ["7", "x1", *["0"] * 11], [""] * 26).encode(), "integer feature I2 is 'x1'",
                 id="count"),
    pytest.param(_criteo_line("1", ["0x1f", *["0"] * 12], [""] * 26).encode(), "integer feature I1 is '0x1f'",
                 id="hex-count"),
    pytest.param(_criteo_line("1", ["1.5", *["0"] * 12], [""] * 26).encode(), "integer feature I1 is '1.5'",
                 id="float-count"),
    pytest.param(("1" + "\t0" * 13 + "\t\xff" * 26 + "\n").encode("latin-1"), "not UTF-8 text", id="not-utf8"),
]


@pytest.mark.parametrize(("bad_line", "message"), BAD_LINES)
def test_the_compiled_pass_leaves_every_damaged_line_to_the_line_rules(bad_line: bytes, message: str) -> None:
    """A damaged line anywhere in a block sends the whole block the careful way, which names it."""
    assert CriteoParser(hash_buckets=10)._fast_block(PLAIN * 2 + bad_line + PLAIN) is None


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
@pytest.mark.parametrize(("bad_line", "message"), BAD_LINES)
def test_a_bad_line_fails_naming_file_and_line(tmp_path: Path, bad_line: bytes, message: str, gz: bool) -> None:
    content = (GOOD * 40).encode() + bad_line + (GOOD * 3).encode()
    path = tmp_path / ("day.tsv.gz" if gz else "day.tsv")
    path.write_bytes(gzip.compress(content) if gz else content)
    # the bad line is in a later block, the blocks parsed two at a time: numbering carries over in order
    parser = CriteoParser(hash_buckets=10, block_bytes=1000, threads=2)
    with pytest.raises(BadLineError, match=f"^{path}:41: {message}"):
        list(parser.parse(path, "fail"))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("bad_line", "message"), BAD_LINES)
def test_skip_leaves_out_and_counts_bad_lines(tmp_path: Path, bad_line: bytes, message: str, threads: int) -> None:
    good = [line.encode() for line in _fast_lines(60, seed=5)]  # blocks without a bad line take the compiled pass
    path, survivors = tmp_path / "day.tsv", tmp_path / "good.tsv"
    path.write_bytes(b"".join([*good[:10], bad_line, *good[10:50], bad_line, *good[50:]]))
    survivors.write_bytes(b"".join(good))
    columns, skipped = _parse_all(CriteoParser(hash_buckets=50, block_bytes=2000, threads=threads), path, "skip")
    assert skipped == 2
    _assert_same_as_today(columns, survivors, 50)


def test_empty_file_has_no_rows_and_a_last_line_needs_no_line_end(tmp_path: Path) -> None:
    empty, unended = tmp_path / "empty.tsv", tmp_path / "unended.tsv"
    empty.write_bytes(b"")
    unended.write_text("".join(_random_lines(5, seed=6)).rstrip("\n"), encoding="utf-8")
    parser = CriteoParser(hash_buckets=10)
    assert list(parser.parse(empty, "fail")) == []
    columns, _ = _parse_all(parser, unended)
    assert len(columns["label"]) == 5
    _assert_same_as_today(columns, unended, 10)


def test_truncated_gzip_fails_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "day.tsv.gz"
    path.write_bytes(gzip.compress("".join(_random_lines(2000, seed=7)).encode())[:-5000])
    with pytest.raises(BadLineError, match=f"^{path}:[0-9]+: the file cannot be read"):
        list(CriteoParser(hash_buckets=10, block_bytes=4096).parse(path, "skip"))


def test_threads_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="threads=0 is invalid: allowed >= 1"):
        CriteoParser(hash_buckets=10, threads=0)


@pytest.mark.parametrize("hash_buckets", [0, MAX_HASH_BUCKETS + 1, True, [10] * 25, [10] * 27, [10] * 25 + [0],
                                          [10] * 25 + [MAX_HASH_BUCKETS + 1], [10] * 25 + [2.0]])
def test_hash_buckets_out_of_int32_range_or_not_one_per_column_is_refused(hash_buckets: object) -> None:
    with pytest.raises(ValueError) as caught:
        CriteoParser(hash_buckets=hash_buckets)  # type: ignore[arg-type]
    assert str(caught.value) == f"hash_buckets={hash_buckets!r} is invalid: allowed {HASH_BUCKETS_ALLOWED}"
    with pytest.raises(ValueError, match=re.escape(HASH_BUCKETS_ALLOWED)):
        read_criteo_tsv(Path("never-opened.tsv"), hash_buckets)  # type: ignore[arg-type]


def test_unknown_bad_lines_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bad_lines='warn' is invalid: allowed fail or skip"):
        list(CriteoParser(hash_buckets=10).parse(tmp_path / "x.tsv", "warn"))


def test_a_store_prepared_by_worker_processes_holds_read_criteo_tsv_values(tmp_path: Path) -> None:
    """The parser pickled into spawned workers, through prepare_store: plain, gzip, empty and damaged inputs."""
    lines = [line.encode() for line in _random_lines(300, seed=8)]
    plain, packed, empty = tmp_path / "day_0.tsv", tmp_path / "day_1.tsv.gz", tmp_path / "day_2.tsv"
    plain.write_bytes(b"".join(lines[:100]) + b"1\t2\n" + b"".join(lines[100:200]))
    packed.write_bytes(gzip.compress(b"".join(lines[200:])))
    empty.write_bytes(b"")
    held_out = tmp_path / "eval.tsv.gz"  # the same rows as day_1 in another file: a file is named once
    held_out.write_bytes(packed.read_bytes())
    whole = tmp_path / "all.tsv"
    whole.write_bytes(b"".join(lines))
    parser = CriteoParser(hash_buckets=500, block_bytes=4000)
    plan = PreparePlan(tmp_path / "store", {"train": (plain, packed, empty), "eval": (held_out,)}, parser, "skip")
    manifest = prepare_store(plan, workers=2, log=lambda line: None)
    assert [(shard.rows, shard.bad_lines) for shard in manifest.shards] == [(200, 1), (100, 0), (0, 0), (100, 0)]
    store = SampleStore.open(tmp_path / "store", parser.name, parser.settings())
    rows = store.take("train", np.arange(300))
    _assert_same_as_today(rows, whole, 500)


def test_a_plan_gives_the_parser_the_cores_a_worker_has_and_its_output_stays(tmp_path: Path) -> None:
    """`with_cores` sets the threads of a parser that has them (not its settings, so not the store it makes);
    a parser without them (the toy's) is left as it is."""
    from data_toy_parser import ToyParser

    plan = PreparePlan(tmp_path / "store", {"train": (), "eval": ()}, CriteoParser(1000), "fail")
    wide = plan.with_cores(4)
    assert isinstance(wide.parser, CriteoParser) and wide.parser.threads == 4
    assert wide.prepared_with() == plan.prepared_with() and plan.with_cores(0).parser.threads == 1  # type: ignore[attr-defined]
    toy = PreparePlan(tmp_path / "store", {"train": (), "eval": ()}, ToyParser(), "fail")
    assert toy.with_cores(4) is toy

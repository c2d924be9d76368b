"""The ledger's atomic writes under real faults: a full filesystem, a planted temp name, a link; and its
JSON-lines appends, which never write through a link planted in a file's place."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_faults import fill, small_disk

from gpujobs.base.atomic import append_jsonl, write_text_atomic
from gpujobs.base.errors import GpujobsError
from gpujobs.rank.metrics import MetricsLog
from gpujobs.rundir.files import record_submission
from gpujobs.rundir.records import CheckpointRecord


def test_a_write_on_a_full_disk_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "1m") as disk:
        target = disk / "attempts.jsonl"
        write_text_atomic(target, "old\n")
        filler = fill(disk)
        with pytest.raises(OSError) as err:
            write_text_atomic(target, "new\n" * 100_000)
        assert err.value.errno == 28, err.value
        assert target.read_text() == "old\n"
        assert sorted(p.name for p in disk.iterdir()) == ["attempts.jsonl", "filler"]
        filler.unlink()
        write_text_atomic(target, "new\n")  # space freed: the next write lands
        assert target.read_text() == "new\n"


def test_a_planted_link_is_replaced_never_written_through(tmp_path: Path) -> None:
    """A link at the target (or at the old, guessable temp names) never sends the write elsewhere."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("theirs\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for pid in range(os.getpid() - 2, os.getpid() + 3):
        (run_dir / f".config.yaml.tmp-{pid}").symlink_to(elsewhere)
    target = run_dir / "config.yaml"
    target.symlink_to(elsewhere)
    write_text_atomic(target, "ours\n")
    assert elsewhere.read_text() == "theirs\n"
    assert not target.is_symlink() and target.read_text() == "ours\n"


def test_the_new_file_takes_the_umask_like_any_other(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        write_text_atomic(tmp_path / "status.json", "{}\n")
    finally:
        os.umask(old)
    assert (tmp_path / "status.json").stat().st_mode & 0o777 == 0o640


def test_a_link_planted_in_place_of_a_jsonl_file_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("theirs\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    refused = "cannot be written: it is a symbolic link, not a regular file \\(gpujobs does not follow it\\)$"
    for name, append in [("metrics.jsonl", lambda path: MetricsLog(path).write(CheckpointRecord(1, 0.1))),
                         ("attempts.jsonl", lambda path: append_jsonl(path, {"attempt": 1}, durable=True)),
                         ("slurm_jobs.jsonl", lambda path: record_submission(run_dir, "41", tmp_path / "logs"))]:
        (run_dir / name).symlink_to(elsewhere)
        with pytest.raises(GpujobsError, match=f"^{run_dir / name} {refused}"):
            append(run_dir / name)
        assert elsewhere.read_text() == "theirs\n" and (run_dir / name).is_symlink()


def test_a_hard_linked_jsonl_file_is_refused_and_the_other_name_untouched(tmp_path: Path) -> None:
    """Issue 36: an append opened a file with another name (`cp -al RUN COPY`) and wrote into RUN's ledger
    too; `write_own` already refused such a file."""
    original, copy = tmp_path / "run", tmp_path / "copy"
    original.mkdir()
    copy.mkdir()
    for name, append in [("metrics.jsonl", lambda path: MetricsLog(path).write(CheckpointRecord(1, 0.1))),
                         ("attempts.jsonl", lambda path: append_jsonl(path, {"attempt": 2}, durable=True)),
                         ("slurm_jobs.jsonl", lambda path: record_submission(copy, "42", tmp_path / "logs"))]:
        (original / name).write_text('{"attempt": 1}\n')
        os.link(original / name, copy / name)
        with pytest.raises(GpujobsError, match=f"^{copy / name} cannot be written: it is a hard link \\(2 names"):
            append(copy / name)
        assert (original / name).read_text() == '{"attempt": 1}\n'

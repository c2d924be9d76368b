"""Which rank failed first (gpujobs.attempt.failures): the files the ranks leave, read as rank 0 reads them.

The live case (a script whose rank 1 raises, rank 0 failing of it) is in test_script_job.py.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from gpujobs.attempt import failures
from gpujobs.attempt.failures import RankFailure


@pytest.fixture(autouse=True)
def _one_local_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "4711")


def test_a_peer_that_failed_earlier_is_named_with_its_node(tmp_path: Path) -> None:
    now = time.time()
    failures.leave(tmp_path, RankFailure(2, "node2", "RuntimeError: CUDA error: an illegal memory access", now - 3))
    failures.leave(tmp_path, RankFailure(1, "node1", "RuntimeError: Connection reset by peer", now - 1))
    own = RankFailure(0, "node1", "RuntimeError: Connection reset by peer", now)
    assert failures.attempt_fields(tmp_path, 3, own) == {
        "error": "rank 2: RuntimeError: CUDA error: an illegal memory access", "culprit_rank": 2, "node": "node2"}


def test_rank_0_first_blames_nobody_a_killed_peer_leaves_no_file(tmp_path: Path) -> None:
    own = RankFailure(0, "node1", "RuntimeError: Connection reset by peer", time.time())
    assert failures.attempt_fields(tmp_path, 2, own) == {"error": "rank 0: RuntimeError: Connection reset by peer"}
    assert failures.attempt_fields(tmp_path, 1, own) == {
        "error": "RuntimeError: Connection reset by peer", "culprit_rank": 0, "node": "node1"}  # alone: its own


def test_a_peer_file_that_shows_late_is_still_found(tmp_path: Path) -> None:
    """A shared filesystem may show a peer's file a little after rank 0 fails: rank 0 looks again."""
    now = time.time()
    own = RankFailure(0, "node1", "RuntimeError: Connection reset by peer", now)
    late = threading.Timer(0.3, failures.leave, (tmp_path, RankFailure(1, "node2", "MemoryError: ", now - 0.5)))
    late.start()
    try:
        assert failures.attempt_fields(tmp_path, 2, own) == {
            "error": "rank 1: MemoryError: ", "culprit_rank": 1, "node": "node2"}
    finally:
        late.join()


def test_an_earlier_attempts_file_and_a_torn_one_are_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "1000")
    failures.leave(tmp_path, RankFailure(1, "node2", "ValueError: last time", time.time() - 100))
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "4711")
    failures.failure_path(tmp_path, 2).write_text('{"instance": "local:4711", "rank": 2, "no')
    own = RankFailure(0, "node1", "ValueError: this time", time.time())
    assert failures.first(tmp_path, 3, own, grace_s=0) is own
    assert json.loads(failures.failure_path(tmp_path, 1).read_text())["instance"] == "local:1000"


def test_a_failure_file_that_cannot_be_written_never_hides_the_real_error(tmp_path: Path) -> None:
    (tmp_path / "failures").write_text("a file where the directory goes")
    own = RankFailure(1, "node1", "ValueError: boom", time.time())
    failures.leave(tmp_path, own)  # no exception: the rank goes on to raise its own error
    assert (tmp_path / "failures").read_text() == "a file where the directory goes"
    assert failures.attempt_fields(tmp_path, 2, RankFailure(0, "node1", "ValueError: boom", time.time())) == {
        "error": "rank 0: ValueError: boom"}


def test_a_peer_that_left_nothing_makes_every_other_error_an_echo(tmp_path: Path) -> None:
    """Rank 1 of 3 was killed (no file); rank 2's echo came before rank 0's own: nobody is blamed."""
    now = time.time()
    failures.leave(tmp_path, RankFailure(2, "node2", "RuntimeError: Connection closed by peer", now - 0.2))
    own = RankFailure(0, "node1", "RuntimeError: Connection closed by peer", now)
    assert failures.first(tmp_path, 3, own, grace_s=0.2) is own
    assert failures.attempt_fields(tmp_path, 3, own) == {"error": "rank 0: RuntimeError: Connection closed by peer"}


def test_what_stood_beside_the_ranks_reads_an_outcome_only_where_every_rank_left_one(tmp_path: Path) -> None:
    now = time.time()
    failures.ended(tmp_path, 0, "node1", "done")  # a script's rank 0 was done first
    assert failures.left_outcome(tmp_path, 2, "local:4711") is None  # rank 1 left nothing: srun says more
    failures.leave(tmp_path, RankFailure(1, "node2", "train.py exited with code 3", now))
    assert failures.left_outcome(tmp_path, 2, "local:4711") == (
        "failed", {"error": "rank 1: train.py exited with code 3", "culprit_rank": 1, "node": "node2"})
    failures.ended(tmp_path, 1, "node2", "timeout")  # told to stop instead
    assert failures.left_outcome(tmp_path, 2, "local:4711") == ("timeout", {})
    failures.ended(tmp_path, 1, "node2", "done")  # every rank done: the exit code decides, not the files
    assert failures.left_outcome(tmp_path, 2, "local:4711") is None
    assert failures.left_outcome(tmp_path, 2, "local:1000") is None  # another attempt's files

"""The ledger names the image of each attempt (issue 28): `image` as configured, Podman's image ID where the
launcher resolved it, and `gpujobs status` shows the last one. Lines are composed by the one composer
(`record_attempt`) into a real AttemptLog; the ID comes from real Podman. The live Slurm run in
tests/test_container_slurm.py reads the lines a containerized job wrote itself."""

from __future__ import annotations

import io
import subprocess
from pathlib import Path

import pytest
from conftest import compose_job
from rich.console import Console

from gpujobs.attempt.image import IMAGE_ID_ENV, export_image_id
from gpujobs.attempt.preemption import record_attempt
from gpujobs.launch.manage import PointState
from gpujobs.launch.status_table import image_text, status_table
from gpujobs.rundir.records import read_attempts

TINY = ("+experiment=rec", "+debug=tiny", "cluster=local")


def table_text(points: list[PointState]) -> str:
    """`status`'s table as printed at 100 columns."""
    out = io.StringIO()
    Console(file=out, width=100).print(status_table(points))
    return out.getvalue()


def test_a_podman_attempt_names_the_image_and_its_id(
    tmp_path: Path, podman_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(IMAGE_ID_ENV, raising=False)
    job = compose_job(*TINY, "container=podman", f"container.image={podman_image}")
    inspected = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", podman_image],
                               capture_output=True, text=True, check=True).stdout.strip()
    image_id = export_image_id(job.container)  # what the launcher does before each attempt
    assert image_id == f"sha256:{inspected.removeprefix('sha256:')}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record_attempt(str(run_dir), job, "preempted", start=1.0)  # rank 0, or the launcher: the same fields
    record_attempt(str(run_dir), job, "completed", start=2.0)
    lines = read_attempts(run_dir)
    assert [(a.image, a.image_id) for a in lines] == [(podman_image, image_id)] * 2
    assert image_text(run_dir) == f"{podman_image} (id {inspected.removeprefix('sha256:')[:12]})"
    table = table_text([PointState(None, [], run_dir, None, None, state="completed")])
    assert f"image: {image_text(run_dir)}" in table, table


def test_an_image_podman_does_not_know_is_named_without_an_id(
    tmp_path: Path, podman_image: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(IMAGE_ID_ENV, "sha256:" + "0" * 64)  # an earlier attempt's, which must not stay
    job = compose_job(*TINY, "container=podman", "container.image=gpujobs-no-such-image:0")
    assert export_image_id(job.container) is None
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("gpujobs: the image ID of gpujobs-no-such-image:0 is not recorded: "
                                                 "podman image inspect: "), said
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    line = record_attempt(str(run_dir), job, "failed", start=1.0, error="no image")
    assert line.image == "gpujobs-no-such-image:0" and line.image_id is None, line


def test_runtimes_that_report_no_id_name_the_image_only(
    tmp_path: Path, image_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(IMAGE_ID_ENV, "sha256:" + "1" * 64)  # left in the submitter's environment: not ours
    boxed = compose_job(*TINY, "container=charliecloud", f"container.image={image_dir}")
    assert export_image_id(boxed.container) is None  # nothing to resolve: no ID without reading the image
    plain = compose_job(*TINY)
    monkeypatch.setenv(IMAGE_ID_ENV, "sha256:" + "1" * 64)  # export_image_id removed it
    runs = []
    for num, job in enumerate((boxed, plain)):
        run_dir = tmp_path / f"point{num}"
        run_dir.mkdir()
        record_attempt(str(run_dir), job, "completed", start=1.0)
        runs.append(PointState(num, [f"optim.lr={num}"], run_dir, None, None, state="completed"))
    (line,) = read_attempts(runs[0].run_dir)
    assert line.image == str(image_dir) and line.image_id is None
    assert "image" not in (runs[1].run_dir / "attempts.jsonl").read_text()  # container=none: no image fields
    # a sweep whose points ran in different images (or none) names each point's
    assert table_text(runs).splitlines()[-1].rstrip() == f"image: #0 {image_dir}"


def test_a_sweep_in_one_image_names_it_once(tmp_path: Path, image_dir: Path) -> None:
    job = compose_job(*TINY, "container=charliecloud", f"container.image={image_dir}")
    runs = []
    for num in range(2):
        run_dir = tmp_path / f"point{num}"
        run_dir.mkdir()
        record_attempt(str(run_dir), job, "completed", start=1.0)
        runs.append(PointState(num, [f"optim.lr={num}"], run_dir, None, None, state="completed"))
    assert table_text(runs).splitlines()[-1].rstrip() == f"image: {image_dir}"

"""scripts/test-image.sh: the image it prints runs the project under ch-run and podman, a second call reuses
it untouched, a killed build leaves nothing that counts as done, and a cache directory someone else could
have planted files in is refused before anything is built.

The contract tests use the real cache (the image the container tests use, built once); the refusal and
kill tests point GPUJOBS_TEST_IMAGE_CACHE at directories of their own, so they never touch it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest
from conftest import REPO, missing, run_test_image

SCRIPT = REPO / "scripts" / "test-image.sh"
NOBODY = 65534
#: a finished image in the cache: CACHE/KEY, KEY 16 hex digits
IMAGE_NAME = re.compile(r"^[0-9a-f]{16}$")
#: what the image must run: the checkout's gpujobs (mounted over the installed one) and the caller's torch
PROBE = "import gpujobs, torch; print(gpujobs.__file__); print(torch.__version__)"


@pytest.fixture(autouse=True)
def _root() -> None:
    """The script builds as root only (CI runs as root: there, not being root fails)."""
    if os.geteuid() != 0:
        missing("scripts/test-image.sh runs as root only")


def image_of(proc: subprocess.CompletedProcess[str]) -> str:
    """The last stdout line of a call that succeeded: the image's directory or name."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_image_dir_runs_the_checkout_and_torch_under_ch_run() -> None:
    if shutil.which("ch-run") is None:
        missing("Charliecloud's ch-run (Debian package charliecloud-runtime)")
    image = Path(image_of(run_test_image()))
    assert IMAGE_NAME.match(image.name) and (image / "usr/bin/python3").exists()
    cmd = ["ch-run", "-b", f"{REPO}:{REPO}", f"--cd={REPO}", str(image), "--", "python3", "-c", PROBE]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "USER": "root"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(REPO / "gpujobs" / "__init__.py"), version("torch")]


def test_podman_image_runs_with_the_printed_containers_conf() -> None:
    if shutil.which("podman") is None:
        missing("podman (Debian packages podman and crun)")
    proc = run_test_image("podman")
    name = image_of(proc)
    settings = proc.stdout.strip().splitlines()[:-1]
    assert name.startswith("localhost/gpujobs-test:") and [s.split("=")[0] for s in settings] == ["CONTAINERS_CONF"]
    env = {**os.environ, **{key: value for key, _, value in (s.partition("=") for s in settings)}}
    cmd = ["podman", "run", "--rm", "--pid=host", "--network=host", "-v", f"{REPO}:{REPO}", "-w", str(REPO),
           name, "python3", "-c", PROBE]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(REPO / "gpujobs" / "__init__.py"), version("torch")]


def test_a_second_call_reuses_the_image_untouched() -> None:
    image = Path(image_of(run_test_image()))
    before = image.stat()
    again = run_test_image()
    assert image_of(again) == str(image)
    assert "building" not in again.stderr, again.stderr
    after = image.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not [p.name for p in image.parent.iterdir() if p.name.startswith(".build-")]


def start_build(cache: Path) -> subprocess.Popen[str]:
    """A cold build into `cache`, in its own process group (to kill all of it: mmdebstrap, apt, dpkg)."""
    env = {**os.environ, "GPUJOBS_TEST_IMAGE_CACHE": str(cache), "GPUJOBS_TEST_IMAGE_PYTHON": sys.executable}
    return subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def kill_mid_build(proc: subprocess.Popen[str], cache: Path, old: set[str]) -> str:
    """SIGKILL the build as soon as mmdebstrap is unpacking into a new `.build-*` dir (not in `old`)."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        new = [p for p in cache.glob(".build-*") if p.name not in old and (p / "usr/bin/dpkg").exists()]
        if new:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
            return new[0].name
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    pytest.fail(f"no build started within 90 s (exit {proc.returncode}): {err[-2000:]}")


def test_a_killed_build_counts_as_nothing_and_is_removed_by_the_next(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = kill_mid_build(start_build(cache), cache, set())
    assert not [p.name for p in cache.iterdir() if IMAGE_NAME.match(p.name)]
    second = kill_mid_build(start_build(cache), cache, {first})
    assert sorted(p.name for p in cache.iterdir()) == sorted([".lock", second])
    # nothing of the host (mmdebstrap's /proc, /sys, /dev) stays mounted inside: deleting it is safe
    assert f" {cache}/" not in Path("/proc/self/mounts").read_text()
    shutil.rmtree(cache)  # a partial Debian (~100 MB): not left in /tmp for the rest of the run


@pytest.mark.parametrize("planted", ["other_owner", "world_writable", "symlink"])
def test_a_cache_dir_someone_else_could_fill_is_refused(tmp_path: Path, planted: str) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    if planted == "other_owner":
        os.chown(cache, NOBODY, NOBODY)
    elif planted == "world_writable":
        cache.chmod(0o777)
    else:
        cache.rmdir()
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        cache.symlink_to(tmp_path / "elsewhere")
    proc = run_test_image(env={"GPUJOBS_TEST_IMAGE_CACHE": str(cache)})
    assert proc.returncode == 2 and proc.stdout == ""
    expected = {"other_owner": f"belongs to uid {NOBODY}", "world_writable": "mode is 777",
                "symlink": "symbolic link"}[planted]
    assert proc.stderr.count("\n") == 1 and f"GPUJOBS_TEST_IMAGE_CACHE={cache}" in proc.stderr
    assert expected in proc.stderr, proc.stderr
    # refused before anything was written: not even the lock
    assert list(cache.iterdir()) == []

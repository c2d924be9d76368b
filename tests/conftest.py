"""Shared helpers: compose the real config tree, and run `python -m gpujobs.submit` for real."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest
from hydra import compose, initialize_config_dir
from jobctl import RunningJob

from gpujobs.config.load import JobConfig, load_config

REPO = Path(__file__).resolve().parent.parent
# No test asks a real Kubernetes cluster: a developer's own ~/.kube/config is never read (the preflight tests
# point KUBECONFIG at their loopback stand-in of the API server)
os.environ["KUBECONFIG"] = os.devnull
CONF = REPO / "conf"


def missing(reason: str) -> NoReturn:
    """A part a test needs is not here: skip, except under CI, where every test must really run."""
    if os.environ.get("CI"):
        pytest.fail(f"CI needs it: {reason}")
    pytest.skip(reason)


def compose_job(*overrides: str) -> JobConfig:
    """The validated config `python -m gpujobs.submit <overrides>` would run."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return load_config(cfg)


def assert_golden(text: str, name: str) -> None:
    """`text` equals `tests/golden/<name>`; GPUJOBS_UPDATE_GOLDEN=1 rewrites the file instead."""
    golden = Path(__file__).parent / "golden" / name
    if os.environ.get("GPUJOBS_UPDATE_GOLDEN"):
        if os.environ.get("CI"):
            pytest.fail("GPUJOBS_UPDATE_GOLDEN under CI would compare each golden file with itself")
        golden.write_text(text)
        pytest.skip(f"rewrote tests/golden/{name}: review the diff")
    assert text == golden.read_text()


def submit(
    run_dir: Path, *overrides: str, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a subprocess with its run dir at `run_dir`."""
    cmd = [sys.executable, "-m", "gpujobs.submit", f"hydra.run.dir={run_dir}", *overrides]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(cmd, cwd=run_dir.parent, capture_output=True, text=True, timeout=timeout, env=full_env)


def slurm_job_id(output: str) -> str:
    """The id of the first job that `gpujobs.submit` says it queued."""
    match = re.search(r"submitted Slurm job (\d+)", output)
    assert match, output
    return match.group(1)


def read_result(run_dir: Path) -> dict[str, Any]:
    """The run's result.json."""
    return json.loads((run_dir / "result.json").read_text())


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of the run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


#: 60 slowed steps (~3 s) on 2 ranks: long enough to interrupt mid-run, short enough for CI.
SLOW = (
    "+experiment=rec", "+debug=tiny", "cluster=local", "trainer.max_steps=60", "checkpoint.every_steps=10",
    "telemetry.debug_slow_rank=0", "telemetry.debug_slow_ms=40",
)


#: Local test files that scripts/test.sh runs in the Slurm tests' process: alone, the others take ~18 min
#: and the Slurm tests ~15, and these (~2.5 min of real DDP runs) even the two out.
SLURM_LANE = frozenset({"test_balance_runs.py"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that uses the live Slurm cluster carries the `slurm` marker, whether or not it says so:
    scripts/test.sh runs `-m "slurm or slurm_lane"` (one after another: they share the cluster's two nodes,
    and some need them idle) beside the rest, which fills the time the Slurm tests spend waiting."""
    for item in items:
        if "slurm" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.slurm)
        elif item.path.name in SLURM_LANE:
            item.add_marker(pytest.mark.slurm_lane)


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test() -> Iterator[None]:
    """A background job of a test that failed (or timed out) is killed, its Slurm job cancelled."""
    yield
    for job in RunningJob.started:
        if job.proc.poll() is None:
            job.kill()
    RunningJob.started.clear()


def uninterrupted_digest(tmp_path_factory: pytest.TempPathFactory, name: str, *overrides: str) -> str:
    """The `param_digest` of a run of `overrides` from start to end in a fresh dir: the reference an
    interrupted or relocated run of the same training must end with."""
    run_dir = tmp_path_factory.mktemp(name) / "run"
    proc = submit(run_dir, *overrides)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(read_result(run_dir)["param_digest"])


@pytest.fixture(scope="session")
def straight_digest(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The `param_digest` of an uninterrupted run of SLOW: what every interrupted run must end with."""
    return uninterrupted_digest(tmp_path_factory, "straight", *SLOW)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A fresh run directory path (not created: the CLI creates it)."""
    return tmp_path / "run"


def _slurm_conf() -> str | None:
    """SLURM_CONF, else the default cluster of scripts/local-slurm.sh when this user made it: root's Slurm
    commands must not read a slurm.conf that someone else planted in /tmp."""
    if os.environ.get("SLURM_CONF"):
        return os.environ["SLURM_CONF"] if Path(os.environ["SLURM_CONF"]).is_file() else None
    default = Path("/tmp/gpujobs-slurm")
    try:
        info = default.lstat()
    except OSError:
        return None
    ours = stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700
    conf = default / "etc" / "slurm.conf"
    return str(conf) if ours and conf.is_file() else None


@pytest.fixture(scope="session")
def slurm() -> dict[str, str]:
    """The environment that reaches the live test cluster of scripts/local-slurm.sh.

    Skips when there is none, except under CI, where a missing cluster is a failure.
    """
    conf = _slurm_conf()
    reason = "no live Slurm cluster (run `bash scripts/local-slurm.sh up` as root)"
    if conf is not None:
        env = {**os.environ, "SLURM_CONF": conf}
        try:
            ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20, env=env)
            if ping.returncode == 0 and "UP" in ping.stdout:
                return {"SLURM_CONF": conf}
            reason = f"Slurm controller not answering: {ping.stdout.strip() or ping.stderr.strip()}"
        except (OSError, subprocess.TimeoutExpired) as err:
            reason = f"Slurm commands unavailable: {err}"
    missing(f"the live Slurm cluster: {reason}")


@pytest.fixture(scope="session")
def prometheus_tools() -> dict[str, str]:
    """The paths of Debian's `prometheus` and `promtool` (scripts/test.sh installs them as root).

    Skips when they are missing, except under CI, where a missing one is a failure.
    """
    tools = {name: shutil.which(name) for name in ("prometheus", "promtool")}
    found = {name: path for name, path in tools.items() if path is not None}
    if len(found) == len(tools):
        return found
    missing = " and ".join(name for name in tools if name not in found)
    reason = f"no {missing} on PATH (scripts/test.sh installs Debian's prometheus package as root)"
    if os.environ.get("CI"):
        pytest.fail(f"CI needs a real Prometheus: {reason}")
    pytest.skip(reason)


def sacct_state(job_id: str, env: dict[str, str], timeout: float = 60) -> str:
    """The job's final state as accounting records it (polled: sacct lags the scheduler)."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"],
            capture_output=True, text=True, env={**os.environ, **env}, check=False,
        ).stdout.split()
        state = out[0] if out else ""
        if state and state not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"):
            return state
        time.sleep(0.5)
    return state


def run_test_image(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run scripts/test-image.sh (`args`: none, or "podman") with this interpreter's pip and torch version."""
    script = REPO / "scripts" / "test-image.sh"
    full_env = {**os.environ, "GPUJOBS_TEST_IMAGE_PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=full_env)


def _test_image(*args: str) -> list[str]:
    """The stdout lines of scripts/test-image.sh (which builds the image once and caches it); the last one
    names the image: its directory (ch-run), or with `podman` its name in Podman's storage."""
    proc = run_test_image(*args)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        missing(f"the test container image (scripts/test-image.sh {' '.join(args)} exited {proc.returncode}): "
                f"{proc.stderr.strip()[-2000:]}")
    return lines


@pytest.fixture(scope="session")
def image_dir() -> Path:
    """The test image as a directory (Debian with python3, torch and the project's dependencies), for ch-run.
    GPUJOBS_TEST_IMAGE_DIR, where set, names one already built."""
    if shutil.which("ch-run") is None:
        missing("Charliecloud's ch-run (Debian package charliecloud-runtime)")
    return Path(os.environ.get("GPUJOBS_TEST_IMAGE_DIR") or _test_image()[-1])


@pytest.fixture(scope="session")
def oci_bundle() -> Path:
    """The test image as an OCI bundle (config.json and rootfs/), for Slurm's `srun --container` with crun.
    GPUJOBS_TEST_OCI_BUNDLE, where set, names one already made."""
    if shutil.which("crun") is None:
        missing("crun (Debian package crun), Slurm's OCI runtime on the test cluster")
    return Path(os.environ.get("GPUJOBS_TEST_OCI_BUNDLE") or _test_image("oci")[-1])


@pytest.fixture(scope="session")
def _podman() -> tuple[str, dict[str, str]]:
    """The test image in Podman's storage, and the environment podman needs here (`podman_env`)."""
    if shutil.which("podman") is None:
        missing("podman (Debian packages podman and crun)")
    preset = os.environ.get("GPUJOBS_TEST_PODMAN_IMAGE")
    if preset:
        return preset, {}
    lines = _test_image("podman")
    # the lines before the name: NAME=VALUE settings podman needs (CONTAINERS_CONF)
    env = {name: value for name, _, value in (line.partition("=") for line in lines[:-1])}
    # for every podman a test starts, the launcher's included (its ranks run `podman run`): the session's env
    os.environ.update(env)
    return lines[-1], env


@pytest.fixture(scope="session")
def podman_image(_podman: tuple[str, dict[str, str]]) -> str:
    """The same test image in Podman's storage (its name), for podman with crun. GPUJOBS_TEST_PODMAN_IMAGE,
    where set, names one already imported (then podman_env is empty: set CONTAINERS_CONF yourself)."""
    return _podman[0]


@pytest.fixture(scope="session")
def podman_env(_podman: tuple[str, dict[str, str]]) -> dict[str, str]:
    """What every podman command of a test needs in its environment here, e.g. `submit(..., env=podman_env)`:
    CONTAINERS_CONF, a containers.conf of scripts/test-image.sh whose default_ulimits stay within podman's
    own hard limits (as root podman asks for nofile 1048576, which this VM refuses)."""
    return _podman[1]

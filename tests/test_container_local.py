"""`cluster=local` with `container=podman|charliecloud`: the ranks run in the image through the real runtime
(the test image of scripts/test-image.sh), and every local guarantee holds across the boundary: the same
`param_digest` as outside, USR2 to the launcher gives an agreed checkpoint and an exact resume, a rank stopped
inside is found hung with its stacks kept, and nothing of a killed job (no process, no container) is left.

Podman runs here as root: where the VM lacks CAP_SYS_RESOURCE, its default ulimits need a containers.conf
with lower `default_ulimits` (CONTAINERS_CONF), which the `podman_image` fixture sets for the session.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import SLOW, compose_job, missing, read_result, submit
from jobctl import RunningJob, attempts

from gpujobs.backends.local.container import check_local_container, rank_python
from gpujobs.base.errors import ConfigError
from gpujobs.base.process import alive
from gpujobs.launch import preflight

HANG_TIMEOUT_S = 8
#: What each runtime puts in its ranks' environment: how a test tells a rank inside from one outside.
MARKER = {"podman": (b"container", b"podman"), "charliecloud": (b"CH_RUNNING", None)}


@pytest.fixture(autouse=True)
def _submit_from_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs are submitted from the test's directory, under /tmp, which ch-run binds itself (the test image has
    no directory for a mount of the repository)."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(params=["charliecloud", "podman"])
def boxed(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """The overrides that put a local job's ranks in the test image, through each runtime."""
    if request.param == "podman":
        image = request.getfixturevalue("podman_image")
    else:
        image = str(request.getfixturevalue("image_dir"))
    return (f"container={request.param}", f"container.image={image}")


def contained_ranks(job: RunningJob, runtime: str) -> dict[int, int]:
    """rank -> host pid of the local job's ranks that run inside `runtime`'s container (by their environment:
    the job id submitit gives each rank, and the runtime's own mark)."""
    controller = re.findall(r"submitit job (\d+)", job.output())[-1].encode()
    name, value = MARKER[runtime]
    found: dict[int, int] = {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = dict(item.split(b"=", 1) for item in environ.read_bytes().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if env.get(b"SUBMITIT_LOCAL_JOB_ID") != controller or name not in env or value not in (None, env[name]):
            continue
        pid, rank = int(environ.parent.name), int(env[b"SUBMITIT_LOCAL_GLOBALID"])
        found[rank] = min(found.get(rank, pid), pid)  # the rank itself, not a process it started later
    return found


def job_leftovers(run_dir: Path, pids: dict[int, int]) -> tuple[list[int], str]:
    """The ranks still alive, and podman's containers of `run_dir` (none: '')."""
    ps = ["podman", "ps", "-a", "-q", "--filter", f"label=gpujobs.run_dir={run_dir}"]
    deadline = time.monotonic() + 10  # conmon removes a container (--rm) just after its rank exits
    while True:
        listed = subprocess.run(ps, capture_output=True, text=True).stdout.strip() if shutil.which("podman") else ""
        if not listed or time.monotonic() > deadline:
            return [pid for pid in pids.values() if alive(pid)], listed
        time.sleep(0.5)


def test_a_contained_run_trains_what_the_same_run_outside_does(
    tmp_path: Path, straight_digest: str, boxed: tuple[str, ...]
) -> None:
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *SLOW, *boxed)
    job.wait_for_step(5)
    ranks = contained_ranks(job, boxed[0].split("=")[1])
    assert sorted(ranks) == [0, 1], (ranks, job.output())  # both ranks are in the image, not beside it
    assert job.wait(timeout=60) == 0, job.output()
    assert read_result(run_dir)["param_digest"] == straight_digest
    assert job_leftovers(run_dir, ranks) == ([], "")


def test_usr2_to_the_launcher_reaches_the_ranks_inside_and_the_run_resumes_exactly(
    tmp_path: Path, straight_digest: str, boxed: tuple[str, ...]
) -> None:
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *SLOW, *boxed)
    job.wait_for_step(15)
    os.kill(job.proc.pid, signal.SIGUSR2)  # the launcher passes it to the ranks (podman proxies no signal)
    assert job.wait(timeout=60) == 0, job.output()
    preempted, completed = attempts(run_dir)
    assert preempted["reason"] == "preempted" and preempted["recorded_by"] == "rank 0", preempted
    assert preempted["saved"].endswith(f"step_{preempted['steps_done']:08d}"), preempted
    assert completed["reason"] == "completed" and completed["resumed_from"] == preempted["saved"], completed
    assert completed["start_step"] == preempted["steps_done"]  # zero steps redone, in a fresh container
    assert read_result(run_dir)["param_digest"] == straight_digest
    image = boxed[1].split("=", 1)[1]
    assert preempted["image"] == completed["image"] == image, (preempted, completed)
    # podman reports the image's ID; a ch-run directory has none short of reading the whole image
    ids = [line.get("image_id") for line in (preempted, completed)]
    assert ids == ([ids[0]] * 2 if boxed[0] == "container=podman" else [None, None]), ids
    assert boxed[0] != "container=podman" or str(ids[0]).startswith("sha256:"), ids


def test_a_rank_stopped_in_a_podman_container_is_found_hung_with_its_stacks(
    tmp_path: Path, straight_digest: str, podman_image: str
) -> None:
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *SLOW, "container=podman", f"container.image={podman_image}",
                     f"trainer.hang_timeout_s={HANG_TIMEOUT_S}", "cluster.max_restarts=1")
    job.wait_for_step(21)  # checkpoint 20 is on disk
    ranks = contained_ranks(job, "podman")
    os.kill(ranks[1], signal.SIGSTOP)
    stopped_at = time.time()
    assert job.wait(timeout=90) == 0, job.output()
    hung, completed = attempts(run_dir)
    assert hung["reason"] == "hung" and hung["recorded_by"] == "launcher" and hung["culprit_rank"] == 1, hung
    assert hung["end"] - stopped_at <= HANG_TIMEOUT_S + 30, hung
    for rank in (0, 1):
        text = (Path(hung["evidence"]) / f"rank_{rank}.txt").read_text()
        assert "Trainer.fit" in text or " in fit" in text, text
    assert job_leftovers(run_dir, ranks)[0] == []  # the stopped rank and its peer are gone
    assert completed["reason"] == "completed" and completed["resumed_from"].endswith("step_00000020"), completed
    assert read_result(run_dir)["param_digest"] == straight_digest
    assert job_leftovers(run_dir, ranks)[1] == ""


def test_a_killed_launcher_leaves_no_rank_and_no_container(tmp_path: Path, podman_image: str) -> None:
    """podman's ranks are conmon's children, not the controller's: the launcher kills them (found by their
    environment; each also ends itself once its launcher is gone), and podman removes their containers."""
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *SLOW, "container=podman", f"container.image={podman_image}")
    job.wait_for_step(5)
    ranks = contained_ranks(job, "podman")
    os.kill(job.proc.pid, signal.SIGTERM)
    assert job.wait(timeout=60) == 128 + signal.SIGTERM, job.output()
    assert job_leftovers(run_dir, ranks) == ([], "")


def test_ch_run_finds_the_image_s_python_not_the_launcher_s_venv(tmp_path: Path, image_dir: Path) -> None:
    """The caller's environment reaches ch-run's ranks; a venv first on PATH (here one that ch-run's /tmp
    bind makes reachable inside) must not give the ranks its python3. USER unset: ch-run needs one."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python3").write_text("#!/bin/sh\necho the-venv-s-python\n")
    (venv / "bin" / "python3").chmod(0o755)
    job = compose_job("+experiment=rec", "cluster=local", "container=charliecloud", f"container.image={image_dir}")
    env = {"PATH": f"{venv}/bin:{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    argv = shlex.split(rank_python(job, tmp_path / "run", tmp_path, env))
    probe = "import os, sys; print(sys.executable, os.environ.get('VIRTUAL_ENV'), os.environ['USER'])"
    proc = subprocess.run([*argv, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    executable, virtual_env, user = proc.stdout.split()
    assert executable.startswith("/usr/") and virtual_env == "None" and user, proc.stdout


def test_local_refusals_name_their_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for runtime, option in (("pyxis", "--container-image"), ("oci", "--container")):
        with pytest.raises(ConfigError, match=f"container={runtime} runs on cluster=slurm: it is srun's {option}"):
            preflight(compose_job("+experiment=rec", "cluster=local", f"container={runtime}",
                                  "container.image=/no/such"))
    sif = tmp_path / "rec.sif"
    sif.write_bytes(b"SIF")
    with monkeypatch.context() as patched:
        patched.setenv("PATH", str(tmp_path))  # no apptainer on it, wherever one is installed
        with pytest.raises(ConfigError, match="apptainer is not on PATH") as caught:
            preflight(compose_job("+experiment=rec", "cluster=local", "container=apptainer", f"container.image={sif}"))
        assert caught.value.key == "container.runtime"


def test_a_ch_run_image_without_a_mount_s_directory_is_refused(tmp_path: Path) -> None:
    if shutil.which("ch-run") is None:
        missing("Charliecloud's ch-run (Debian package charliecloud-runtime)")
    image = tmp_path / "img"
    (image / "srv").mkdir(parents=True)
    job = compose_job("+experiment=rec", "cluster=local", "container=charliecloud", f"container.image={image}")
    submit_dir_refused = rf"holding /srv/rec for the submit directory's mount .*mkdir -p {image}/srv/rec"
    with pytest.raises(ConfigError, match=submit_dir_refused):
        check_local_container(job, Path("/srv/rec"))
    (image / "srv" / "rec").mkdir()
    check_local_container(job, Path("/srv/rec"), Path("/srv/rec/outputs/run"))  # the run dir is in that mount
    check_local_container(job, Path("/srv/rec"), Path("/tmp/run"))  # ch-run binds the host's /tmp
    with pytest.raises(ConfigError, match="holding /scratch/run for the run directory's mount") as caught:
        check_local_container(job, Path("/srv/rec"), Path("/scratch/run"))
    assert caught.value.key == "container.image"

    (tmp_path / "data").mkdir()
    run_dir = tmp_path / "run"  # the CLI: one line, exit 2, no run dir
    proc = submit(run_dir, "+experiment=rec", "cluster=local", "container=charliecloud", f"container.image={image}",
                  f"container.mounts=[{tmp_path}/data:/data]")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "container.image=" in lines[0], proc.stderr
    assert "for the mount of" in lines[0] and f"mkdir -p {image}/data" in lines[0], lines
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("image", "said"),
    [("localhost/gpujobs-no-such-image:1", "allowed an image in podman's storage on this machine (`podman image "
                                           "exists` says it is not there: podman pull or podman load it first)"),
     ("Not::A/Reference", "allowed an image reference podman reads (podman image exists: Error: invalid reference "
                          "format)")],
)
def test_a_podman_image_that_is_not_here_is_one_line_at_submit(tmp_path: Path, image: str, said: str) -> None:
    """podman is asked first (`podman image exists`): before, the ranks started and died of `invalid reference
    format` (exit 1) in each container."""
    if shutil.which("podman") is None:
        missing("podman (Debian packages podman and crun)")
    run_dir = tmp_path / "run"
    proc = submit(run_dir, "+experiment=rec", "+debug=tiny", "cluster=local", "container=podman",
                  f"container.image={image}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line == f"gpujobs: config error: container.image={image!r} is invalid: {said}", line
    assert "local job" not in proc.stdout and not run_dir.exists()


def test_the_podman_and_apptainer_words_are_their_documented_options(tmp_path: Path) -> None:
    """Podman's options, checked against `podman run --help` here; apptainer (not installed here) gets the
    words its Slurm step has. GPUs through CDI; `--userns=keep-id` only for a user who is not root."""
    from gpujobs.backends.container_words import same_path_mounts
    from gpujobs.backends.local.container import podman_words

    job = compose_job("+experiment=rec", "cluster=local", "container=podman", "container.image=localhost/rec:1",
                      "container.env=[HF_TOKEN]")
    mounts = same_path_mounts(job, tmp_path / "run", tmp_path)
    words = podman_words(job.container, mounts, str(tmp_path), True, tmp_path / "run", root=False)
    assert words[:2] == ("podman", "run") and words[-1] == "localhost/rec:1"
    assert "--userns=keep-id" in words and words[words.index("--device") + 1] == "nvidia.com/gpu=all"
    assert [words[i + 1] for i, w in enumerate(words) if w == "-v"] == [f"{tmp_path}:{tmp_path}"]
    named = [words[i + 1] for i, w in enumerate(words) if w == "--env"]
    assert {"SUBMITIT_*", "GPUJOBS_*", "HF_TOKEN"} <= set(named)
    root = podman_words(job.container, mounts, str(tmp_path), False, tmp_path / "run", root=True)
    assert "--userns=keep-id" not in root and "--device" not in root
    if shutil.which("podman") is None:
        missing("podman (Debian packages podman and crun)")
    documented = subprocess.run(["podman", "run", "--help"], capture_output=True, text=True, check=True).stdout
    for option in {w.split("=")[0] for w in words if w.startswith("-")}:
        assert re.search(rf"(^|[\s,]){re.escape(option)}[\s=,]", documented, re.M), option

    apptainer = compose_job("+experiment=rec", "cluster=local", "container=apptainer", "container.image=/i/rec.sif")
    argv = shlex.split(rank_python(apptainer, tmp_path / "run", tmp_path))
    assert argv == ["apptainer", "exec", "--bind", f"{tmp_path}:{tmp_path}", "--pwd", str(tmp_path), "/i/rec.sif",
                    "python3"]


#: A time limit just above its least (the signal lead plus 30 s), and more slowed steps than one attempt holds.
TIME_LIMIT = ("cluster.time=00:01:00", "cluster.signal_lead_s=25", "trainer.max_steps=2000")


@pytest.mark.parametrize("runtime", ["none", "podman"])
def test_the_time_limit_gives_an_agreed_checkpoint_that_the_next_attempt_resumes(
    tmp_path: Path, runtime: str, request: pytest.FixtureRequest
) -> None:
    """At `cluster.time` less the lead the ranks stop at an agreed checkpoint, and the attempt's line says so as
    it does without a container: submitit's controller signals its tasks, which in podman are podman's clients,
    so there the launcher asks the stop itself. The next attempt resumes it; then the launcher is stopped."""
    boxed: tuple[str, ...] = ()
    if runtime == "podman":
        boxed = ("container=podman", f"container.image={request.getfixturevalue('podman_image')}")
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *SLOW, *TIME_LIMIT, *boxed)
    deadline = time.monotonic() + 75
    while not re.search(r"\] resumed from ", _attempt_2_rank_0_log(job)):
        assert time.monotonic() < deadline and job.proc.poll() is None, job.output()
        time.sleep(0.5)
    os.kill(job.proc.pid, signal.SIGTERM)
    assert job.wait(timeout=60) == 128 + signal.SIGTERM, job.output()
    stopped, cancelled = attempts(run_dir)
    assert stopped["reason"] == "timeout" and stopped["recorded_by"] == "rank 0", stopped
    assert stopped["why"] == "timeout 1 of at most 5" and stopped["requeue"] is True, stopped
    assert stopped["saved"].endswith(f"step_{stopped['steps_done']:08d}"), stopped
    # asked at the limit less the lead from the launcher's start; the line's start is rank 0's, a few s later
    assert 60 - 25 - 10 <= stopped["end"] - stopped["start"] < 60 - 10, stopped
    assert f"] resumed from {stopped['saved']} (step {stopped['steps_done']}," in _attempt_2_rank_0_log(job)
    assert cancelled["reason"] == "cancelled" and cancelled["recorded_by"] == "launcher", cancelled
    assert job_leftovers(run_dir, {})[1] == ""


def _attempt_2_rank_0_log(job: RunningJob) -> str:
    """What rank 0 of the local job's second attempt has logged so far ('' before it starts)."""
    found = re.search(r"\(attempt 2, submitit job (\d+)\)", job.output())
    log = job.run_dir / "submitit" / f"{found[1]}_0_log.err" if found else None
    return log.read_text() if log is not None and log.exists() else ""

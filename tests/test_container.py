"""`container=`: the ranks' srun step rendered in the image, every bad input refused in one line at submit.

pyxis and Apptainer cannot be installed here: their steps are golden renders whose options are checked
against the ones their documentation lists (pyxis: github.com/NVIDIA/pyxis/wiki/Usage; `apptainer exec
--help`); so are Charliecloud's `ch-run` and Slurm's `srun --container`, which a later part runs for real.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_golden, compose_job, submit

from gpujobs.attempt.slurm_task import RANK_MODULE, parse_args
from gpujobs.backends.slurm.container_step import CONTAINER_PYTHON
from gpujobs.backends.slurm.sbatch import render_sbatch, sbatch_request
from gpujobs.base.errors import ConfigError
from gpujobs.config.load import JobConfig
from gpujobs.launch import preflight

FOLDER = Path("/runs/rec/submitit")
SUBMIT_DIR = Path("/home/ann/rec")
COMMAND = f"/venv/bin/python -u -m gpujobs.rank.srun --folder {FOLDER} /runs/rec"
SLURM = ("+experiment=rec", "cluster=slurm", "resources.nodes=2", "resources.gpus_per_node=4")
#: The options each runtime documents, of those gpujobs renders.
DOCUMENTED = {
    "pyxis": {"--container-image", "--container-mounts", "--container-workdir", "--no-container-mount-home",
              "--container-env"},
    "apptainer": {"--nv", "--bind", "--pwd"},  # apptainer exec [options] IMAGE COMMAND
    "charliecloud": {"--bind", "--cd"},  # ch-run [options] IMAGE -- COMMAND
    "oci": {"--container"},  # srun --container=PATH (Slurm's containers.html)
}
CASES = {
    "pyxis": ("container=pyxis", "container.image='nvcr.io#nvidia/pytorch:24.05-py3'", "data=criteo",
              "data.store=/stores/criteo", "container.mounts=[/scratch/hf:/root/.cache/huggingface:ro]",
              "container.env=[HF_TOKEN,WANDB_API_KEY]"),
    "apptainer": ("container=apptainer", "container.image=/images/rec.sif", "container.mounts=[/data:/data:ro]",
                  "container.env=[HF_HOME]", "container.workdir=/workspace"),
    "charliecloud": ("container=charliecloud", "container.image=/images/rec.sqfs", "container.mounts=[/data:/mnt/d]"),
    "oci": ("container=oci", "container.image=/bundles/rec"),
}


def render(job: JobConfig, folder: Path = FOLDER, command: str = COMMAND) -> str:
    return render_sbatch(sbatch_request(job, folder, command, submit_dir=SUBMIT_DIR))


def step_words(text: str) -> list[str]:
    """The srun line's words after srun's own options (`--unbuffered --output X --error Y`)."""
    words = shlex.split(next(line for line in text.splitlines() if line.startswith("exec ")))
    return words[words.index("srun") + 6:]


@pytest.mark.parametrize("runtime", list(CASES))
def test_each_runtime_renders_its_golden_script(runtime: str) -> None:
    text = render(compose_job(*SLURM, *CASES[runtime]))
    assert_golden(text, f"rec_container_{runtime}.sbatch")
    words = step_words(text)
    # the supervisor outside, with the submitting Python; the ranks inside, with the image's
    assert text.count("exec /venv/bin/python -u -m gpujobs.attempt.supervise -- srun ") == 1
    rank = words.index(RANK_MODULE)
    assert words[rank - 3:rank] == [CONTAINER_PYTHON, "-u", "-m"] and "/venv/bin/python" not in words
    # the supervisor finds the run dir in the srun line as it does without a container
    assert parse_args(words[rank + 1:]).run_dir == Path("/runs/rec")


@pytest.mark.parametrize("runtime", list(CASES))
def test_the_options_are_the_documented_ones_and_mount_the_shared_paths(runtime: str) -> None:
    job = compose_job(*SLURM, *CASES[runtime])
    words = step_words(render(job))
    before = words[:words.index(CONTAINER_PYTHON)]
    options = {word.split("=", 1)[0] for word in before if word.startswith("-") and word != "--"}
    assert options <= DOCUMENTED[runtime], options - DOCUMENTED[runtime]
    if runtime == "pyxis":
        flags = dict(word.split("=", 1) for word in before if "=" in word)
        assert "--no-container-mount-home" in before  # only what is mounted is seen
        assert flags["--container-image"] == "nvcr.io#nvidia/pytorch:24.05-py3"
        mounts = flags["--container-mounts"].split(",")  # pyxis' list: SRC:DST[:FLAGS], comma-separated
        assert mounts == [f"{SUBMIT_DIR}:{SUBMIT_DIR}", "/runs/rec:/runs/rec", "/stores/criteo:/stores/criteo",
                          "/scratch/hf:/root/.cache/huggingface:ro"]
        assert flags["--container-workdir"] == str(SUBMIT_DIR)
        assert flags["--container-env"] == "HF_TOKEN,WANDB_API_KEY"
    elif runtime == "apptainer":
        assert before[:3] == ["apptainer", "exec", "--nv"] and before[-1] == "/images/rec.sif"
        binds = [before[i + 1] for i, word in enumerate(before) if word == "--bind"]
        assert binds == [f"{SUBMIT_DIR}:{SUBMIT_DIR}", "/runs/rec:/runs/rec", "/data:/data:ro"]
        assert before[before.index("--pwd") + 1] == "/workspace"
    elif runtime == "charliecloud":
        assert before[0] == "ch-run" and before[-2:] == ["/images/rec.sqfs", "--"]
        assert [w for w in before if w.startswith("--bind=")] == [
            f"--bind={SUBMIT_DIR}:{SUBMIT_DIR}", "--bind=/runs/rec:/runs/rec", "--bind=/data:/mnt/d"]
    else:
        assert before == ["--container=/bundles/rec"]


def test_apptainer_passes_the_named_variables_over_the_image_s_only_where_set() -> None:
    text = render(compose_job(*SLURM, *CASES["apptainer"]))
    script = f'{text.split("exec ")[0]}\nenv | grep ^APPTAINERENV_ | sort\n'
    for env, want in (({"HF_HOME": "/h o"}, "APPTAINERENV_HF_HOME=/h o\n"), ({}, "")):
        proc = subprocess.run(["bash", "-c", script], env={"PATH": os.environ["PATH"], **env},
                              capture_output=True, text=True, check=True)
        assert proc.stdout == want


def test_without_gpus_pyxis_stands_enroot_s_gpu_hook_down_and_apptainer_drops_nv() -> None:
    cpu = ("+experiment=rec", "cluster=slurm")
    pyxis = render(compose_job(*cpu, "container=pyxis", "container.image=/images/rec.sqsh"))
    assert "export NVIDIA_VISIBLE_DEVICES=void\n" in pyxis
    assert "--container-env=NVIDIA_VISIBLE_DEVICES" in step_words(pyxis)
    assert "--nv" not in step_words(render(compose_job(*cpu, "container=apptainer", "container.image=/a.sif")))
    forced = compose_job(*cpu, "container=apptainer", "container.image=/a.sif", "container.gpus=true")
    assert "--nv" in step_words(render(forced))


def test_hostile_paths_stay_one_word_each() -> None:
    folder = Path("/runs/it's a \"$(reboot)\" `id`;#&|*?~ {x} $HOME !/rec/submitit")
    job = compose_job(*SLURM, "container=apptainer", "container.image='/images/a b;$(id).sif'")
    command = " ".join(shlex.quote(w) for w in ("/venv/bin/python", "-u", "-m", "gpujobs.rank.srun", str(folder)))
    words = step_words(render(job, folder, command))
    assert f"{folder.parent}:{folder.parent}" in words and "/images/a b;$(id).sif" in words
    assert words[-1] == str(folder)


def test_container_none_leaves_the_script_as_it_was() -> None:
    text = render(compose_job(*SLURM))
    assert "container" not in text and step_words(text)[0] == "/venv/bin/python"


def test_an_array_groups_points_by_their_container() -> None:
    from gpujobs.launch.sweep import Point, header_groups

    jobs = [compose_job(*SLURM, "container=apptainer", f"container.image=/images/{n}.sif") for n in "aab"]
    points = [Point(num=i, overrides=[], job=job, run_dir=Path(f"/runs/s/{i}")) for i, job in enumerate(jobs)]
    assert [len(group) for group in header_groups(points, Path("/runs/s/submitit"))] == [2, 1]


@pytest.mark.parametrize(
    ("overrides", "key", "why"),
    [
        (("container=pyxis",), "container.image", "required"),
        (("container=apptainer", "container.image=/a.sif", "container.mounts=[/a:rel]"), "container.mounts[0]",
         "relative"),
        (("container=apptainer", "container.image=/a.sif", "container.mounts=['/a,b:/c']"), "container.mounts[0]",
         "holds ','"),
        (("container=apptainer", "container.image=/a.sif", "container.mounts=['/a:b:/c']"), "container.mounts[0]",
         "holds ':'"),
        (("container=apptainer", "container.image=/a.sif", "container.mounts=['/a:/c:rw']"), "container.mounts[0]",
         "flag is not ro"),
        (("container=apptainer", "container.image=/a.sif", "container.mounts=['/a%j:/c']"), "container.mounts[0]",
         "%"),
        (("container=apptainer", "container.image=/a.sif", "container.env=[1X]"), "container.env", "names"),
        (("container=apptainer", "container.image=/a.sif", "container.env=['A-B']"), "container.env", "names"),
        (("container=apptainer", "container.image='/a\\\\b.sif'"), "container.image", "%"),
        (("container=apptainer", "container.image=/a.sif", "container.workdir=rel"), "container.workdir", "absolute"),
        (("container=oci", "container.image=/b", "container.mounts=[/a:/a]"), "container.mounts", "config.json"),
        (("container=charliecloud", "container.image=/c", "container.mounts=[/a:/a:ro]"), "container.mounts",
         "read-write"),
    ],
)
def test_a_bad_value_is_refused_at_load_naming_its_key(overrides: tuple[str, ...], key: str, why: str) -> None:
    with pytest.raises(ConfigError) as caught:
        compose_job(*SLURM, *overrides)
    assert caught.value.key == key and why in str(caught.value), str(caught.value)


def test_relative_image_files_and_host_paths_are_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    job = compose_job(*SLURM, "container=apptainer", "container.image=rec.sif", "container.mounts=[data:/data]")
    assert job.container.image == str(tmp_path / "rec.sif") and job.container.mounts == [f"{tmp_path}/data:/data"]
    named = compose_job(*SLURM, "container=apptainer", "container.image=docker://debian:12")
    assert named.container.image == "docker://debian:12"  # a name the runtime resolves, not a file


def test_a_container_on_a_cluster_that_runs_none_is_refused() -> None:
    job = compose_job("+experiment=rec", "cluster=debug", "container=charliecloud", "container.image=name")
    with pytest.raises(ConfigError, match=r"container=charliecloud runs on cluster=local\|slurm in this version"):
        preflight(job)


def test_podman_is_refused_on_slurm_naming_the_runtimes_it_runs() -> None:
    job = compose_job(*SLURM, "container=podman", "container.image=debian:12")
    with pytest.raises(ConfigError, match="apptainer, charliecloud, oci, pyxis on cluster=slurm"):
        preflight(job)


def test_preflight_checks_files_and_mounts_but_not_names(tmp_path: Path) -> None:
    image, bundle = tmp_path / "rec.sif", tmp_path / "bundle"
    image.write_bytes(b"SIF")
    bundle.mkdir()
    cases = [
        (("container=apptainer", f"container.image={tmp_path}/missing.sif"), "container.image", "does not"),
        (("container=oci", f"container.image={bundle}"), "container.image", "config.json"),
        (("container=apptainer", f"container.image={image}", f"container.mounts=[{tmp_path}/gone:/d]"),
         "container.mounts[0]", "does not"),
    ]
    for overrides, key, why in cases:
        with pytest.raises(ConfigError) as caught:
            compose_job(*SLURM, *overrides).container.check_here()
        assert caught.value.key == key and why in str(caught.value), str(caught.value)
    (bundle / "config.json").write_text(json.dumps({"mounts": [{"source": "/opt", "destination": "/opt"}]}))
    for fine in (("container=oci", f"container.image={bundle}"), ("container=apptainer", f"container.image={image}"),
                 ("container=apptainer", "container.image=docker://nvcr.io/nvidia/pytorch:24.05-py3"),
                 ("container=pyxis", "container.image='nvcr.io#nvidia/pytorch:24.05-py3'"),
                 ("container=charliecloud", "container.image=rec")):
        compose_job(*SLURM, *fine).container.check_here()


def test_an_oci_bundle_must_mount_the_shared_paths_at_their_own_paths(tmp_path: Path) -> None:
    bundle, submit_dir, store = tmp_path / "bundle", tmp_path / "work", tmp_path / "stores" / "criteo"
    bundle.mkdir()
    job = compose_job(*SLURM, "container=oci", f"container.image={bundle}")
    for mounts, refused in (([(submit_dir, "/work")], submit_dir), ([(submit_dir, submit_dir)], store),
                            ([(submit_dir, submit_dir), (tmp_path / "stores", tmp_path / "stores")], None)):
        spec = {"mounts": [{"type": "bind", "source": str(a), "destination": str(b)} for a, b in mounts]}
        (bundle / "config.json").write_text(json.dumps(spec))
        if refused is None:
            job.container.check_here([submit_dir, store])
            continue
        with pytest.raises(ConfigError, match=f"mounts {refused} at its own path"):
            job.container.check_here([submit_dir, store])
    (bundle / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="reads as one"):
        job.container.check_here([submit_dir])


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (("cluster=slurm", "cluster.dry_run=true", "container=apptainer", "container.image=/no/such/rec.sif"),
         "container.image"),
        (("cluster=slurm", "cluster.dry_run=true", "container=apptainer", "container.image=/no/such/rec.sif",
          "container.mounts=[a:b]"), "container.mounts[0]"),
        (("cluster=local", "container=pyxis", "container.image=/no/such.sqsh"), "container"),
    ],
)
def test_the_cli_refuses_in_one_line_exit_2_and_leaves_no_run_dir(
    tmp_path: Path, overrides: tuple[str, ...], key: str
) -> None:
    run_dir = tmp_path / "run"
    proc = submit(run_dir, "+experiment=rec", *overrides)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f" {key}=" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not run_dir.exists() and "srun" not in proc.stdout


@pytest.mark.parametrize(
    ("where", "overrides", "key"),
    [
        ("run:1", (), "hydra.run.dir"),
        ("run,1", (), "hydra.run.dir"),
        ("run", ("data=criteo", "data.store=/stores/criteo:v1"), "data.store"),
        ("run", ("data=criteo", "data.store='/stores/criteo,v1'"), "data.store"),
    ],
)
def test_a_mounted_path_with_a_colon_or_comma_is_refused_as_mounts_are(
    tmp_path: Path, where: str, overrides: tuple[str, ...], key: str
) -> None:
    """Issue 36: the run dir and the data store are mounted at their own paths (`HOST:HOST`, in a list split
    at ','), but only `container.mounts` was held to that; a run dir `a:b` went on to the runtime's parser."""
    run_dir = tmp_path / where
    proc = subprocess.run([sys.executable, "-m", "gpujobs.submit", f"hydra.run.dir='{run_dir}'", "+experiment=rec",
                           "cluster=local", "container=podman", "container.image=debian:12", *overrides],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"gpujobs: config error: {key}=") and "allowed a path without ':' or ',' with " \
        "container=podman (it is mounted into the container at its own path" in line, line
    assert not run_dir.exists() and proc.stdout == ""


@pytest.mark.slurm
def test_a_dry_run_prints_the_container_step_and_leaves_nothing(tmp_path: Path, slurm: dict[str, str]) -> None:
    image = tmp_path / "rec.sif"
    image.write_bytes(b"SIF")
    run_dir = tmp_path / "run"
    proc = submit(run_dir, "+experiment=rec", "cluster=slurm", "cluster.dry_run=true", "container=apptainer",
                  f"container.image={image}", env=slurm)
    assert proc.returncode == 0, proc.stderr
    words = step_words(proc.stdout)
    assert words[:2] == ["apptainer", "exec"] and str(image) in words
    # the submit dir (conftest.submit runs there) holds the run dir: one mount, at its own path, shows both
    binds = [words[i + 1] for i, word in enumerate(words) if word == "--bind"]
    assert binds == [f"{tmp_path}:{tmp_path}"] and words[words.index("--pwd") + 1] == str(tmp_path)
    assert not run_dir.exists()

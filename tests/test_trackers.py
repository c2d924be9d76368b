"""Experiment trackers that survive requeues: TensorBoard and MLflow, one tracker run per run dir.

Every check reads the trackers back with the libraries' own readers (TensorBoard's EventAccumulator, MLflow's
MlflowClient): after a preemption and requeue on the live cluster and after a crash and restart, each tracker
holds one run whose steps are exactly the trainer's log steps (strictly increasing, no gap, no duplicate).
A 3-point sweep logs to a real `mlflow server` (a tracking-server URI): one parent, a child per point with its
overrides as params, and each point's hparams for TensorBoard's hparams table. GPUs cannot exist here: the
crash test's ranks read two GPUs from the file-driven fake NVML (tests/fake_pynvml), as other tests do.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, SLOW, compose_job, read_metrics, slurm_job_id, submit
from fake_nvml import FakeGpu, fake_nvml_env
from jobctl import RunningJob, attempts

from gpujobs.base.errors import ConfigError
from gpujobs.config.load import MlflowConfig, TensorBoardConfig, load_config
from gpujobs.config.validate import declared
from gpujobs.rundir.files import read_config, write_config
from gpujobs.rundir.records import EvalRecord, MetricsRecord, TrainRecord
from gpujobs.rundir.trackers import read_state

try:
    import mlflow.tracking as mlflow_tracking
    from tensorboard.backend.event_processing import event_accumulator
except ImportError as err:  # under CI a failure, like every missing part (conftest.missing)
    if os.environ.get("CI"):
        raise ImportError(f"CI needs the trackers: pip install -e '.[dev]' ({err})") from err
    pytest.skip(f"pip install -e '.[dev]' (gpujobs[mlflow,tensorboard]): {err}", allow_module_level=True)

BOTH = "logger=[tensorboard,mlflow]"


def store(tmp_path: Path) -> str:
    """A local MLflow store of the test's own (not the checkout's mlflow.db)."""
    return f"logger.mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"


def log_steps(max_steps: int, every: int, *, final: bool) -> list[int]:
    """The steps the trainer logs at: every `every`, and the last (train) or the end (eval: `final`)."""
    steps = [step for step in range(every, max_steps + 1, every) if final or step < max_steps]
    return steps if steps[-1:] == [max_steps] else [*steps, max_steps]


def tensorboard_steps(log_dir: Path, tag: str) -> list[int]:
    """The steps of `tag` that TensorBoard shows (its purges applied), in file order."""
    events = event_accumulator.EventAccumulator(str(log_dir), size_guidance={event_accumulator.SCALARS: 0})
    events.Reload()
    return [event.step for event in events.Scalars(tag)]


def mlflow_run(uri: str, run_dir: Path) -> Any:
    """The one MLflow run of the store (checked) and the run dir's tracker.json names it."""
    client = mlflow_tracking.MlflowClient(tracking_uri=uri)
    runs = [run for experiment in client.search_experiments() for run in client.search_runs([experiment.experiment_id])]
    assert len(runs) == 1, [run.info.run_name for run in runs]  # one tracker run for every attempt
    state = read_state(run_dir)
    assert state.mlflow is not None and state.mlflow.run_id == runs[0].info.run_id
    return runs[0]


def mlflow_steps(uri: str, run_id: str, key: str) -> list[int]:
    """Every step `key` holds a point at, in step order (a duplicate shows as a step twice)."""
    client = mlflow_tracking.MlflowClient(tracking_uri=uri)
    return sorted(metric.step for metric in client.get_metric_history(run_id, key))


def check_each_step_once(run_dir: Path, uri: str, max_steps: int, log_every: int, eval_every: int) -> Any:
    """Both trackers hold exactly the trainer's log steps, once each; returns the MLflow run."""
    train, evals = log_steps(max_steps, log_every, final=True), log_steps(max_steps, eval_every, final=False)
    board = run_dir / "tensorboard"
    assert tensorboard_steps(board, "train/loss") == train
    assert tensorboard_steps(board, "eval/auc") == evals
    assert tensorboard_steps(board, "timing/local_time_s/rank_1") == train  # per-rank timing
    run = mlflow_run(uri, run_dir)
    assert mlflow_steps(uri, run.info.run_id, "train/loss") == train
    assert mlflow_steps(uri, run.info.run_id, "eval/auc") == evals
    assert mlflow_steps(uri, run.info.run_id, "train/imbalance") == train
    assert run.info.status == "FINISHED"
    config = read_config(run_dir)  # the resolved config, as params
    assert run.data.params["optim.lr"] == str(config.optim.lr)
    assert run.data.params["trainer.max_steps"] == str(max_steps)
    return run


# ---------------------------------------------------------------- the config


def test_logger_is_a_group_of_which_hydra_selects_one_or_several() -> None:
    assert compose_job("+experiment=rec").logger.selected == []
    assert compose_job("+experiment=rec", "logger=none").logger.selected == []
    assert compose_job("+experiment=rec", "logger=tensorboard").logger.selected == ["tensorboard"]
    both = compose_job("+experiment=rec", BOTH, "logger.mlflow.experiment=ctr")
    assert both.logger.selected == ["tensorboard", "mlflow"]
    assert both.logger.mlflow is not None and both.logger.mlflow.experiment == "ctr"
    assert load_config(both.to_dict()) == both  # config.yaml reads back as it was


def test_the_default_mlflow_store_is_resolved_at_submit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    job = compose_job("+experiment=rec", "logger=mlflow")
    assert job.logger.mlflow is not None and job.logger.mlflow.tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    job = compose_job("+experiment=rec", BOTH, "logger.tensorboard.log_dir=tb")
    assert job.logger.mlflow is not None and job.logger.mlflow.tracking_uri == "http://127.0.0.1:5000"
    assert job.logger.tensorboard is not None and job.logger.tensorboard.log_dir == str(tmp_path / "tb")
    relative = compose_job("+experiment=rec", "logger=mlflow", "logger.mlflow.tracking_uri=sqlite:///runs.db")
    assert relative.logger.mlflow is not None and relative.logger.mlflow.tracking_uri == f"sqlite:///{tmp_path}/runs.db"


BAD_VALUES = [
    (MlflowConfig, "tracking_uri", "ftp://host/x"),
    (MlflowConfig, "tracking_uri", "mlruns"),  # a bare path: MLflow's retired file store
    (MlflowConfig, "tracking_uri", "sqlite://"),  # in memory: each process its own
    (MlflowConfig, "experiment", "  "),
    (TensorBoardConfig, "log_dir", ""),
    (MlflowConfig, "experiment", "a\nb"),
]


def test_every_declared_bound_of_the_trackers_has_a_bad_value() -> None:
    declared_fields = {(schema, name) for schema in (MlflowConfig, TensorBoardConfig) for name in declared(schema)}
    assert declared_fields and declared_fields <= {(schema, name) for schema, name, _ in BAD_VALUES}


@pytest.mark.parametrize(("schema", "name", "value"), BAD_VALUES)
def test_bad_logger_values_name_their_key(schema: type[Any], name: str, value: str) -> None:
    raw = compose_job("+experiment=rec", BOTH).to_dict()
    tracker = "mlflow" if schema is MlflowConfig else "tensorboard"
    raw["logger"][tracker][name] = value
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    assert info.value.key == f"logger.{tracker}.{name}" and "\n" not in str(info.value)


def test_a_bad_value_or_an_unknown_tracker_is_one_line_and_exit_2(run_dir: Path) -> None:
    proc = submit(run_dir, "+experiment=rec", "cluster=local", "logger=mlflow", "logger.mlflow.tracking_uri=ftp://x")
    assert proc.returncode == 2 and not run_dir.exists()
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("gpujobs: config error: logger.mlflow.tracking_uri='ftp://x' is invalid: allowed an http")
    raw = compose_job("+experiment=rec").to_dict()
    raw["logger"] = {"wandb": {}}  # a conf/logger/wandb.yaml of someone's own
    with pytest.raises(ConfigError, match=r"^logger.wandb=\{\} is invalid: allowed trackers: tensorboard, mlflow"):
        load_config(raw)


def test_a_tracker_that_is_not_installed_is_refused_at_submit(tmp_path: Path) -> None:
    # Uninstalling tensorboard would change the environment every test shares: instead the submitting Python
    # is told, the way Python itself marks a module that cannot be imported, that there is none.
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['tensorboard'] = None\n")
    run_dir = tmp_path / "run"
    path = os.pathsep.join(p for p in (str(blocker), os.environ.get("PYTHONPATH", "")) if p)
    proc = submit(run_dir, "+experiment=rec", "cluster=local", BOTH, store(tmp_path), env={"PYTHONPATH": path})
    assert proc.returncode == 2 and not run_dir.exists(), proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == ("gpujobs: config error: logger='tensorboard' is invalid: allowed a tracker whose package is "
                    "installed: `pip install 'gpujobs[tensorboard]'` (tensorboard not found in this Python)")


@pytest.mark.parametrize("below", ["", "sub/dir"])
def test_a_tensorboard_log_dir_that_cannot_be_a_directory_is_refused_at_submit(tmp_path: Path, below: str) -> None:
    """Rank 0 would fail to make it, log one warning, and train on: a run that ends well with no events."""
    taken = tmp_path / "events"
    taken.write_text("a file, not a directory\n")
    run_dir, log_dir = tmp_path / "run", taken / below if below else taken
    proc = submit(run_dir, "+experiment=rec", "+debug=tiny", "cluster=local", "logger=tensorboard",
                  f"logger.tensorboard.log_dir={log_dir}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    why = "it is not a directory" if not below else f"{taken} is not a directory"
    assert line == (f"gpujobs: config error: logger.tensorboard.log_dir='{log_dir}' is invalid: allowed a directory "
                    f"this user may write, or a path where it may create one ({why})")
    assert not run_dir.exists() and [p.name for p in tmp_path.iterdir()] == ["events"]


def test_a_run_dir_whose_log_dir_is_gone_bad_since_is_still_read(tmp_path: Path) -> None:
    """The log dir is checked where a job is submitted, not wherever its config is read: `status` of a run
    whose log dir has since become a file (or a colleague's, not writable here) still reads it."""
    log_dir = tmp_path / "events"
    job = compose_job("+experiment=rec", "+debug=tiny", "logger=tensorboard", f"logger.tensorboard.log_dir={log_dir}")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_config(run_dir, job)
    log_dir.write_text("a file now\n")
    # what status, cost and resubmit read of a run dir
    assert read_config(run_dir).logger.tensorboard.log_dir == str(log_dir)  # type: ignore[union-attr]


def test_a_sweep_whose_tracking_server_is_down_is_refused_in_seconds(tmp_path: Path) -> None:
    """MLflow's own HTTP retries (7, with backoff) held the submit for about 4 minutes; a user's settings of them
    still hold (here 3 retries, no backoff)."""
    uri = f"http://127.0.0.1:{_free_port()}"  # bound, then let go: nothing listens there
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "gpujobs.submit", "-m", f"hydra.sweep.dir={sweep_dir}", "+experiment=rec",
           "+debug=tiny", "cluster=local", "logger=mlflow", f"logger.mlflow.tracking_uri={uri}", "optim.lr=0.01,0.02"]
    users = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0"}
    for env, retries in (({}, 1), (users, 3)):
        unset = {name: value for name, value in os.environ.items() if not name.startswith("MLFLOW_HTTP_")}
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60, env={**unset, **env})
        assert proc.returncode == 2, proc.stdout + proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"gpujobs: MLflow at {uri} could not take the sweep's runs: "), line
        assert (proc.stdout + proc.stderr).count("Retrying (") == retries, proc.stdout
        assert list(tmp_path.iterdir()) == []  # no sweep dir, no run dir


# ---------------------------------------------------------------- the trackers across attempts


def _train(step: int) -> TrainRecord:
    """A train record as the trainer hands it over (2 ranks)."""
    return TrainRecord(step=step, loss=1 / step, lr=0.001, samples_per_s=1000.0 + step,
                       step_time_s=[0.01, 0.012], data_time_s=[0.001, 0.001], local_time_s=[0.004, 0.006],
                       imbalance=1.2, slowest_rank=1, counts=[32, 32], balance="off")


def _attempt(job: Any, run_dir: Path, steps: range, *, reach_trackers: int, status: str) -> None:
    """One attempt as the trainer runs it: every record to metrics.jsonl, then to the trackers, up to
    `reach_trackers` (what a kill left in their queue never reaches them)."""
    from gpujobs.rank.metrics import MetricsLog
    from gpujobs.rank.observe.trackers import open_trackers

    metrics = MetricsLog(run_dir / "metrics.jsonl")
    with contextlib.closing(metrics):
        trackers = open_trackers(job, run_dir, True)
        for step in steps:
            evals = [EvalRecord(step=step, metrics={"auc": step / 100})] if step % 12 == 0 else []
            records: list[MetricsRecord] = [_train(step), *evals]
            for record in records:
                metrics.write(record)
                if step <= reach_trackers:
                    trackers.log(record)
        trackers.close(status)


def test_attempts_after_crashes_log_each_step_once_with_no_gap(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    job = compose_job("+experiment=rec", BOTH, store(tmp_path))
    # 1: trains 3..27, checkpoint 20; its trackers got up to 24, then the kill cut TensorBoard's last event
    _attempt(job, run_dir, range(3, 28, 3), reach_trackers=24, status="failed")
    (events,) = (run_dir / "tensorboard").glob("events.out.tfevents.*")
    events.write_bytes(events.read_bytes()[:-12])
    # 2: resumes from 20 (trains 21 and 24 again), checkpoint 40; its trackers got up to 36
    _attempt(job, run_dir, range(21, 46, 3), reach_trackers=36, status="failed")
    # 3: resumes from 40, completes
    _attempt(job, run_dir, range(42, 61, 3), reach_trackers=60, status="completed")
    train, evals = list(range(3, 61, 3)), list(range(12, 61, 12))
    assert tensorboard_steps(run_dir / "tensorboard", "train/loss") == train
    assert tensorboard_steps(run_dir / "tensorboard", "eval/auc") == evals
    uri = store(tmp_path).split("=", 1)[1]
    run = mlflow_run(uri, run_dir)
    assert mlflow_steps(uri, run.info.run_id, "train/loss") == train
    assert mlflow_steps(uri, run.info.run_id, "timing/local_time_s/rank_1") == train
    assert mlflow_steps(uri, run.info.run_id, "eval/auc") == evals
    assert run.info.status == "FINISHED" and run.data.metrics["train/loss"] == 1 / 60


# ---------------------------------------------------------------- real runs


def test_a_crash_after_a_checkpoint_and_a_restart_log_each_step_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = fake_nvml_env(tmp_path / "nvml.json", [FakeGpu(util=70), FakeGpu(util=30)])
    # two (fake) GPUs, so the node's sampler runs; the ranks train on the CPU (no CUDA here), as ever
    job = RunningJob(run_dir, *SLOW, "resources.gpus_per_node=2", "cluster.max_restarts=1", BOTH, store(tmp_path),
                     "telemetry.interval_s=0.2", env=env)
    job.wait_for_step(21)  # logged after checkpoint 20 is complete; ~9 slowed steps before checkpoint 30
    # rank 0 itself: its trackers' queue dies with it (records the next attempt must replay), and a TensorBoard
    # event may be cut short
    job.signal_rank(0, signal.SIGKILL)
    assert job.wait() == 0, job.output()
    failed, completed = attempts(run_dir)
    assert failed["reason"] == "failed" and completed["resumed_from"].endswith("step_00000020")
    logged = [line["step"] for line in read_metrics(run_dir) if line.get("kind") == "train"]
    assert logged.count(21) == 2  # the crashed attempt had logged past its checkpoint: step 21 was trained twice
    run = check_each_step_once(run_dir, store(tmp_path).split("=", 1)[1], 60, 3, 6)
    # GPU readings: the node's sampler writes gpu.<node>.jsonl, rank 0's trackers log its newest reading per GPU
    gpu = [key for key in run.data.metrics if key.startswith("gpu/") and key.endswith("/util_pct")]
    assert len(gpu) == 2 and sorted(run.data.metrics[key] for key in gpu) == [30.0, 70.0], run.data.metrics
    assert tensorboard_steps(run_dir / "tensorboard", gpu[0])  # the same series in TensorBoard


@pytest.mark.slurm
def test_a_preempted_and_requeued_slurm_run_is_one_tracker_run(tmp_path: Path, slurm: dict[str, str]) -> None:
    run_dir = tmp_path / "run"
    job = RunningJob(
        run_dir, "+experiment=rec", "+debug=tiny", "trainer.max_steps=60", "checkpoint.every_steps=50",
        "cluster=slurm", "resources.nodes=2", "resources.procs_per_node=1", "cluster.wait=true",
        "telemetry.debug_slow_rank=0", "telemetry.debug_slow_ms=40", BOTH, store(tmp_path), env=slurm,
    )
    job.wait_for_step(21)
    subprocess.run(["scancel", "--signal=USR2", slurm_job_id(job.output())], check=True, env={**os.environ, **slurm})
    assert job.wait(timeout=180) == 0, job.output()
    preempted, completed = attempts(run_dir)
    assert preempted["reason"] == "preempted" and completed["start_step"] == preempted["steps_done"]
    assert preempted["job_id"] == completed["job_id"]  # requeued: the same Slurm job, another attempt
    check_each_step_once(run_dir, store(tmp_path).split("=", 1)[1], 60, 3, 6)


def test_a_sweeps_runs_are_made_without_torch_and_kept_when_its_dir_is_used_again(tmp_path: Path) -> None:
    sweep_dir, uri = tmp_path / "sweep", store(tmp_path)
    script = f"""
import sys
sys.path.insert(0, {str(REPO / "tests")!r})
from pathlib import Path
from conftest import compose_job
from gpujobs.trackers.sweep import SweepPoint, SweepRuns
sweep = Path({str(sweep_dir)!r})
points = [SweepPoint(num, ["+experiment=rec", "logger=mlflow", f"optim.lr={{lr}}"],
                     compose_job("+experiment=rec", "logger=mlflow", {uri!r}, f"optim.lr={{lr}}"), sweep / str(num))
          for num, lr in enumerate((0.1, 0.2))]
for _ in range(2):  # the second time: a sweep dir used again keeps its parent and its points' runs
    SweepRuns.open(sweep, points).end(ok=True)
assert "torch" not in sys.modules, "the sweep's submit side imported torch"
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    client = mlflow_tracking.MlflowClient(tracking_uri=uri.split("=", 1)[1])
    (experiment,) = [e for e in client.search_experiments() if e.name == "rec"]
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [run for run in runs if "mlflow.parentRunId" not in run.data.tags]
    children = {run.data.params["optim.lr"]: run for run in runs if run is not parent}
    assert sorted(children) == ["0.1", "0.2"] and parent.info.status == "FINISHED"
    for num, lr in enumerate(("0.1", "0.2")):
        child = children[lr]
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.info.status == "SCHEDULED" and child.data.params["logger"] == "mlflow"  # until its job starts
        state = read_state(sweep_dir / str(num))
        assert state.mlflow is not None and state.mlflow.run_id == child.info.run_id
    sweep_state = read_state(sweep_dir)
    assert sweep_state.mlflow is not None and sweep_state.mlflow.run_id == parent.info.run_id


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    """A real `mlflow server` on 127.0.0.1 (a free port), with a sqlite store; yields its URI.

    Its flask app alone (`--gunicorn-opts`): the default uvicorn app also loads MLflow's AI gateway, which
    needs the full `mlflow` package (pandas, scikit-learn, ...) where `mlflow-skinny` and flask serve tracking.
    """
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--gunicorn-opts", "--log-level=warning", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
           "--default-artifact-root", str(tmp_path / "artifacts")]
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.read().strip() == b"OK":
                        break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.25)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its gunicorn worker
        server.wait(timeout=30)
        log.close()


def test_a_sweep_is_a_parent_with_a_child_per_point_on_a_tracking_server(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    with mlflow_server(tmp_path) as uri:
        cmd = [sys.executable, "-m", "gpujobs.submit", "-m", f"hydra.sweep.dir={sweep_dir}", "+experiment=rec",
               "+debug=tiny", "cluster=local", "resources.procs_per_node=1", "trainer.max_steps=6",
               "checkpoint.every_steps=6", BOTH,
               f"logger.mlflow.tracking_uri={uri}", "optim.lr=0.01,0.02,0.03"]
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        client = mlflow_tracking.MlflowClient(tracking_uri=uri)
        (experiment,) = [e for e in client.search_experiments() if e.name == "rec"]
        runs = client.search_runs([experiment.experiment_id])
    (parent,) = [run for run in runs if "mlflow.parentRunId" not in run.data.tags]
    children = [run for run in runs if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(runs) == 4 and len(children) == 3 and parent.info.status == "FINISHED"
    assert sorted(child.data.params["optim.lr"] for child in children) == ["0.01", "0.02", "0.03"]
    for child in children:
        assert child.data.params["experiment"] == "rec" and child.info.status == "FINISHED"
        assert child.data.metrics["train/loss"] > 0 and "eval/auc" in child.data.metrics
        point = Path(child.data.tags["gpujobs.run_dir"])
        state = read_state(point)
        assert state.mlflow is not None and state.mlflow.run_id == child.info.run_id
        assert state.mlflow.parent_run_id == parent.info.run_id
    # TensorBoard: each point's run has its hparams (the hparams plugin's session) and its final metrics
    from tensorboard.plugins.hparams import api_pb2, metadata

    table = {}
    for point in sorted(sweep_dir.glob("[0-9]*")):
        events = event_accumulator.EventAccumulator(str(point / "tensorboard"))
        events.Reload()
        session = events.PluginTagToContent(metadata.PLUGIN_NAME)
        start = metadata.parse_session_start_info_plugin_data(session[metadata.SESSION_START_INFO_TAG])
        end = metadata.parse_session_end_info_plugin_data(session[metadata.SESSION_END_INFO_TAG])
        assert end.status == api_pb2.STATUS_SUCCESS  # the point completed
        final = events.Scalars("eval/auc")[-1]
        table[start.hparams["optim.lr"].number_value] = (final.step, final.value)
    assert sorted(table) == [0.01, 0.02, 0.03] and {step for step, _ in table.values()} == {6}
    final_auc = sorted(child.data.metrics["eval/auc"] for child in children)  # float32 in TensorBoard
    assert sorted(value for _, value in table.values()) == pytest.approx(final_auc, rel=1e-6)

"""Bad configs that once got past submit: each is refused there, in one line naming the key the user set.

The global batch against the ranks and `trainer.grad_accum`, a balancing option its mode never reads, weights
whose sum overflows, a replay of a run dir without a plan history or with one of another world size or
micro-batch, `.` or `..` as a directory name, and a schema field missing from the composed config (so an
override of it was an "unknown key"). Values past what their consumer takes (Slurm's 16-bit ranks per node,
Linux's 255-byte names, IP literals, NCCL's buffer bytes) name the key set, not one the rule also reads.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import CONF, compose_job, submit
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from rec_store import store_from_arrays

from gpujobs.base.errors import ConfigError
from gpujobs.config.cluster import KUBERNETES_KEYS
from gpujobs.config.load import JobConfig, load_config, override_keys
from gpujobs.config.schema import KEY_ALIASES, SECTIONS
from gpujobs.config.trackers import TRACKERS
from gpujobs.launch import preflight

TINY = ("+experiment=rec", "+debug=tiny", "cluster=local")  # 2 ranks, data.num_train=4096, batch_size=64
ELASTIC = ("+experiment=rec", "cluster=slurm", "resources.nodes=2", "resources.min_nodes=1")  # 2 to 4 ranks
SLURM = ("+experiment=rec", "cluster=slurm")  # data.num_train=200000, data.batch_size=256, 2 ranks a node
CRITEO = ("+experiment=rec", "data=criteo", "data.train_files=/d/*.gz", "data.eval_files=/d/e.gz", "data.store=/d/s")


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (("data.global_batch_size=100", "trainer.grad_accum=3"),
         "data.global_batch_size=100 is invalid: allowed a multiple of trainer.grad_accum=3 from 6 (a row per rank "
         "per micro-batch, 2 ranks) to 12288 (data.num_train=4096 rows per micro-batch)"),
        (("data.batch_size=5000",),
         "data.batch_size=5000 is invalid: allowed at most 2048 (a micro-batch, 2 ranks x data.batch_size, must fit "
         "in data.num_train=4096 rows)"),
        (("data.global_batch_size=1",),
         "data.global_batch_size=1 is invalid: allowed a multiple of trainer.grad_accum=1 from 2"),
        (("trainer.balance_shares=[3,1]",),
         "trainer.balance_shares=[3.0, 1.0] is invalid: allowed only with trainer.balance=static, which reads it"),
        # each weight fits a float, their sum does not: the plan would divide by inf
        (("trainer.balance=static", "trainer.balance_shares=[1e308,1e308]"),
         "trainer.balance_shares=[1e+308, 1e+308] is invalid: allowed a list of at least 1 numbers, each in "
         "(0, 1000000] (their sum must stay finite)"),
        (("trainer.balance=static", "+trainer.balance_gpu_weights={cpu: 1e308}"),
         "trainer.balance_gpu_weights.cpu=1e+308 is invalid: allowed a weight in (0, 1000000]"),
        # the job would find out as it starts (on Slurm, after its time in the queue)
        (("trainer.balance=replay", "trainer.balance_replay=/nonexistent"),
         "trainer.balance_replay='/nonexistent' is invalid: allowed the run dir of a finished trainer.balance=dynamic "
         "run (it holds no checkpoint with a plan history)"),
        # submitit's pickles and logs would land in the run dir itself, or in its parent
        *((("cluster.folder=" + name,), f"cluster.folder='{name}' is invalid: allowed letters, digits and _.- (no "
           "spaces or shell characters), but not . or ..") for name in ("..", ".")),
        # Slurm's --ntasks-per-node is 16-bit; 100000 ranks per node were blamed on data.batch_size
        (("resources.procs_per_node=100000",),
         "resources.procs_per_node=100000 is invalid: allowed an integer in [1, 65533]"),
        (("resources.gpus_per_node=100000",),
         "resources.gpus_per_node=100000 is invalid: allowed an integer in [0, 65533]"),
        # the data serves 32 nodes of 2 ranks at data.batch_size=64: the nodes the user set are named
        (("resources.nodes=100000",),
         "resources.nodes=100000 is invalid: allowed at most 32, as the rest of the config stands "
         "(data.num_train=4096 needs at least 200000"),
        # 2 GPUs run 2 ranks, not the 4 asked for
        (("resources.gpus_per_node=2", "resources.procs_per_node=4"),
         "resources.gpus_per_node=2 is invalid: allowed 0 for resources.procs_per_node=4 CPU ranks, or at least 4"),
        # 1:30 is 1 min 30 s to Slurm (2 whole minutes), not 1 h 30; the default signal lead was named
        (("cluster.time=1:30",),
         "cluster.time='1:30' is invalid: allowed more than 150 s (cluster.signal_lead_s=120 plus the 30 s"),
        # a mistyped address, not a host name for the resolver to try
        *((("telemetry.prometheus_addr=" + addr,), f"telemetry.prometheus_addr='{addr}' is invalid: allowed an IPv4 "
           "or IPv6 address or a host name, not a dotted all-numeric one") for addr in ("999.1.1.1", "1.2.3.4.5")),
        (("+nccl.extra.NCCL_BUFFSIZE=-1",),
         "nccl.extra.NCCL_BUFFSIZE='-1' is invalid: allowed a positive number of bytes"),
        # an elastic job starts at 2 or 4 ranks: 4 weights fit one of them, found out when Slurm starts it smaller
        (("resources.nodes=2", "resources.min_nodes=1", "trainer.balance=static", "trainer.balance_shares=[1,1,1,1]"),
         "trainer.balance_shares=[1.0, 1.0, 1.0, 1.0] is invalid: allowed none for an elastic job "
         "(resources.min_nodes=1 < nodes=2: it starts at 2 to 4 ranks"),
        (("name=" + "n" * 256,), f"name='{'n' * 256}' is invalid: allowed letters, digits and _.-"),
    ],
)
def test_refused_at_submit_in_one_line_with_nothing_started_or_written(
    run_dir: Path, overrides: tuple[str, ...], line: str
) -> None:
    proc = submit(run_dir, *TINY, *overrides)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [text for text in proc.stderr.splitlines() if text.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"gpujobs: config error: {line}"), proc.stderr
    assert "local job" not in proc.stdout + proc.stderr  # no rank was started
    assert not run_dir.exists() and list(run_dir.parent.iterdir()) == []


@pytest.mark.parametrize(
    "overrides",
    [
        ("data.global_batch_size=6", "trainer.grad_accum=3"),  # the least: a row per rank per micro-batch
        ("data.global_batch_size=12288", "trainer.grad_accum=3"),  # the most: the whole log per micro-batch
        ("data.batch_size=2048",),  # 2 ranks x 2048 = the whole log
    ],
)
def test_the_bounds_themselves_are_accepted(overrides: tuple[str, ...]) -> None:
    job = compose_job(*TINY, *overrides)
    assert job.data.global_batch(job.resources.world_size, job.trainer.grad_accum) <= 4096 * job.trainer.grad_accum


def test_an_elastic_job_needs_a_row_for_every_rank_of_its_largest_allocation() -> None:
    with pytest.raises(ConfigError, match=r"^data\.global_batch_size=3 is invalid: .* from 4 \(.*4 ranks\)"):
        compose_job(*ELASTIC, "resources.procs_per_node=2", "data.global_batch_size=3")
    assert compose_job(*ELASTIC, "resources.procs_per_node=2", "data.global_batch_size=4").data.global_batch_size == 4
    # derived from batch_size at the configured (largest) world size, it serves any allocation
    assert compose_job(*ELASTIC, "resources.procs_per_node=2", "data.batch_size=1").data.batch_size == 1


def test_a_log_smaller_than_the_world_names_num_train() -> None:
    with pytest.raises(ConfigError, match=r"^data\.num_train=1 is invalid: allowed at least 2"):
        compose_job(*TINY, "data.num_train=1")


def test_criteo_checks_what_config_tells_at_load_and_its_stores_rows_at_submit(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^data\.global_batch_size=4 is invalid: .*grad_accum=3 from 6"):
        compose_job(*CRITEO, "data.global_batch_size=4", "trainer.grad_accum=3")
    # loading reads no store: `gpujobs prepare` composes the same config before the store exists
    assert compose_job(*CRITEO, "data.batch_size=100000").data.batch_size == 100000
    local = (*CRITEO, "cluster=local", "resources.gpus_per_node=0", f"data.store={tmp_path / 'store'}",
             "data.hash_buckets=16", "data.train_files=[]", "data.eval_files=[]")  # as the store's arrays
    parser = compose_job(*local).data.parser()
    day = {"label": np.zeros(10, np.uint8), "dense": np.zeros((10, 13), np.float32),
           "sparse": np.ones((10, 26), np.int32)}
    splits = {"train": [day], "eval": [day]}
    store_from_arrays(tmp_path / "store", parser.name, parser.settings(), parser.columns(), splits)
    with pytest.raises(ConfigError, match=r"^data\.batch_size=6 is invalid: allowed at most 5 .*10 training rows"):
        preflight(compose_job(*local, "data.batch_size=6"))  # submit reads the rows from the manifest, no data
    preflight(compose_job(*local, "data.batch_size=5"))


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.balance_shares=[3,1]", "trainer.balance_shares"),
        ("'+trainer.balance_gpu_weights={cpu: 1}'", "trainer.balance_gpu_weights"),
        ("trainer.balance_replay=/some/run", "trainer.balance_replay"),
    ],
)
@pytest.mark.parametrize("mode", ["off", "dynamic", "static", "replay"])
def test_a_balancing_option_is_refused_where_its_mode_does_not_read_it(override: str, key: str, mode: str) -> None:
    reader = "replay" if key.endswith("replay") else "static"
    if mode == reader:  # read: accepted (static with weights by GPU, replay with its run dir)
        job = compose_job("+experiment=rec", f"trainer.balance={mode}", override.strip("'"))
        assert job.trainer.balance == mode
        return
    with pytest.raises(ConfigError) as info:
        compose_job("+experiment=rec", f"trainer.balance={mode}", override.strip("'"))
    assert info.value.key == key
    assert info.value.allowed.startswith(f"only with trainer.balance={reader}")


def test_a_replay_of_a_run_dir_whose_checkpoint_records_no_plan_history_is_refused_at_submit(tmp_path: Path) -> None:
    step = tmp_path / "off" / "checkpoints" / "step_00000010"  # a run trained with trainer.balance=off
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text(json.dumps({"step": 10, "balance": {"mode": "off", "history": []}}))
    run_dir = tmp_path / "replay"
    proc = submit(run_dir, *TINY, "trainer.balance=replay", f"trainer.balance_replay={tmp_path / 'off'}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.endswith("(its newest checkpoint step_00000010 records no plan history (was it trained with "
                         "trainer.balance=dynamic?))"), line
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("counts", "misfit"),
    [
        # a dynamic run at 2 ranks, resumed at 3: the replay at 2 ranks would fail at step 12, mid-run
        ([[64, 64], [43, 43, 42]], "its plan of step 12 splits 128 rows over 3 ranks"),
        ([[32, 32]], "its plan of step 0 splits 64 rows over 2 ranks"),  # another global batch
    ],
)
def test_a_replay_of_a_plan_history_of_another_world_or_batch_is_refused_at_submit(
    tmp_path: Path, counts: list[list[int]], misfit: str
) -> None:
    step = tmp_path / "dynamic" / "checkpoints" / "step_00000020"
    step.mkdir(parents=True)
    history = [{"step": 12 * i, "reason": "update", "shares": [1 / len(c)] * len(c), "counts": c}
               for i, c in enumerate(counts)]
    (step / "COMPLETE").write_text(json.dumps({"step": 20, "balance": {"mode": "dynamic", "history": history}}))
    run_dir = tmp_path / "replay"
    proc = submit(run_dir, *TINY, "trainer.balance=replay", f"trainer.balance_replay={tmp_path / 'dynamic'}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.endswith("allowed the run dir of a finished trainer.balance=dynamic run of 2 ranks and 128 rows per "
                         f"micro-batch throughout ({misfit})"), line
    assert not run_dir.exists()


@pytest.mark.parametrize("name", ["..", "."])
def test_a_name_that_is_no_directory_name_is_refused_before_the_default_run_dir_takes_it(
    tmp_path: Path, name: str
) -> None:
    """The default run dir is outputs/NAME/<time>: `name=..` would put it beside outputs/, not under it."""
    cmd = [sys.executable, "-m", "gpujobs.submit", *TINY, f"name={name}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"gpujobs: config error: name='{name}' is invalid: allowed letters, digits and _.- (no "
                           "spaces or shell characters), but not . or .."), line
    # Hydra made the run dir (and outputs/ on its way) before the config was read: the refusal took both back
    assert list(tmp_path.rglob("*")) == []


def test_sgd_momentum_is_a_key_of_the_composed_config() -> None:
    job = compose_job("+experiment=rec", "optim.name=sgd", "optim.momentum=0.5")
    assert job.optim.momentum == 0.5


def _group_options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "choice",
    [f"{group}={option}" for group in SECTIONS for option in _group_options(group)]
    + ["logger=[tensorboard,mlflow]"],
)
def test_the_composed_config_sets_every_field_of_every_section(choice: str) -> None:
    """A schema field missing from the YAML is an unknown key to Hydra: `optim.momentum=0.5` was refused."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        raw: Any = OmegaConf.to_container(compose(config_name="config", overrides=["+experiment=rec", choice]))
    schemas = [(key, schema, raw[key]) for key, schema in SECTIONS.items()]
    schemas += [(f"logger.{name}", TRACKERS[name], raw["logger"][name]) for name in raw["logger"]]
    for key, schema, values in schemas:
        aliases = KEY_ALIASES.get(key, {})
        expected = {f.name for f in dataclasses.fields(schema)}
        if key == "cluster" and raw["cluster"]["name"] != "kubernetes":
            expected -= KUBERNETES_KEYS  # Hydra refuses them as unknown keys on another cluster
        assert {aliases.get(name, name) for name in values} == expected, key



def test_a_name_too_long_for_a_directory_is_named_before_the_default_run_dir_is_made(tmp_path: Path) -> None:
    name = "n" * 300  # Linux refuses a path level over 255 bytes: Hydra's mkdir of outputs/NAME/ failed
    cmd = [sys.executable, "-m", "gpujobs.submit", *TINY, f"name={name}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"gpujobs: config error: name='{name}' is invalid: allowed letters, digits"), line
    assert list(tmp_path.iterdir()) == []  # not even outputs/


def test_a_name_whose_file_sd_target_would_not_fit_a_file_name_is_refused(run_dir: Path) -> None:
    sd_dir = run_dir.parent / "sd"
    sd_dir.mkdir(mode=0o700)
    common = (*TINY, f"telemetry.prometheus_sd_dir={sd_dir}", "telemetry.prometheus_port=0")
    with pytest.raises(ConfigError, match=r"^name='n{209}' is invalid: allowed at most 208 characters with "
                                          r"telemetry.prometheus_sd_dir set"):
        compose_job(*common, "name=" + "n" * 209)
    # the longest: gpujobs-NAME-<16 hex>-<16 hex>.json, the name taken where a squatter holds the first, is 255
    assert compose_job(*common, "name=" + "n" * 208).name == "n" * 208


def _loaded(*overrides: str) -> JobConfig:
    """What submit loads: the composed config, errors naming the keys these overrides set."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*SLURM, *overrides])
    return load_config(cfg, override_keys(overrides))


@pytest.mark.parametrize(
    ("refused", "key", "accepted"),
    [
        (("resources.procs_per_node=65534", "data.batch_size=1"), "resources.procs_per_node",
         ("resources.procs_per_node=65533", "data.batch_size=1")),  # 65533 rows of data.num_train=200000
        (("resources.nodes=391",), "resources.nodes", ("resources.nodes=390",)),  # 780 ranks x 256 <= 200000 rows
        # no row count bounds Criteo's ranks at submit: torch's C int does (2 ranks a node)
        ((*CRITEO[1:], "resources.nodes=1073741824"), "resources.nodes", (*CRITEO[1:], "resources.nodes=1073741823")),
        (("cluster.time=2",), "cluster.time", ("cluster.time=2:01",)),  # Slurm's 3 whole minutes > 120 s + 30 s
        (("resources.gpus_per_node=2", "resources.procs_per_node=3"), "resources.gpus_per_node",
         ("resources.gpus_per_node=2", "resources.procs_per_node=2")),
        # the experiment's 2 CPU ranks: 1 GPU would run 1; 3 GPUs run 3, one per GPU as documented
        (("resources.gpus_per_node=1",), "resources.gpus_per_node", ("resources.gpus_per_node=3",)),
        (("telemetry.prometheus_addr=10.0.0.256",), "telemetry.prometheus_addr",
         ("telemetry.prometheus_addr=node-1.cluster",)),
        (("telemetry.prometheus_addr=gpu.01",), "telemetry.prometheus_addr", ("telemetry.prometheus_addr=gpu01",)),
        (("+nccl.extra.NCCL_BUFFSIZE=0",), "nccl.extra.NCCL_BUFFSIZE", ("+nccl.extra.NCCL_BUFFSIZE=1",)),
        (("resources.nodes=2", "resources.min_nodes=1", "trainer.balance=static", "trainer.balance_shares=[1,1]"),
         "trainer.balance_shares",
         ("resources.nodes=2", "resources.min_nodes=2", "trainer.balance=static", "trainer.balance_shares=[1,1,1,2]")),
        (("name=" + "n" * 256,), "name", ("name=" + "n" * 255,)),
    ],
)
def test_a_consumer_s_bound_is_exact(refused: tuple[str, ...], key: str, accepted: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as info:
        _loaded(*refused)
    assert info.value.key == key, info.value
    _loaded(*accepted)


def test_a_run_resumes_with_other_prepare_workers_but_not_with_other_hash_buckets() -> None:
    """How many processes prepared the store changes no step: a checkpoint resumes across it; what a step
    reads (the hashing) is the run's."""
    from gpujobs.rundir.marker import Marker, SavedRun
    from gpujobs.rundir.resume import ResumeMismatch, check_same_run

    saved = compose_job(*CRITEO, "data.prepare_workers=2")
    marker = Marker(step=4, world_size=2, run=SavedRun(config=saved.to_dict(), global_batch_size=512))
    check_same_run(marker, compose_job(*CRITEO, "data.prepare_workers=8"), "the run dir")
    check_same_run(marker, compose_job(*CRITEO), "the run dir")
    with pytest.raises(ResumeMismatch, match=r"other values of data.hash_buckets \(100000 -> 10\)"):
        check_same_run(marker, compose_job(*CRITEO, "data.hash_buckets=10"), "the run dir")

"""Config validation: every class of bad input gets one clear ConfigError naming key and value."""

from __future__ import annotations

import pickle
import re
from typing import Any

import pytest
from conftest import CONF, REPO, compose_job
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from gpujobs.base.errors import ConfigError
from gpujobs.config import load as config
from gpujobs.config.load import load_config, parse_time_minutes
from gpujobs.config.nccl import KNOWN_NCCL_VARS, NcclSettings
from gpujobs.launch import resolve_cluster, resolve_cluster_name


def test_rec_experiment_composes_to_two_cpu_ranks() -> None:
    job = compose_job("+experiment=rec", "cluster=local")
    assert job.name == "rec"
    assert job.cluster.name == "local"
    assert job.resources.gpus_per_node == 0
    assert job.resources.world_size == 2
    assert type(job.model).__name__ == "DLRMConfig"
    assert type(job.data).__name__ == "SyntheticClicksConfig"


@pytest.mark.parametrize(
    ("override", "key", "allowed"),
    [
        ("resources.gpus_per_node=-1", "resources.gpus_per_node", "in [0, 65533]"),
        ("resources.nodes=0", "resources.nodes", ">= 1"),
        ("resources.procs_per_node=0", "resources.procs_per_node", "in [1, 65533]"),
        ("resources.mem_gb=-4", "resources.mem_gb", "at least 1 MiB"),
        ("trainer.max_steps=abc", "trainer.max_steps", "int"),
        ("trainer.amp=fp8", "trainer.amp", "auto, bf16, off"),
        ("optim.lr=0", "optim.lr", "> 0"),
        ("optim.name=lion", "optim.name", "adam, adamw, sgd"),
        ("cluster.time=abc", "cluster.time", "HH:MM:SS"),
        ("cluster.time=01:99:00", "cluster.time", "below 60"),
        ("cluster.time=0", "cluster.time", "positive"),
        ("cluster.time=2", "cluster.time", "more than 150 s (cluster.signal_lead_s=120"),  # the lead is the default
        ("cluster.signal_lead_s=3571", "cluster.signal_lead_s", "below 3570 s with time=01:00:00"),
        ("cluster.name=moon", "cluster.name", "local, debug, slurm"),
        ("cluster.partition='gpu;rm -rf /'", "cluster.partition", "no spaces or shell characters"),
        ("name='my job'", "name", "no spaces or shell characters"),
        ("+resources.gpus=2", "resources.gpus", "gpus_per_node"),
        ("+nccl.extra.NCCL_SOCKET_IFNAM=eth0", "nccl.extra.NCCL_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"),
        ("nccl.debug=LOUD", "nccl.debug", "INFO"),
        ("nccl.socket_ifname='eth0 && reboot'", "nccl.socket_ifname", "interface names"),
        ("checkpoint.keep=0", "checkpoint.keep", ">= 1"),
        ("+surprise=1", "surprise", "top-level keys"),
        ("model._target_=nowhere.Thing", "model._target_", "importable"),
        ("model.embedding_dim=0", "model.embedding_dim", "an integer >= 1"),
        # text that reaches sbatch's parser: a newline would end the directive and run the rest
        ("name='rec\n'", "name", "control characters"),
        ("cluster.partition='debug\r'", "cluster.partition", "control characters"),
        ("cluster.account='lab\nrm -rf ~'", "cluster.account", "control characters"),
        ("cluster.constraint='a100 '", "cluster.constraint", "no spaces"),
        # numbers as their consumers read them
        ("resources.mem_gb=inf", "resources.mem_gb", "finite"),
        ("resources.mem_gb=0.0001", "resources.mem_gb", "at least 1 MiB"),  # would render --mem=0M
        ("optim.lr=nan", "optim.lr", "a finite number > 0"),
        ("trainer.pg_timeout_s=1e15", "trainer.pg_timeout_s", "int"),
        ("trainer.pg_timeout_s=1000000000000000", "trainer.pg_timeout_s", "2147483"),
        ("trainer.pg_timeout_s=3000000000", "trainer.pg_timeout_s", "2147483"),  # NCCL's int milliseconds
        ("cluster.signal_lead_s=70000", "cluster.signal_lead_s", "at most 65535"),
        ("telemetry.prometheus_port=65536", "telemetry.prometheus_port", "[0, 65535]"),
        ("telemetry.prometheus_addr='0.0.0.0 '", "telemetry.prometheus_addr", "host name"),
        ("+nccl.extra.NCCL_IB_DISABLE=maybe", "nccl.extra.NCCL_IB_DISABLE", "0 or 1"),
        ("+nccl.extra.NCCL_NVLS_ENABLE=3", "nccl.extra.NCCL_NVLS_ENABLE", "0 or 1 or 2"),
    ],
)
def test_bad_values_name_key_value_and_allowed(override: str, key: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose_job("+experiment=rec", override)
    message = str(info.value)
    # the unknown-NCCL-key case reports the bad key as the user typed it
    assert info.value.key in (key, key.replace("IFNAME", "IFNAM")), message
    assert allowed in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("override", "exported"),
    [
        ("+nccl.extra.NCCL_IB_DISABLE=true", "1"),  # Hydra makes this the bool True: NCCL would read "True" as 0
        ("+nccl.extra.NCCL_IB_DISABLE=false", "0"),
        ("+nccl.extra.NCCL_P2P_DISABLE=yes", "1"),
        ("+nccl.extra.NCCL_SHM_DISABLE=NO", "0"),
        ("+nccl.extra.NCCL_IB_DISABLE=1", "1"),
        ("+nccl.extra.NCCL_CROSS_NIC=true", "1"),
        ("+nccl.extra.NCCL_NVLS_ENABLE=2", "2"),
        ("+nccl.extra.NCCL_BUFFSIZE=8388608", "8388608"),  # not on/off: as given
    ],
)
def test_nccl_on_off_variables_are_exported_as_nccl_reads_them(override: str, exported: str) -> None:
    var = override.split("=")[0].rsplit(".", 1)[1]
    job = compose_job("+experiment=rec", override)
    assert job.nccl.to_env()[var] == exported
    assert load_config(job.to_dict()).nccl.to_env()[var] == exported  # config.yaml keeps what NCCL reads


@pytest.mark.parametrize(
    ("typed", "var"),
    [("debug=INFO", "NCCL_DEBUG"), ("debug_subsys=INIT", "NCCL_DEBUG_SUBSYS"),
     ("socket_ifname=eth0", "NCCL_SOCKET_IFNAME"), ("ib_disable=true", "NCCL_IB_DISABLE"),
     ("ib_hca=mlx5_0", "NCCL_IB_HCA"), ("p2p_disable=false", "NCCL_P2P_DISABLE")],
)
def test_a_variable_set_by_a_typed_field_and_in_extra_is_refused_naming_both(typed: str, var: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose_job("+experiment=rec", f"nccl.{typed}", f"+nccl.extra.{var}=0")
    message = str(info.value)
    assert info.value.key == f"nccl.extra.{var}"
    assert f"nccl.{typed.split('=')[0]}" in message and f"nccl.extra.{var}" in message
    assert "\n" not in message


def test_a_preset_s_typed_field_counts_too() -> None:
    with pytest.raises(ConfigError, match=r"nccl\.extra\.NCCL_SOCKET_IFNAME=.*nccl\.socket_ifname"):
        compose_job("+experiment=rec", "nccl=ethernet", "+nccl.extra.NCCL_SOCKET_IFNAME=eth1")


def test_prometheus_listens_on_loopback_unless_told() -> None:
    assert config.TelemetryConfig().prometheus_addr == "127.0.0.1"
    assert compose_job("+experiment=rec").telemetry.prometheus_addr == "127.0.0.1"  # conf/telemetry/default.yaml


@pytest.mark.parametrize("addr", ["0.0.0.0", "::", "", "::1", "10.1.2.3", "node-1.cluster.local", "localhost", "n1."])
def test_prometheus_addr_takes_addresses_and_host_names(addr: str) -> None:
    assert config.TelemetryConfig(prometheus_addr=addr).prometheus_addr == addr


@pytest.mark.parametrize("addr", ["a b", "host:9400", "http://x", "-bad", "a..b", "lo\n", "[::1]", "x" * 64])
def test_prometheus_addr_refuses_what_is_no_address(addr: str) -> None:
    with pytest.raises(ConfigError) as info:
        config.TelemetryConfig(prometheus_addr=addr)
    assert info.value.key == "prometheus_addr"


def test_load_config_probes_nothing_the_submit_side_picks_the_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no sbatch: auto means local
    job = compose_job("+experiment=rec")
    assert job.cluster.name == "auto"  # as composed: load_config reads, it does not probe
    picked = resolve_cluster(job)
    assert picked.cluster.name == "local" and job.cluster.name == "auto"  # a resolved copy
    assert picked.resources == job.resources and picked.optim == job.optim
    assert resolve_cluster(picked) is picked


def test_unknown_nccl_key_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        NcclSettings(extra={"NCCL_IB_DISABEL": "1"})
    assert "NCCL_IB_DISABLE" in info.value.allowed
    assert all(var in info.value.allowed for var in ("NCCL_SOCKET_IFNAME", "NCCL_DEBUG"))


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("default", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}),
        ("ethernet", {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "^lo,docker0"}),
        ("infiniband", {"NCCL_IB_DISABLE": "0", "NCCL_IB_TIMEOUT": "22"}),
        ("debug", {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}),
    ],
)
def test_nccl_presets_become_environment(preset: str, expected: dict[str, str]) -> None:
    env = compose_job("+experiment=rec", f"nccl={preset}").nccl.to_env()
    assert expected.items() <= env.items()
    assert set(env) - {"TORCH_NCCL_ASYNC_ERROR_HANDLING"} <= KNOWN_NCCL_VARS


def test_nccl_overrides_on_top_of_a_preset() -> None:
    env = compose_job("nccl=ethernet", "nccl.socket_ifname=eno1", "+nccl.extra.NCCL_BUFFSIZE=8388608").nccl.to_env()
    assert env["NCCL_SOCKET_IFNAME"] == "eno1"
    assert env["NCCL_BUFFSIZE"] == "8388608"


@pytest.mark.parametrize(
    ("text", "minutes"),
    [("90", 90), ("01:30:00", 90), ("1-00:00:00", 1440), ("1-2", 1560), ("00:00:30", 1), ("10:30", 11)],
)
def test_slurm_time_strings(text: str, minutes: int) -> None:
    assert parse_time_minutes(text) == minutes


def test_auto_cluster_is_local_without_slurm(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch anywhere
    monkeypatch.delenv("SLURM_CONF", raising=False)
    assert resolve_cluster_name("auto") == "local"
    sbatch = tmp_path / "sbatch"
    sbatch.write_text("#!/bin/sh\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    assert resolve_cluster_name("auto") == "slurm"
    assert resolve_cluster_name("debug") == "debug"


def test_resolved_config_round_trips() -> None:
    job = compose_job("+experiment=rec", "cluster=local", "optim.lr=0.01")
    again = load_config(job.to_dict())
    assert again == job


def test_static_shares_for_another_world_size_are_refused_at_submit() -> None:
    static = ("+experiment=rec", "trainer.balance=static", "resources.procs_per_node=2")
    with pytest.raises(ConfigError, match=r"trainer\.balance_shares=\[1\.0, 1\.0, 1\.0\].*per rank \(2 ranks\)"):
        compose_job(*static, "trainer.balance_shares=[1,1,1]")
    assert compose_job(*static, "trainer.balance_shares=[3,1]").trainer.balance_shares == [3.0, 1.0]
    with pytest.raises(ConfigError, match=r"trainer\.balance_shares=\[1\.0, 1\.0, 1\.0\].*none for an elastic job"):
        compose_job(*static, "trainer.balance_shares=[1,1,1]", "resources.nodes=2", "resources.min_nodes=1")


def test_a_script_argument_may_hold_any_text_but_nul() -> None:
    job = compose_job("+experiment=rec", f"+script.path={REPO / 'tests/scripts/torchrun_style.py'}")
    raw = job.to_dict()
    raw["script"]["args"] = ["--note", "tab\there, a newline\nthere"]
    assert load_config(raw).script.args[1] == "tab\there, a newline\nthere"  # reaches exec, no parser
    raw["script"]["args"] = ["--note", "cut\x00off"]  # exec cannot pass it: refused here, not on each rank
    with pytest.raises(ConfigError, match=r"script\.args.*without NUL"):
        load_config(raw)


@pytest.mark.parametrize(
    "overrides",
    [
        ("+experiment=rec", "cluster=slurm"),
        ("+experiment=rec", "nccl=infiniband", "+nccl.extra.NCCL_ALGO=Ring", "optim.lr=1", "resources.mem_gb=8"),
        ("+experiment=rec", "data=criteo", "data.train_files=[/d/day_0.gz,/d/day_1.gz]", "data.eval_files=/d/e.gz",
         "data.store=/d/store"),
        ("+experiment=rec", f"+script.path={REPO / 'tests/scripts/torchrun_style.py'}", "+script.args=[--opt,sgd]"),
    ],
)
def test_exact_typed_sections_build_the_same_objects_as_the_merge(overrides: tuple[str, ...]) -> None:
    """The direct path (values already of their fields' types) and OmegaConf's merge agree, field by field."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        raw: Any = OmegaConf.to_container(compose(config_name="config", overrides=list(overrides)), resolve=True)
    job = load_config(raw)
    sections = [(key, schema) for key, schema in config.SECTIONS.items()]
    sections += [(key, type(getattr(job, key))) for key in ("model", "data")]
    sections += [("script", config.ScriptConfig)] if job.script is not None else []
    for key, schema in sections:
        fields = config._fields(schema)
        aliases = config.KEY_ALIASES.get(key, {})
        values = {aliases.get(name, name): value for name, value in raw[key].items()}
        assert all(config._exact(fields[name][0], value) is not config._NO_FIT for name, value in values.items()), (
            f"{key} would not take the direct path")
        assert config._section(key, schema, values) == config._merged_section(key, schema, values), key


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("trainer.max_steps", "12", 12),  # OmegaConf converts what the direct path does not take
        ("optim.lr", 1, 1.0),
        ("trainer.grad_clip", None, None),
        ("resources.mem_gb", 2, 2.0),
        ("cluster.wait", "true", True),
    ],
)
def test_values_of_other_types_convert_as_omegaconf_does(key: str, value: object, expected: object) -> None:
    raw = compose_job("+experiment=rec").to_dict()
    section, name = key.split(".")
    raw[section][name] = value
    got = getattr(getattr(load_config(raw), section), name)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(
    ("key", "value"),
    [("trainer.max_steps", True), ("trainer.max_steps", None), ("trainer.amp", 3), ("optim.lr", "fast")],
)
def test_values_the_schema_refuses_still_name_the_key(key: str, value: object) -> None:
    raw = compose_job("+experiment=rec").to_dict()
    section, name = key.split(".")
    raw[section][name] = value
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    assert info.value.key == key


def test_checkpoint_async_is_the_key_users_write_and_read() -> None:
    job = compose_job("+experiment=rec", "checkpoint.async=true")
    assert job.checkpoint.background is True
    assert job.to_dict()["checkpoint"]["async"] is True and "background" not in job.to_dict()["checkpoint"]
    with pytest.raises(ConfigError, match=r"^checkpoint\.async='maybe' is invalid"):
        compose_job("+experiment=rec", "checkpoint.async=maybe")


@pytest.mark.parametrize("override", ["checkpoint.async=3", "checkpoint.resume=2", "cluster.wait=-1"])
def test_an_integer_other_than_0_or_1_is_not_a_bool(override: str) -> None:
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}={value} is invalid: allowed true or false"):
        compose_job("+experiment=rec", override)
    assert compose_job("+experiment=rec", f"{key}=1").to_dict()[key.split(".")[0]][key.split(".")[1]] is True


def test_a_config_error_from_a_worker_process_reaches_its_parent_whole() -> None:
    """Workers (a prepare's) raise it in another process: pickled, it keeps its key, value and allowed text."""
    error = pickle.loads(pickle.dumps(ConfigError("data.hash_buckets", 0, "at least 1")))
    assert (error.key, error.value, error.allowed) == ("data.hash_buckets", 0, "at least 1")
    assert str(error) == "data.hash_buckets=0 is invalid: allowed at least 1"

"""Declared configuration: every bound a schema field declares is enforced, for gpujobs' and the jobs' schemas.

The cases are generated from the declarations themselves (`gpujobs.config.validate.declared`), so a field
added with `metadata=bounds(...)` is tested here without a new line. Each value goes through the real
loader (`load_config` of a composed config) and must be refused in one ConfigError naming its key.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import typing
from typing import Any

import pytest
from conftest import REPO, compose_job

from gpujobs.base.errors import ConfigError
from gpujobs.config.load import load_config
from gpujobs.config.schema import PLUGINS, SECTIONS, JobConfig, ScriptConfig
from gpujobs.config.validate import Bounds, allowed_text, declared
from jobs.rec.config import CriteoConfig, DCNv2Config, DLRMConfig, SyntheticClicksConfig

BASE = ("+experiment=rec", "cluster=slurm")
CRITEO = (*BASE, "data=criteo", "data.train_files=/d/day_*.gz", "data.eval_files=/d/e.gz", "data.store=/d/store")
SCRIPT = (*BASE, f"+script.path={REPO / 'tests/scripts/torchrun_style.py'}")
#: (key prefix, schema, the composition that has it); "" is the top level (JobConfig's own fields).
SCHEMAS: list[tuple[str, type[Any], tuple[str, ...]]] = [
    ("", JobConfig, BASE),
    *((key, schema, BASE) for key, schema in SECTIONS.items()),
    ("model", DLRMConfig, BASE),
    ("model", DCNv2Config, (*BASE, "model=dcnv2")),
    ("data", SyntheticClicksConfig, BASE),
    ("data", CriteoConfig, CRITEO),
    ("script", ScriptConfig, SCRIPT),
]
#: A value each `valid=` test refuses (a new field declared with `valid=` needs one here).
INVALID_SAMPLES: dict[str, object] = {
    "prometheus_addr": "not a host name", "store": "  ", "train_files": [" "], "eval_files": 3,
    "hash_buckets": [1000] * 25, "sharding_types": ["row_wise", "diagonal"], "compute_kernels": [], "plan": " ",
}


@functools.cache
def _raw(overrides: tuple[str, ...]) -> dict[str, Any]:
    return compose_job(*overrides).to_dict()


def _outside(name: str, b: Bounds, kind: Any, item: Any) -> list[object]:
    """Values just outside each of `b`'s bounds (the nearest float or integer past it)."""
    number = item if kind is list else kind
    values: list[object] = []
    for bound, inclusive, lower in ((b.ge, True, True), (b.gt, False, True), (b.le, True, False), (b.lt, False, False)):
        if bound is None:
            continue
        if not inclusive:  # the bound itself is outside
            past: object = bound if number is int else float(bound)
        elif number is int:
            past = bound - 1 if lower else bound + 1
        else:
            past = math.nextafter(float(bound), -math.inf if lower else math.inf)
        values.append([past] if kind is list else past)
    if b.min_len:
        values.append([])
    if b.one_of:
        values.append("not-" + b.one_of[0])
    if b.pattern is not None:
        values.append("has space")
    if b.valid is not None:
        values.append(INVALID_SAMPLES[name])
    return values


def _kinds(schema: type[Any]) -> dict[str, tuple[Any, Any]]:
    """Each field's (kind, item type), with Optional unwrapped."""
    out = {}
    for name, hint in typing.get_type_hints(schema).items():
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if typing.get_origin(hint) is typing.Union and len(args) == 1:
            hint = args[0]
        out[name] = (typing.get_origin(hint) or hint, (typing.get_args(hint) or (None,))[-1])
    return out


def _cases() -> list[Any]:
    cases = []
    for prefix, schema, base in SCHEMAS:
        kinds = _kinds(schema)
        for name, b in declared(schema).items():
            for value in _outside(name, b, *kinds[name]):
                key = f"{prefix}.{name}" if prefix else name
                cases.append(pytest.param(base, prefix, name, value, id=f"{key}={value!r}"))
    return cases


def _load_with(base: tuple[str, ...], prefix: str, name: str, value: object) -> JobConfig:
    raw = copy.deepcopy(_raw(base))
    (raw[prefix] if prefix else raw)[name] = value
    return load_config(raw)


@pytest.mark.parametrize(("base", "prefix", "name", "value"), _cases())
def test_every_declared_bound_is_enforced(base: tuple[str, ...], prefix: str, name: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        _load_with(base, prefix, name, value)
    assert info.value.key == (f"{prefix}.{name}" if prefix else name), str(info.value)
    assert "\n" not in str(info.value)


def test_the_generated_cases_cover_every_schema_and_the_consumer_bounds() -> None:
    ids = {case.id for case in _cases()}
    for prefix, schema, _ in SCHEMAS:
        if schema is not ScriptConfig:  # its one declaration (args: any text) has no outside
            assert any(i.startswith(f"{prefix}." if prefix else "name=") for i in ids), schema
    # the bounds that come from consumers (Slurm's --signal, --mem in MiB, NCCL's heartbeat, ports)
    for expected in ("cluster.signal_lead_s=65536", "resources.mem_gb=0.0009765624999999999",
                     "trainer.pg_timeout_s=2147484", "telemetry.prometheus_port=65536"):
        assert expected in ids


def _fields_of(kind: Any) -> list[Any]:
    cases = []
    for prefix, schema, base in SCHEMAS:
        for field in dataclasses.fields(schema):
            field_kind, _ = _kinds(schema)[field.name]
            b = declared(schema).get(field.name)
            text = kind is str and isinstance(field_kind, type) and issubclass(field_kind, str)  # a choice too
            if (field_kind is kind or text) and not (b is not None and b.any_text) and field.name != "_target_":
                key = f"{prefix}.{field.name}" if prefix else field.name
                cases.append(pytest.param(base, prefix, field.name, id=key))
    return cases


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize(("base", "prefix", "name"), _fields_of(float))
def test_no_float_field_takes_a_non_finite_value(base: tuple[str, ...], prefix: str, name: str, value: float) -> None:
    with pytest.raises(ConfigError) as info:
        _load_with(base, prefix, name, value)
    assert info.value.key == f"{prefix}.{name}"
    assert "finite" in info.value.allowed


@pytest.mark.parametrize("text", ["a\nb", "rec\n", "a\rb", "a\x00b", "a\tb", "a\x1bb", "a\u2028b"])
@pytest.mark.parametrize(("base", "prefix", "name"), _fields_of(str))
def test_no_text_field_takes_a_control_character(base: tuple[str, ...], prefix: str, name: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        _load_with(base, prefix, name, text)
    assert info.value.key == (f"{prefix}.{name}" if prefix else name)
    assert "control characters" in info.value.allowed


def test_script_args_are_any_text() -> None:
    job = _load_with(SCRIPT, "script", "args", ["--sep=\t", "line\nbreak"])
    assert job.script is not None and job.script.args == ["--sep=\t", "line\nbreak"]


@pytest.mark.parametrize(
    ("b", "kind", "item", "optional", "text"),
    [  # the phrasing the errors had before they were declared
        (Bounds(ge=0), int, None, False, "an integer >= 0"),
        (Bounds(ge=1), int, None, True, "an integer >= 1, or null"),
        (Bounds(gt=0), float, None, True, "a number > 0, or null"),
        (Bounds(ge=0, le=1), float, None, False, "a number in [0, 1]"),
        (Bounds(gt=0.0, lt=1.0), float, None, False, "a number strictly between 0.0 and 1.0"),
        (Bounds(ge=2, min_len=1), list, int, False, "a list of at least 1 integers, each >= 2"),
        (Bounds(one_of=("adam", "adamw", "sgd")), str, None, False, "one of adam, adamw, sgd"),
        (Bounds(ge=0, le=65535, note="0: a free port"), int, None, True,
         "an integer in [0, 65535] (0: a free port), or null"),
    ],
)
def test_allowed_text_reads_as_before(b: Bounds, kind: Any, item: Any, optional: bool, text: str) -> None:
    assert allowed_text(b, kind, item, optional) == text


def test_plugins_are_validated_by_the_same_validator() -> None:
    assert set(PLUGINS) == {"model", "data"}
    for schema in (DLRMConfig, DCNv2Config, SyntheticClicksConfig, CriteoConfig):
        assert declared(schema), schema
    with pytest.raises(ConfigError, match=r"^embedding_dim=True is invalid"):
        DLRMConfig(embedding_dim=True)  # bool is an int subclass; a typo, not 1
    assert DLRMConfig(embedding_lr_scale=2).embedding_lr_scale == 2.0
    assert type(DLRMConfig(embedding_lr_scale=2).embedding_lr_scale) is float

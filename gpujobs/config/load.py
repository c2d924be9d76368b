"""Loading a composed config into typed objects, once, at the edge (torch-free).

The schemas, each field with its docstring and bounds, live in `gpujobs.config.schema` (and `gpujobs.config.nccl`,
and the jobs' own modules for `model` and `data`); their one validator is `gpujobs.config.validate`. This
module turns a composed `DictConfig` into a `JobConfig`, turning every complaint into one ConfigError
naming the key. It probes nothing: `cluster.name=auto` stays auto here, and the submit side picks the
cluster (`gpujobs.launch.resolve_cluster`). The names below are re-exported for the rest of the code.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import typing
from collections.abc import Collection
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
)

from gpujobs.base.errors import ConfigError, closest_key
from gpujobs.config.modes import Amp, Balance, NcclDebug, NcclPreset, Optimizer, Schedule, Tracker
from gpujobs.config.schema import (
    CLUSTERS,
    KEY_ALIASES,
    MAX_WAIT_S,
    PLUGINS,
    SECTIONS,
    SLURM_LIMIT_CHECK_S,
    SLURM_MAX_SIGNAL_LEAD_S,
    CheckpointConfig,
    ClusterConfig,
    JobConfig,
    OptimConfig,
    ResourcesConfig,
    ScriptConfig,
    TelemetryConfig,
    TrainerConfig,
    parse_time_minutes,
)
from gpujobs.config.trackers import TRACKERS, LoggerConfig, MlflowConfig, TensorBoardConfig
from gpujobs.config.validate import choice, is_choice

__all__ = [
    "CLUSTERS",
    "KEY_ALIASES",
    "MAX_WAIT_S",
    "SLURM_LIMIT_CHECK_S",
    "SLURM_MAX_SIGNAL_LEAD_S",
    "Amp",
    "Balance",
    "CheckpointConfig",
    "ClusterConfig",
    "JobConfig",
    "LoggerConfig",
    "MlflowConfig",
    "NcclDebug",
    "NcclPreset",
    "OptimConfig",
    "Optimizer",
    "ResourcesConfig",
    "Schedule",
    "ScriptConfig",
    "TelemetryConfig",
    "TensorBoardConfig",
    "Tracker",
    "TrainerConfig",
    "load_config",
    "override_keys",
    "parse_time_minutes",
]


_schemas: dict[type[Any], DictConfig] = {}
_field_types: dict[type[Any], dict[str, tuple[Any, bool]]] = {}
_NO_FIT: Any = object()  # what `_exact` returns for a value it cannot take as it is
#: Rank counts a user may raise past what the rest of the config (the data) serves.
_RANK_COUNTS = ("resources.nodes", "resources.procs_per_node", "resources.gpus_per_node")


def _fields(schema: type[Any]) -> dict[str, tuple[Any, bool]]:
    """Each init field of `schema`: its type hint, and whether it is required (no default)."""
    if schema not in _field_types:
        hints = typing.get_type_hints(schema)
        _field_types[schema] = {
            f.name: (hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(schema)
            if f.init
        }
    return _field_types[schema]


def _exact(hint: Any, value: Any) -> Any:
    """`value` as OmegaConf's merge would give it for a field typed `hint`, where that takes no conversion
    (an int for a float is widened, as OmegaConf does; a choice's text is left to its check, which makes it
    the member); `_NO_FIT` for anything else: a string, bool or None where a number is due, `???`, an
    unresolved `${...}`, a nested dataclass."""
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        args = typing.get_args(hint)
        if value is None:
            return None if type(None) in args else _NO_FIT
        inner = [arg for arg in args if arg is not type(None)]
        return _exact(inner[0], value) if len(inner) == 1 else _NO_FIT
    kind = type(value)
    if hint is Any:  # a field that takes more than one shape (a list or one string) takes it as it is
        return _NO_FIT if kind is str and (value == "???" or "${" in value) else value
    if hint in (int, bool):
        return value if kind is hint else _NO_FIT
    if hint is float:
        return float(value) if kind in (int, float) else _NO_FIT
    if hint is str or is_choice(hint):
        return value if kind is str and value != "???" and "${" not in value else _NO_FIT
    if origin is list and kind is list:
        (item,) = typing.get_args(hint)
        items = [_exact(item, v) for v in value]
        return _NO_FIT if any(v is _NO_FIT for v in items) else items
    if origin is dict and kind is dict and typing.get_args(hint)[0] is str:
        entries = {k: _exact(typing.get_args(hint)[1], v) for k, v in value.items()}
        fits = all(type(k) is str for k in entries) and all(v is not _NO_FIT for v in entries.values())
        return entries if fits else _NO_FIT
    return _NO_FIT


def _section(key: str, schema: type[Any], values: Any) -> Any:
    """`values` as a `schema` object, turning every OmegaConf complaint into one ConfigError.

    Values that already have their fields' exact types (what a composed config nearly always holds)
    build the dataclass directly: the same object as OmegaConf's merge, at a hundredth of the cost,
    which matters when a sweep validates hundreds of points. Anything else, including every value
    that is wrong, takes the merge, and with it OmegaConf's conversions and errors.
    """
    fields = _fields(schema)
    given = {} if values is None else values
    if isinstance(given, dict) and all(name in given for name, (_, required) in fields.items() if required):
        kwargs = {name: _exact(fields[name][0], value) if name in fields else _NO_FIT for name, value in given.items()}
        if all(value is not _NO_FIT for value in kwargs.values()):
            try:
                return schema(**kwargs)
            except ConfigError as err:
                raise err.under(key) from None
    return _merged_section(key, schema, values)


def _merged_section(key: str, schema: type[Any], values: Any) -> Any:
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(key, values, f"a mapping of {', '.join(f.name for f in dataclasses.fields(schema))}")
    for name, (hint, _) in _fields(schema).items():
        value = values.get(name)
        # OmegaConf takes any integer for a bool (3 -> true): a typo, or a count put in the wrong key
        if hint in (bool, typing.Optional[bool]) and type(value) is int and value not in (0, 1):
            raise ConfigError(f"{key}.{name}", value, "true or false (or 1/0)")
        misfit = _shape_misfit(hint, value, f"{key}.{name}") if name in values else None
        if misfit is not None:  # OmegaConf's error on it names no key ("0", or "") and no type ("?")
            said = misfit.replace(f"{key}.{name} is", "it is", 1)
            raise ConfigError(f"{key}.{name}", value, f"{_shape_text(hint)} ({said})")
        choices = _choices(hint)
        if choices is not None and value is not None:  # OmegaConf knows a member by its name, not its value
            values = {**values, name: choice(f"{key}.{name}", choices, value, hint is not choices)}
    try:
        if schema not in _schemas:  # merge copies it; building it from the dataclass is half the cost
            _schemas[schema] = OmegaConf.structured(schema)
        merged = OmegaConf.merge(_schemas[schema], values)
        return OmegaConf.to_object(merged)
    except MissingMandatoryValue as err:
        raise ConfigError(f"{key}.{err.full_key}", "???", "a value: this key is required, set it") from None
    except ConfigKeyError as err:
        bad = str(err.full_key).split(".")[0].split("[")[0]
        fields = [f.name for f in dataclasses.fields(schema)]
        raise ConfigError(f"{key}.{bad}", values.get(bad), f"keys of {key}: {', '.join(fields)}",
                          _meant(key, closest_key(bad, fields))) from None
    except OmegaConfBaseException as err:
        full_key = str(err.full_key)
        field_name = full_key.split(".")[0].split("[")[0]
        ftype = next((f.type for f in dataclasses.fields(schema) if f.name == field_name), "?")
        value = _lookup(values, full_key)
        raise ConfigError(f"{key}.{full_key}", value, f"a value of type {ftype}") from None
    except ConfigError as err:
        raise err.under(key) from None


def _shape_misfit(hint: Any, value: Any, where: str) -> Optional[str]:
    """Where `value` (at `where`) is a list or mapping that a field typed `hint` cannot hold, or a scalar where
    it needs one of them: what stands where (None if the shapes fit; a scalar for a scalar is left to the merge,
    which converts what it can and names the key of what it cannot)."""
    inner = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if typing.get_origin(hint) is typing.Union:
        return None if value is None or len(inner) != 1 else _shape_misfit(inner[0], value, where)
    origin = typing.get_origin(hint) or hint
    if origin is list:
        if not isinstance(value, list):
            return f"{where} is {_kind(value)}"
        return next((found for index, item in enumerate(value)
                     if (found := _shape_misfit(inner[0], item, f"{where}[{index}]")) is not None), None)
    if origin is dict or dataclasses.is_dataclass(origin):
        if not isinstance(value, dict):
            return f"{where} is {_kind(value)}"
        if origin is not dict:
            return None  # a section of its own: its fields are checked when it is built
        return next((found for name, item in value.items()
                     if (found := _shape_misfit(inner[1], item, f"{where}.{name}")) is not None), None)
    if hint is not Any and isinstance(value, (list, dict)):
        return f"{where} is {_kind(value)}"
    return None


def _kind(value: Any) -> str:
    return ("a list" if isinstance(value, list) else "a mapping" if isinstance(value, dict)
            else "null" if value is None else f"{value!r}")


def _shape_text(hint: Any, plural: bool = False) -> str:
    """What a field typed `hint` holds, in words: `list[dict[str, str]]` is "a list of mappings of names to
    strings"."""
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    origin = typing.get_origin(hint) or hint
    if origin is typing.Union:
        return f"{_shape_text(args[0], plural)}, or null" if len(args) == 1 else f"a value of type {hint}"
    if origin is list:
        return f"{'lists' if plural else 'a list'} of {_shape_text(args[0], True)}"
    if origin is dict:
        return f"{'mappings' if plural else 'a mapping'} of names to {_shape_text(args[1], True)}"
    if dataclasses.is_dataclass(origin):
        keys = ", ".join(f.name for f in dataclasses.fields(origin))
        return f"{'mappings' if plural else 'a mapping'} of {keys}"
    words = {str: ("a string", "strings"), int: ("an integer", "integers"), float: ("a number", "numbers"),
             bool: ("true or false", "true or false")}.get(origin, ("a value", "values"))
    return words[plural]


def _choices(hint: Any) -> Any:
    """The choice (`gpujobs.config.modes`) a field typed `hint` takes, Optional or not; else None."""
    inner = [arg for arg in typing.get_args(hint) if arg is not type(None)] or [hint]
    return inner[0] if len(inner) == 1 and is_choice(inner[0]) else None


def _lookup(values: dict[str, Any], dotted: str) -> Any:
    node: Any = values
    for part in re.split(r"\.|\[|\]", dotted):
        if part == "":
            continue
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            return None
    return node


def _meant(section: str, name: Optional[str]) -> Optional[str]:
    """The full key of `name` in `section` (None stays None)."""
    return f"{section}.{name}" if name else None


def _aliased(key: str, schema: type[Any], values: Any) -> Any:
    """`_section`, for a section whose keys include a Python keyword (`checkpoint.async`): the key is
    renamed to the schema's field going in, and back in any error coming out."""
    aliases = KEY_ALIASES.get(key)
    if not aliases or not isinstance(values, dict):
        return _section(key, schema, values)
    renamed = {aliases.get(name, name): value for name, value in values.items()}
    try:
        return _section(key, schema, renamed)
    except ConfigError as err:
        if err.allowed.startswith(f"keys of {key}:"):  # an unknown key: the likely one among the keys as written
            written = [next((a for a, f in aliases.items() if f == field.name), field.name)
                       for field in dataclasses.fields(schema)]
            bad = err.key.partition(".")[2]
            err = ConfigError(err.key, err.value, err.allowed, _meant(key, closest_key(bad, written)))
        for alias, name in aliases.items():
            if err.key == f"{key}.{name}":
                raise ConfigError(f"{key}.{alias}", err.value, err.allowed, err.suggestion) from None
            if name in err.allowed:
                suggestion = f"{key}.{alias}" if err.suggestion == f"{key}.{name}" else err.suggestion
                err = ConfigError(err.key, err.value, err.allowed.replace(name, alias), suggestion)
        raise err from None


def _plugin(key: str, values: Any) -> Any:
    """Build a plug-in's schema object from its `_target_` (a torch-free dataclass)."""
    if not isinstance(values, dict) or "_target_" not in values:
        raise ConfigError(f"{key}._target_", None, "a dotted path to a config dataclass")
    target = values["_target_"]
    module_name, _, attr = str(target).rpartition(".")
    try:
        schema = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError):
        raise ConfigError(f"{key}._target_", target, "an importable dataclass path") from None
    if not dataclasses.is_dataclass(schema):
        raise ConfigError(f"{key}._target_", target, "a dataclass")
    return _section(key, schema, values)  # type: ignore[arg-type]


def _logger(values: Any) -> LoggerConfig:
    """`logger`: each selected tracker's section (`logger=[tensorboard,mlflow]` sets both keys), by its schema;
    an error names the tracker's key (`logger.mlflow.tracking_uri`)."""
    if values is None:  # `logger=[]` selects nothing
        return LoggerConfig()
    names = ", ".join(TRACKERS)
    if not isinstance(values, dict):
        raise ConfigError("logger", values, f"trackers chosen as logger=none|tensorboard|mlflow or a list ({names})")
    for name in values:
        if name not in TRACKERS:
            raise ConfigError(f"logger.{name}", values[name], f"trackers: {names} (logger=[{names}] selects both)")
    return LoggerConfig(**{name: None if section is None
                           else _section(f"logger.{name}", TRACKERS[Tracker(name)], section)
                           for name, section in values.items()})


def _resolved(cfg: DictConfig) -> Any:
    """The config as plain values, its interpolations resolved; one that does not resolve is a ConfigError."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as err:
        key = err.full_key or "?"
        written: Any = OmegaConf.to_container(cfg, resolve=False)  # the value as written, e.g. '${oops}'
        for part in key.split("."):
            written = written.get(part) if isinstance(written, dict) else None
        reason = (err.msg or str(err)).splitlines()[0]
        raise ConfigError(key, written, f"an interpolation that resolves ({reason})") from None


def load_config(cfg: DictConfig | dict[str, Any], user_keys: Collection[str] = ()) -> JobConfig:
    """Validate a composed config and return it as typed objects. Raises ConfigError.

    `user_keys` are the keys the user's overrides set (`override_keys`). An error about a key they did not
    set that a rank count they did set causes (the data cannot serve so many ranks) names that count.
    """
    raw: Any = _resolved(cfg) if isinstance(cfg, DictConfig) else dict(cfg)
    raw.pop("hydra", None)
    try:
        return _load(raw)
    except ConfigError as err:
        if err.key in user_keys:
            raise
        raise _blamed_on_ranks(raw, err, user_keys) from None


def override_keys(overrides: Collection[str]) -> frozenset[str]:
    """The keys a list of Hydra overrides sets (`+a.b=1`, `++a.b=1`, `~a.b` all name `a.b`)."""
    return frozenset(text.lstrip("+~").split("=", 1)[0] for text in overrides)


def _load(raw: dict[str, Any]) -> JobConfig:
    known = {f.name for f in dataclasses.fields(JobConfig)}
    for key in raw:
        if key not in known:
            raise ConfigError(str(key), raw[key], f"top-level keys: {', '.join(sorted(known))}",
                              closest_key(str(key), sorted(known)))
    top = {key: raw[key] for key in ("name", "task") if key in raw}
    sections = {key: _aliased(key, schema, raw.get(key)) for key, schema in SECTIONS.items()}
    plugins = {key: _plugin(key, raw.get(key)) for key in PLUGINS}
    script = _section("script", ScriptConfig, raw["script"]) if raw.get("script") is not None else None
    return JobConfig(**top, **sections, **plugins, logger=_logger(raw.get("logger")), script=script)


def _blamed_on_ranks(raw: dict[str, Any], err: ConfigError, user_keys: Collection[str]) -> ConfigError:
    """`err` naming the rank count the user set instead, where the config loads with that count at 1: the
    most it takes is then found by bisection (a rule such as rows per rank only tightens with more ranks)."""
    resources = raw.get("resources")
    if not isinstance(resources, dict):
        return err
    for key in _RANK_COUNTS:
        name = key.partition(".")[2]
        value = resources.get(name)
        if key not in user_keys or type(value) is not int or value <= 1 or not _loads(raw, name, 1):
            continue
        most, over = 1, value
        while over - most > 1:
            mid = (most + over) // 2
            most, over = (mid, over) if _loads(raw, name, mid) else (most, mid)
        allowed = f"at most {most}, as the rest of the config stands ({err.key}={err.value!r} needs {err.allowed})"
        return ConfigError(key, value, allowed)
    return err


def _loads(raw: dict[str, Any], name: str, count: int) -> bool:
    """Whether `raw` loads with `resources.<name>` set to `count`."""
    try:
        _load({**raw, "resources": {**raw["resources"], name: count}})
    except ConfigError:
        return False
    return True

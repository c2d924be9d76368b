"""Typed JSON objects: a record dataclass to the object of its line (or file) and back, one pair for every
record of the run dir (`gpujobs.rundir.records`, the heartbeat), so that a writer and its readers share the
dataclass and no reader indexes a raw dict by a string of its own.

A field's key in the file is its name, unless its metadata says otherwise (`key("async")`: a Python keyword
cannot be a field name). A `flat()` dict field (a task's metrics) has its entries beside the other fields.
`from_line` tolerates what a crash or an older gpujobs left: an unknown key is ignored, and a line whose
known keys hold another type than their fields declare (`"end": "2000"`, `"world_size": null`) is as
unreadable as a torn one (None), so that no reader fails on its arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Optional, TypeVar, Union

_KEY = "gpujobs.key"
_FLAT = "gpujobs.flat"
#: Keys that say what a line is, not what it holds: never gathered into a flat field.
_ENVELOPE = ("kind",)

R = TypeVar("R")

_HINTS: dict[type[Any], dict[str, Any]] = {}


def key(name: str) -> dict[str, str]:
    """Field metadata: the field's key in the file is `name` (`field(default=False, metadata=key("async"))`)."""
    return {_KEY: name}


def flat() -> dict[str, bool]:
    """Field metadata: a dict of numbers whose entries sit beside the other fields in the file."""
    return {_FLAT: True}


def _hints(cls: type[Any]) -> dict[str, Any]:
    """The fields' declared types, resolved once per class (the annotations are strings here)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value is of the type a field declares: an int is a float too, a bool is no
    number, a float is finite; a list's items are checked, a dict's are not."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return any(fits(value, arg) for arg in args)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(fits(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return False
    if hint is float:
        return math.isfinite(value)
    return isinstance(value, hint)


def to_line(record: Any, *, drop_empty: bool = False) -> dict[str, Any]:
    """The JSON object of `record` (a dataclass): each field under its key, a flat field's entries beside
    them, last. `drop_empty` leaves out fields that are None or an empty list (an attempt's unset fields)."""
    out: dict[str, Any] = {}
    spread: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        value = _plain(getattr(record, f.name))
        if f.metadata.get(_FLAT):
            spread.update(value)
        elif not (drop_empty and value in (None, [])):
            out[f.metadata.get(_KEY, f.name)] = value
    return {**out, **spread}


def _plain(value: Any) -> Any:
    """A copy of a field's value that shares nothing with the record (lists and dicts of JSON values)."""
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def from_line(cls: type[R], line: Any) -> Optional[R]:
    """The `cls` record a JSON object holds, or None where it holds none (not an object, a required field
    missing, a known key of another type than its field declares)."""
    if not isinstance(line, dict):
        return None
    hints, fields = _hints(cls), dataclasses.fields(cls)  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for f in fields:
        name = f.metadata.get(_KEY, f.name)
        if f.metadata.get(_FLAT):
            taken = {g.metadata.get(_KEY, g.name) for g in fields}
            values[f.name] = {k: v for k, v in line.items()
                              if k not in taken and k not in _ENVELOPE and fits(v, float)}
        elif name in line:
            if not fits(line[name], hints[f.name]):
                return None
            values[f.name] = line[name]
    try:
        return cls(**values)
    except TypeError:  # a required field missing
        return None

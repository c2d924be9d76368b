"""The one validator of every schema: bounds declared next to each field, finite numbers, safe text (torch-free).

A field states what its consumer accepts where it is declared, and `Checked` enforces it on construction:

    lr: float = field(default=1e-3, metadata=bounds(gt=0))
    \"""Peak learning rate.\"""

Whatever a field declares, `check_fields` also refuses a float that is not finite (nan, inf) and a string
with a control character (newline, CR, NUL, ...) anywhere in a schema: such values are never right, and
some reach parsers that no quoting protects. `sbatch` reads `#SBATCH` lines itself, not through a shell:
a newline ends the directive (the rest runs as a command), a backslash escapes the next character, and
Slurm expands `%` in log paths. `check_slurm_path` holds paths to that standard. Checks that relate
fields to one another stay small and explicit in the schemas' `__post_init__`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Optional

from gpujobs.base.errors import ConfigError

_KEY = "gpujobs.bounds"
# C0 and C1 controls, DEL, and the Unicode line and paragraph separators (str.splitlines breaks on them)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
NO_CONTROL = "text without control characters (newline, CR, tab, NUL, ...)"
SLURM_PATH = r"a path without control characters, % or \ (Slurm expands % and drops \ in #SBATCH paths)"
#: Linux's NAME_MAX: the most bytes one level of a path (a file or directory name) may have.
NAME_MAX = 255
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


@dataclass(frozen=True)
class Bounds:
    """What a field's consumer accepts; see `bounds`."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None
    one_of: tuple[str, ...] = ()
    pattern: Optional[re.Pattern[str]] = None
    valid: Optional[Callable[[Any], bool]] = None
    allowed: Optional[str] = None
    note: str = ""
    min_len: int = 0
    any_text: bool = False


def bounds(
    *,
    ge: Optional[float] = None,
    gt: Optional[float] = None,
    le: Optional[float] = None,
    lt: Optional[float] = None,
    one_of: Sequence[str] = (),
    pattern: Optional[re.Pattern[str]] = None,
    valid: Optional[Callable[[Any], bool]] = None,
    allowed: Optional[str] = None,
    note: str = "",
    min_len: int = 0,
    any_text: bool = False,
) -> dict[str, Bounds]:
    """Field metadata declaring what the field accepts (`field(default=..., metadata=bounds(...))`).

    ge/gt/le/lt bound a number, or each number of a list (which also needs `min_len` items); `one_of`
    lists the accepted strings (a field typed with a `gpujobs.config.modes` choice has its values without
    saying so); `pattern` must match a whole string; `valid(value)` is any other test,
    described by `allowed`. The error's allowed text is derived from these (`allowed` replaces it,
    `note` is added in parentheses). `any_text` lets a string hold control characters but NUL (an argv
    item, which reaches no parser, only exec). A None value passes where the field is Optional.
    """
    return {_KEY: Bounds(ge, gt, le, lt, tuple(one_of), pattern, valid, allowed, note, min_len, any_text)}


@dataclass(frozen=True)
class _Rule:
    name: str
    kind: Any  # int, float, str, bool, list, dict or object (anything else)
    item: Any  # the item type of a list, the value type of a dict
    optional: bool
    bounds: Optional[Bounds]
    ok: Callable[[Any], bool] = lambda value: False
    """A quick test passing what `_check` would return unchanged; what fails it takes `_check`."""


_rules: dict[type[Any], tuple[_Rule, ...]] = {}


class Checked:
    """Base of the schema dataclasses: construction runs `check_fields` (a subclass's own
    `__post_init__` calls `super().__post_init__()` first, then its cross-field checks)."""

    def __post_init__(self) -> None:
        check_fields(self)


def check_fields(obj: Any) -> None:
    """Enforce on the dataclass `obj` what its fields declare; raise ConfigError naming the field.

    An int given where a float is declared becomes that float, and a list-like (OmegaConf's
    ListConfig) a plain list, so the object is what its type hints say.
    """
    for rule in _rules.get(type(obj)) or _rules_of(type(obj)):
        value = getattr(obj, rule.name)
        if not rule.ok(value):
            checked = _check(rule, value)
            if checked is not value:
                object.__setattr__(obj, rule.name, checked)


def check_text(key: str, value: str, allowed: str = NO_CONTROL) -> None:
    """Refuse a string with a control character (newline, CR, NUL, ...)."""
    if _CONTROL.search(value):
        raise ConfigError(key, value, allowed)


def check_slurm_path(key: str, path: str | os.PathLike[str], *, slurm: bool) -> None:
    """Refuse a path with a control character; for Slurm (`slurm`), also one with `%` or `\\`.

    Slurm expands `%j`-style patterns in `--output`/`--error` paths, and sbatch's parser of `#SBATCH`
    lines drops a backslash (escaping the next character), so neither can be quoted reliably there.
    """
    text = os.fspath(path)
    check_text(key, text, SLURM_PATH if slurm else f"a path without control characters ({NO_CONTROL})")
    if slurm and ("%" in text or "\\" in text):
        raise ConfigError(key, text, SLURM_PATH)


def is_host(value: Any) -> bool:
    """An IP address literal (v4 or v6, as `ipaddress` reads it) or an RFC 1123 host name; "" (every
    interface, as in socket.bind) too.

    A dotted name whose last label is all digits is no host name (RFC 1123 2.1: the top-level label is
    alphabetic), so `999.1.1.1` or `1.2.3.4.5` is a mistyped address, not a name for the resolver to try.
    """
    if not isinstance(value, str):
        return False
    if value == "":
        return True
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        pass
    name = value[:-1] if value.endswith(".") else value
    labels = name.split(".")
    return (0 < len(name) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels)
            and not labels[-1].isdigit())


def allowed_text(
    bounds: Bounds, kind: Any, item: Any = None, optional: bool = False, *, say_finite: bool = False
) -> str:
    """What a field with these bounds accepts, in words (the `allowed` part of its ConfigError).

    `say_finite` says so where the value was nan or inf: "a number > 0" alone would not tell why inf is not.
    """
    if bounds.allowed is not None:
        text = bounds.allowed
    elif bounds.one_of:
        text = f"one of {', '.join(bounds.one_of)}"
    elif kind is list:
        each = _range_text(bounds)
        plural = ("integers" if item is int else "strings (any text)" if item is str
                  else "finite numbers" if say_finite else "numbers")
        size = f"at least {bounds.min_len} " if bounds.min_len else ""
        text = f"a list of {size}{plural}" + (f", each {each}" if each else "")
    elif kind in (int, float):
        noun = "an integer" if kind is int else ("a finite number" if say_finite else "a number")
        text = f"{noun} {_range_text(bounds)}".rstrip()
    else:
        text = "a valid value"
    if bounds.note:
        text += f" ({bounds.note})"
    return text + (", or null" if optional else "")


def declared(schema: type[Any]) -> dict[str, Bounds]:
    """Each field of `schema` that declares bounds, by name (what tests iterate over)."""
    return {rule.name: rule.bounds for rule in _rules_of(schema) if rule.bounds is not None}


def _range_text(b: Bounds) -> str:
    low, high = (b.ge, "[") if b.ge is not None else (b.gt, "(")
    top, close = (b.le, "]") if b.le is not None else (b.lt, ")")
    if low is not None and top is not None:
        if high == "(" and close == ")":
            return f"strictly between {low} and {top}"
        return f"in {high}{low}, {top}{close}"
    if low is not None:
        return f"{'>=' if high == '[' else '>'} {low}"
    if top is not None:
        return f"{'<=' if close == ']' else '<'} {top}"
    return ""


def _rules_of(schema: type[Any]) -> tuple[_Rule, ...]:
    if schema not in _rules:
        hints = typing.get_type_hints(schema)
        rules = []
        for f in dataclasses.fields(schema):
            hint, optional = hints[f.name], False
            if typing.get_origin(hint) is typing.Union:
                inner = [arg for arg in typing.get_args(hint) if arg is not type(None)]
                optional = len(inner) < len(typing.get_args(hint))
                hint = inner[0] if len(inner) == 1 else object
            origin = typing.get_origin(hint) or hint
            args = typing.get_args(hint)
            kind = origin if origin in (int, float, str, bool, list, dict) or is_choice(origin) else object
            item = args[-1] if args else None
            declared_bounds = f.metadata.get(_KEY)
            if is_choice(kind) and declared_bounds is None:
                declared_bounds = Bounds(one_of=choice_values(kind))
            rule = _Rule(f.name, kind, item, optional, declared_bounds)
            rules.append(dataclasses.replace(rule, ok=_quick_test(rule)))
        _rules[schema] = tuple(rules)
    return _rules[schema]


def _quick_test(rule: _Rule) -> Callable[[Any], bool]:
    """`rule.ok`: the common case in a few comparisons (a sweep validates hundreds of points)."""
    b, kind = rule.bounds, rule.kind
    none_ok = rule.optional or b is None
    # ±inf stand for "no bound"; a finite value passes them, inf and nan fail (and take `_check`)
    ge = -math.inf if b is None or b.ge is None else b.ge
    gt = -math.inf if b is None or b.gt is None else b.gt
    le = math.inf if b is None or b.le is None else b.le
    lt = math.inf if b is None or b.lt is None else b.lt
    if kind in (int, float) and (b is None or b.valid is None):
        return lambda v: (type(v) is kind and ge <= v <= le and gt < v < lt) or (v is None and none_ok)
    item, min_len = rule.item, b.min_len if b else 0
    if kind is list and item in (int, float) and (b is None or b.valid is None):
        return lambda v: (type(v) is list and len(v) >= min_len
                          and all(type(i) is item and ge <= i <= le and gt < i < lt for i in v))
    if kind is str and (b is None or (b.valid is None and not b.any_text)):
        search, one_of, pattern = _CONTROL.search, frozenset(b.one_of if b else ()), b.pattern if b else None
        if one_of:  # the declared choices hold no control characters
            return lambda v: (type(v) is str and v in one_of) or (v is None and none_ok)
        if pattern is not None:
            fullmatch = pattern.fullmatch
            return lambda v: (type(v) is str and search(v) is None and fullmatch(v) is not None) or (
                v is None and none_ok)
        return lambda v: (type(v) is str and search(v) is None) or (v is None and none_ok)
    if is_choice(kind):
        return lambda v: type(v) is kind or (v is None and none_ok)
    if kind in (bool, object) and b is None:
        return lambda v: True
    return lambda v: False


def _check(rule: _Rule, value: Any) -> Any:
    """`value` checked against `rule`, possibly widened (int to float, list-like to list)."""
    b = rule.bounds
    if value is None:
        if b is not None and not rule.optional:
            raise ConfigError(rule.name, value, allowed_text(b, rule.kind, rule.item))
        return value
    if rule.kind is float or rule.kind is int:
        return _check_number(rule, value, rule.kind)
    if is_choice(rule.kind):
        return choice(rule.name, rule.kind, value, rule.optional)
    if rule.kind is str:
        _check_str(rule, value)
    elif rule.kind is list and not isinstance(value, (str, bytes)) and isinstance(value, Sequence):
        items = value if isinstance(value, list) else list(value)
        if rule.item in (int, float):
            items = [_check_number(rule, item, rule.item, whole=value) for item in items]
            if b is not None and len(items) < b.min_len:
                raise ConfigError(rule.name, value, allowed_text(b, list, rule.item))
        else:
            for item in items:
                _scan(rule, item, value)
        changed = type(value) is not list or any(new is not old for new, old in zip(items, value, strict=True))
        value = items if changed else value  # a list's own test (`valid`) below sees the list as it is kept
    elif rule.kind is dict and isinstance(value, dict):
        for item in value.values():
            _scan(rule, item, value)
    if b is not None and b.valid is not None and not b.valid(value):
        raise ConfigError(rule.name, value, allowed_text(b, rule.kind, rule.item, rule.optional))
    return value


def is_choice(kind: Any) -> bool:
    """Whether a field's type is a fixed choice (a `StrEnum` of `gpujobs.config.modes`)."""
    return isinstance(kind, type) and issubclass(kind, StrEnum)


def choice_values(choices: Any) -> tuple[str, ...]:
    """The values a choice takes, in declaration order."""
    return tuple(member.value for member in choices)


def choice(name: str, choices: type[StrEnum], value: Any, optional: bool = False) -> StrEnum:
    """The member of `choices` that `value` (a member, or its value as text) is; ConfigError naming `name`
    and the values (and null where the field is `optional`) for anything else. Text with a control
    character is refused as any text is."""
    if isinstance(value, choices):
        return value
    if isinstance(value, str):
        check_text(name, value)
    try:
        return choices(value)
    except ValueError:
        allowed = allowed_text(Bounds(one_of=choice_values(choices)), str, None, optional)
        raise ConfigError(name, value, allowed) from None


def _check_number(rule: _Rule, value: Any, kind: Any, whole: Any = None) -> Any:
    b = rule.bounds
    shown = value if whole is None else whole  # a list's error shows the whole list
    # bool is an int subclass, but `batch_size: true` is a typo, not 1
    fits = type(value) is int or (kind is float and type(value) is float)
    finite = fits and (kind is int or math.isfinite(value))
    if not finite:
        if b is None and fits:
            raise ConfigError(rule.name, shown, "a finite number")
        if b is None:
            return value  # not ours to judge: the loader has already checked types
        raise ConfigError(rule.name, shown, allowed_text(b, rule.kind, rule.item, rule.optional, say_finite=fits))
    if b is not None and not _in_range(b, value):
        raise ConfigError(rule.name, shown, allowed_text(b, rule.kind, rule.item, rule.optional))
    return float(value) if kind is float and type(value) is int else value


def _in_range(b: Bounds, value: float) -> bool:
    return not (
        (b.ge is not None and value < b.ge)
        or (b.gt is not None and value <= b.gt)
        or (b.le is not None and value > b.le)
        or (b.lt is not None and value >= b.lt)
    )


def _check_str(rule: _Rule, value: Any) -> None:
    b = rule.bounds
    if not isinstance(value, str):
        if b is not None:
            raise ConfigError(rule.name, value, allowed_text(b, str, None, rule.optional))
        return
    if not (b is not None and b.any_text):
        check_text(rule.name, value)
    elif "\x00" in value:  # even an argv item: exec cannot pass a NUL
        raise ConfigError(rule.name, value, "text without NUL (an argument cannot hold one)")
    if b is None:
        return
    if (b.one_of and value not in b.one_of) or (b.pattern is not None and not b.pattern.fullmatch(value)):
        raise ConfigError(rule.name, value, allowed_text(b, str, None, rule.optional))


def _scan(rule: _Rule, item: Any, whole: Any) -> None:
    """Refuse a non-finite float or a control character inside a list's or a dict's items."""
    any_text = rule.bounds is not None and rule.bounds.any_text
    if type(item) is float and not math.isfinite(item):
        raise ConfigError(rule.name, whole, "finite numbers")
    if isinstance(item, str) and not any_text:
        check_text(rule.name, item)
    elif isinstance(item, str) and "\x00" in item:  # even an argv item: exec cannot pass a NUL
        raise ConfigError(rule.name, whole, "text without NUL (an argument cannot hold one)")

"""Hydra's and OmegaConf's composition errors as gpujobs' one line (torch-free).

Hydra prints a bad override as several lines (an options list, its config search path, a hint about
HYDRA_FULL_ERROR), and some errors, such as a bad interpolation, as a traceback. `submit.main` asks Hydra
to raise them instead and reports each here: one line naming the key or override, the value, and what
is allowed where Hydra says it.
"""

from __future__ import annotations

from typing import Optional

from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from gpujobs.base.errors import ConfigError, closest_key

_HYDRA_HINT = "Set the environment variable HYDRA_FULL_ERROR=1"


def _flat(text: str) -> str:
    """Hydra's lines as one sentence; OmegaConf's trailing `full_key:`/`object_type=` lines dropped."""
    lines = []
    for line in str(text).splitlines():
        line = line.strip()
        if line.startswith(("full_key:", "object_type=", "reference_type=", "Config search path", "provider=")):
            continue
        if line and not line.startswith(_HYDRA_HINT):
            lines.append(line.rstrip("."))
    return "; ".join(lines)


def _unknown_key(cause: OmegaConfBaseException, overrides: list[str]) -> Optional[str]:
    """An override of a key the schema does not have: the one it likely meant, and the keys its parent has."""
    parent, missing = cause.parent_node, cause.full_key
    if "not in struct" not in str(cause) or not missing or not isinstance(parent, DictConfig):
        return None
    override = next((o for o in overrides if o.lstrip("+~").split("=", 1)[0] == missing), "")
    override = override or next((o for o in overrides if o.lstrip("+~").startswith(f"{missing}.")), "")
    key, _, value = override.lstrip("+~").partition("=")
    where = missing.rpartition(".")[0]
    allowed = f"a key of {where or 'the config'}: {', '.join(str(k) for k in parent)}"
    if key and key != missing:
        allowed = f"{allowed} ({where or 'the config'} has no {cause.key})"
    meant = closest_key(str(cause.key), parent)  # the key (or section, in `key`) the user likely meant
    suggestion = None if meant is None else (f"{where}.{meant}" if where else meant) + (key or missing)[len(missing):]
    return str(ConfigError(key or missing, value or None, allowed, suggestion))


def one_line(err: BaseException, overrides: list[str]) -> str:
    """`err`, raised while composing the config from `overrides`, as the one line `gpujobs:` prints."""
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and err.options:
        group, _, name = err.missing_cfg_file.rpartition("/")
        if group:
            return str(ConfigError(group, name, f"one of {', '.join(err.options)} (the configs in {group}/)"))
    if isinstance(err, OverrideParseException):
        return f"override {err.override!r} does not parse: {_flat(err.message)}"
    cause = err.__cause__
    unknown = _unknown_key(cause, overrides) if isinstance(cause, OmegaConfBaseException) else None
    if unknown is not None:
        return unknown
    if isinstance(err, OmegaConfBaseException) and err.full_key:
        return f"{err.full_key}: {_flat(err.msg or str(err))}"
    text = _flat(str(err))
    if isinstance(cause, OmegaConfBaseException):
        text = f"{text}: {_flat(cause.msg or str(cause))}"
    return text

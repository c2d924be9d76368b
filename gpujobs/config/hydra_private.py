"""Hydra's and OmegaConf's private names that gpujobs relies on, all in this one module (written for
hydra-core 1.3.x and its omegaconf 2.3.x).

Hydra's public API composes and runs; gpujobs also spares a submit Hydra's second composition, derives
a sweep's points from one composition with Hydra's own override code, and sets OmegaConf values in
place. Every private name that takes is used here and only here, and listed in `PRIVATE_NAMES`;
`tests/test_private_apis.py` checks each against the installed Hydra and OmegaConf (that it exists, is
of the kind and takes the parameters used here), so an upgrade that moves one fails there, naming it.

Hydra is imported lazily: the job side imports this module (for `omegaconf_str_representer`) and must
not pay for Hydra. One name is imported elsewhere, and listed here all the same: `BasicSweeper`, the base
class of `hydra_plugins`' sweeper, whose module Hydra's plugin discovery imports without gpujobs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Optional

from omegaconf import DictConfig, ListConfig, ValueNode, open_dict, read_write
from omegaconf._utils import get_omega_conf_dumper

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

#: The series this module is written for (pyproject.toml pins them).
PINNED = {"hydra-core": "1.3", "omegaconf": "2.3"}

#: Every private name used below, as (module, dotted attribute, kind, parameters used), for the test.
#: kind: "class", "function" (its parameters after `self`, in order, at least those named), "attribute"
#: (of the class), "instance attribute" (set by `__init__`).
PRIVATE_NAMES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("hydra._internal.hydra", "Hydra.get_mode", "function", ("config_name", "overrides")),
    ("hydra._internal.hydra", "Hydra.compose_config", "function", ("config_name", "overrides", "run_mode")),
    ("hydra._internal.config_loader_impl", "ConfigLoaderImpl.load_configuration", "function",
     ("config_name", "overrides", "run_mode", "from_shell", "validate_sweep_overrides")),
    ("hydra._internal.config_loader_impl", "ConfigLoaderImpl._apply_overrides_to_config", "function",
     ("overrides", "cfg")),
    ("hydra._internal.config_loader_impl", "ConfigLoaderImpl.repository", "instance attribute", ()),
    ("hydra._internal.config_loader_impl", "get_overrides_dirname", "function",
     ("overrides", "exclude_keys", "item_sep", "kv_sep")),
    ("hydra._internal.config_repository", "ConfigRepository.group_exists", "function", ("config_path",)),
    ("hydra._internal.core_plugins.basic_sweeper", "BasicSweeper", "class", ("max_batch_size", "params")),
    ("hydra.core.hydra_config", "HydraConfig.set_config", "function", ("cfg",)),
    ("hydra.core.utils", "JobReturn", "class", ("overrides", "working_dir", "status", "_return_value")),
    ("omegaconf", "Container._get_node", "function", ("key",)),
    ("omegaconf", "Node._set_value", "function", ("value",)),
    ("omegaconf._utils", "get_omega_conf_dumper", "function", ()),
)


def omegaconf_str_representer() -> Callable[..., Any]:
    """OmegaConf's YAML representer of strings: quotes those that would read back as a bool or number."""
    return get_omega_conf_dumper().str_representer


def apply_overrides(overrides: list[Override], cfg: DictConfig) -> None:
    """Apply value overrides to `cfg` with Hydra's own code, as composition does after the defaults list."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    ConfigLoaderImpl._apply_overrides_to_config(overrides, cfg)


def overrides_dirname(overrides: list[Override], kv_sep: str, item_sep: str, exclude_keys: list[str]) -> str:
    """`hydra.job.override_dirname` of a job with these task overrides, as Hydra makes it."""
    from hydra._internal.config_loader_impl import get_overrides_dirname

    return get_overrides_dirname(overrides=overrides, kv_sep=kv_sep, item_sep=item_sep, exclude_keys=exclude_keys)


def config_repository(config_loader: Any) -> Optional[Any]:
    """The config repository of Hydra's config loader (it answers `group_exists`); None for another loader."""
    return getattr(config_loader, "repository", None)


def set_hydra_config(cfg: DictConfig) -> None:
    """Make `cfg`'s `hydra` node what `HydraConfig.get()` returns, as Hydra's `run_job` does."""
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(cfg)


def completed_job(overrides: list[str], working_dir: str, value: Any) -> Any:
    """Hydra's `JobReturn` of a job that completed with `value` (what `run_job` returns)."""
    from hydra.core.utils import JobReturn, JobStatus

    return JobReturn(overrides=overrides, working_dir=working_dir, status=JobStatus.COMPLETED, _return_value=value)


def set_values(node: DictConfig, values: dict[str, Any]) -> None:
    """`node[key] = value` for each dotted key, as assignment does it, but in place where the key holds a
    value already: through its value node (a list, element by element), which skips the rest of
    OmegaConf's assignment machinery. Hydra's `hydra` node is typed, so assigning one string there costs
    about 0.1 ms, and a sweep sets five a point."""
    with read_write(node), open_dict(node):
        for dotted, value in values.items():
            *path, key = dotted.split(".")
            parent: Any = node
            for part in path:
                parent = parent._get_node(part)
            child = parent._get_node(key) if key in parent else None
            items = [child._get_node(i) for i in range(len(child))] if isinstance(child, ListConfig) else None
            if isinstance(child, ValueNode):
                child._set_value(value)
            elif (items is not None and isinstance(value, list) and len(items) == len(value)
                  and all(isinstance(item, ValueNode) for item in items)):
                for item, new in zip(items, value, strict=True):
                    item._set_value(new)  # type: ignore[union-attr]
            else:
                parent[key] = value


@contextlib.contextmanager
def one_composition(multirun: bool) -> Iterator[None]:
    """While a Hydra main runs inside, compose its config once, not twice (about 0.1 s saved).

    Hydra 1.3's main composes the config once just to read `hydra.mode` (`Hydra.get_mode`), then again to
    run. With `-m` (`multirun`) the answer changes nothing: a mode not set (None, as in gpujobs' configs)
    makes Hydra add the override `hydra.mode=MULTIRUN`, RUN makes it warn and add the same, and MULTIRUN
    is already that; so the probe answers None at once, and the multirun's own composition still reports
    every error. A single run's probe composes as the run will (run mode, overrides checked) and the
    run then takes that config, with the `hydra.mode=RUN` override Hydra adds applied by Hydra's own
    code. Where the run composition fails, or sets another mode, Hydra's own probe answers and the run
    composes as usual.
    """
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.hydra import Hydra
    from hydra.types import RunMode

    probe, load = Hydra.get_mode, ConfigLoaderImpl.load_configuration
    kept = _KeptComposition(probe, load)

    def get_mode(hydra: Hydra, config_name: Optional[str], overrides: list[str]) -> Any:
        return None if multirun else kept.get_mode(hydra, config_name, overrides)

    def load_configuration(loader: ConfigLoaderImpl, config_name: Optional[str], overrides: list[str],
                           run_mode: RunMode, from_shell: bool = True, validate_sweep_overrides: bool = True,
                           ) -> DictConfig:
        return kept.load_configuration(loader, config_name, overrides, run_mode, from_shell, validate_sweep_overrides)

    Hydra.get_mode = get_mode  # type: ignore[method-assign,assignment]
    ConfigLoaderImpl.load_configuration = load_configuration  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        Hydra.get_mode, ConfigLoaderImpl.load_configuration = probe, load  # type: ignore[method-assign]


class _KeptComposition:
    """A single run's composition, made by the mode probe and taken by the run (`one_composition`)."""

    def __init__(self, probe: Callable[..., Any], load: Callable[..., DictConfig]) -> None:
        self.probe, self.load = probe, load
        self.kept: Optional[tuple[Optional[str], list[str], DictConfig]] = None

    def get_mode(self, hydra: Any, config_name: Optional[str], overrides: list[str]) -> Any:
        """`Hydra.get_mode`, from the composition the run will take."""
        from hydra.types import RunMode

        try:
            cfg = hydra.compose_config(config_name=config_name, overrides=overrides, run_mode=RunMode.RUN)
        except Exception:  # Hydra's own probe answers (it composes for a multirun); the run reports the error
            return self.probe(hydra, config_name, overrides)
        mode = cfg.hydra.mode
        if mode is None:  # Hydra then runs with the override `hydra.mode=RUN` added
            self.kept = (config_name, [*overrides, "hydra.mode=RUN"], cfg)
        elif mode == RunMode.RUN:
            self.kept = (config_name, list(overrides), cfg)
        return mode

    def load_configuration(self, loader: Any, config_name: Optional[str], overrides: list[str], run_mode: Any,
                           from_shell: bool = True, validate_sweep_overrides: bool = True) -> DictConfig:
        """`ConfigLoaderImpl.load_configuration`: the kept composition for the run it was made for."""
        from hydra.types import RunMode

        kept, self.kept = self.kept, None
        if kept is None or run_mode != RunMode.RUN or kept[:2] != (config_name, list(overrides)):
            return self.load(loader, config_name, overrides, run_mode, from_shell, validate_sweep_overrides)
        cfg = kept[2]
        if cfg.hydra.mode is None:  # the override Hydra added, where composition would have put it
            from hydra.core.override_parser.overrides_parser import OverridesParser

            added = OverridesParser.create().parse_overrides([overrides[-1]])
            apply_overrides(added, cfg)
            cfg.hydra.overrides.hydra.append(overrides[-1])
        return cfg

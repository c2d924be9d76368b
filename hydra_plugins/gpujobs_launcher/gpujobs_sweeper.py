"""`GpujobsSweeper`: Hydra's basic sweeper, composing the config once when only plain values are swept.

Hydra's basic sweeper composes every point to check the batch, then the launcher composes every point
again: about 0.1 s a point, twice. When the task is gpujobs' own (`gpujobs.submit`), the launcher is the
gpujobs launcher, and the sweep only varies plain values (`optim.lr=1e-3,3e-3`,
`trainer.seed=range(0,100)`), this sweeper derives every point in turn (`DerivedPoints`, one config
changed in place) from the config Hydra has already composed for the sweep from the command line less its
swept overrides, applying the point's swept overrides (and the sweeper's `params`) with Hydra's own
override code: what composition would have done, since config overrides are applied after the defaults
list, in order, and no other override touches a key the points set. Each point's `hydra.overrides.task`,
`hydra.job.override_dirname`, `hydra.job.num` and `hydra.job.id` are set as Hydra sets them, in the config
and in `HydraConfig`, so `${hydra:...}` interpolations and the sweep subdir resolve the same. The launcher
then plans and queues the points (`GpujobsLauncher.launch_derived`); the task must carry
`gpujobs.launch.sweep.PLANS_SWEEP_POINTS`.

Anything else takes the basic sweeper's path unchanged: swept config groups (`model=a,b`), `~` deletes,
dict or list values, swept keys that another override also touches, a config group left `???`,
`max_batch_size`, Hydra callbacks, `hydra.job.chdir`, `hydra.job.env_set`, `hydra.output_subdir`, another
launcher or another task.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

# Hydra's private names are used through `gpujobs.config.hydra_private`, imported where they are used:
# Hydra's plugin discovery imports this module, and must not import gpujobs. The base class is the one
# exception, imported here (it is listed there too, and checked by tests/test_private_apis.py).
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

log = logging.getLogger(__name__)


def _overlaps(key: str, other: str) -> bool:
    return key == other or other.startswith(key + ".") or key.startswith(other + ".")


def _elements(override: Override) -> list[Any]:
    """The values a (discrete) override takes."""
    return list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]


class GpujobsSweeper(BasicSweeper):
    """Basic sweeper with a compose-once path for gpujobs value sweeps (see the module docstring)."""

    def __init__(self, max_batch_size: Optional[int] = None, params: Optional[dict[str, str]] = None) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.task_function: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        """As the basic sweeper; keeps the task function to tell whether it is gpujobs' own."""
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.task_function = task_function

    def sweep(self, arguments: list[str]) -> Any:
        """Derive and launch the points in one go where that is exact; otherwise sweep as the basic sweeper."""
        from gpujobs.rundir.trust import check_dir

        assert self.config is not None
        # before either sweeper writes multirun.yaml in it, or Hydra makes a point's dir there
        check_dir("hydra.sweep.dir", Path(str(self.config.hydra.sweep.dir)).absolute())
        derivable = self._derivable(arguments)
        if derivable is None:
            return super().sweep(arguments)
        parsed, applied = derivable
        assert self.hydra_context is not None
        batch = self.split_arguments(parsed, None)[0]
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        points = self._derive(batch, applied)
        launcher: Any = self.launcher
        return [launcher.launch_derived(batch, points)]

    def _derivable(self, arguments: list[str]) -> Optional[tuple[list[Override], set[str]]]:
        """The parsed overrides and the keys each point sets, when every point derives from the sweep's
        composition; else None. A point sets its swept keys and the keys of the sweeper's `params`, which
        the sweep's composition (of the command line) lacks."""
        from gpujobs.config.hydra_private import config_repository
        from gpujobs.launch.sweep import PLANS_SWEEP_POINTS
        from hydra_plugins.gpujobs_launcher.gpujobs_launcher import GpujobsLauncher

        assert self.config is not None and self.hydra_context is not None
        hydra = self.config.hydra
        repository = config_repository(self.hydra_context.config_loader)
        if (
            not getattr(self.task_function, PLANS_SWEEP_POINTS, False)
            or not isinstance(self.launcher, GpujobsLauncher)
            or self.max_batch_size is not None
            or repository is None
            or hydra.job.chdir
            or hydra.job.env_set
            or hydra.output_subdir is not None
            or hydra.callbacks
            or any(OmegaConf.is_missing(hydra.runtime.choices, group) for group in hydra.runtime.choices)
        ):  # (a group left `???`: the sweep's composition skipped it, a point's composition refuses it)
            return None
        lines = [f"{k}={v}" for k, v in self.params.items()] + list(arguments)
        parsed = OverridesParser.create(config_loader=self.hydra_context.config_loader).parse_overrides(lines)
        values = [o for o in parsed if o.package is None and not repository.group_exists(o.key_or_group)]
        applied = [o for num, o in enumerate(parsed) if num < len(self.params) or o.is_sweep_override()]
        for override in applied:
            if (
                override not in values
                or override.is_hydra_override()
                or (override.is_sweep_override() and not override.is_discrete_sweep())
                or override.type not in (OverrideType.CHANGE, OverrideType.ADD, OverrideType.FORCE_ADD)
                or any(isinstance(v, (dict, list)) for v in _elements(override))
                or any(o is not override and _overlaps(override.key_or_group, o.key_or_group) for o in values)
            ):
                return None
        return parsed, {o.key_or_group for o in applied}

    def _derive(self, batch: Sequence[Sequence[str]], applied: set[str]) -> DerivedPoints:
        """Every point derived from the sweep's own composition, and checked, as composing it would have.

        Hydra composes the sweep's config from the command line less its swept overrides (`self.config`);
        a point's composition differs from it only in the `applied` keys, set after the defaults list, and in
        the fields of `hydra` that name the point (its task overrides, `override_dirname`, number).
        """
        assert self.config is not None and self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        parsed: dict[str, Override] = {}  # the points share most of their override lines: parse each once
        for line in {line for overrides in batch for line in overrides}:
            parsed[line] = parser.parse_overrides([line])[0]
        points = DerivedPoints(self.config, [[parsed[line] for line in overrides] for overrides in batch], applied)
        points.check()  # as the basic sweeper's check of the batch
        return points


class DerivedPoints:
    """The points of a value sweep, derived in turn from one composed config (changed in place).

    While a point is current, `HydraConfig` holds its `hydra` node, as `run_job` would have set it.
    """

    def __init__(self, sweep_config: DictConfig, batch: list[list[Override]], applied: set[str]) -> None:
        self.full = copy.deepcopy(sweep_config)
        self.task = copy.deepcopy(sweep_config)  # what `run_job` hands the task: the config less its hydra node
        with read_write(self.task), open_dict(self.task):
            del self.task["hydra"]
        self.batch = batch
        self.applied = applied  # the keys each point sets
        self.added: set[str] = set()

    def __len__(self) -> int:
        return len(self.batch)

    def check(self) -> None:
        """Apply every point's values in turn: a value its key's type refuses fails here, before any point runs."""
        for parsed in self.batch:
            self._apply(parsed)

    def __iter__(self) -> Iterator[tuple[DictConfig, DictConfig]]:
        """Each point's full config and task config, in order; valid until the next point is taken."""
        from gpujobs.config.hydra_private import overrides_dirname, set_hydra_config, set_values

        dirname = self.full.hydra.job.config.override_dirname
        for num, parsed in enumerate(self.batch):
            self._apply(parsed)
            task = [o for o in parsed if not o.is_hydra_override()]
            values = {
                "overrides.task": [o.input_line for o in task],
                "job.override_dirname": overrides_dirname(
                    task, kv_sep=dirname.kv_sep, item_sep=dirname.item_sep, exclude_keys=list(dirname.exclude_keys),
                ),
                "job.id": num,
                "job.num": num,
            }
            set_values(self.full.hydra, values)
            if num == 0:  # later points change its copy of the node where they differ; it resolves
                set_hydra_config(self.full)  # interpolations against `full`, its parent
            else:
                set_values(HydraConfig.get(), values)  # type: ignore[arg-type]  # a DictConfig at run time
            yield self.full, self.task

    def _apply(self, parsed: list[Override]) -> None:
        from gpujobs.config.hydra_private import apply_overrides

        changed = [copy.copy(o) for o in parsed if o.key_or_group in self.applied]
        for override in changed:
            # `+key=v` adds the key at the first point (and, where it exists already, fails as Hydra's would);
            # the later points set the key it added
            if override.type == OverrideType.ADD and override.key_or_group in self.added:
                override.type = OverrideType.FORCE_ADD
        for cfg in (self.full, self.task):
            apply_overrides(changed, cfg)
        self.added.update(o.key_or_group for o in changed if o.type == OverrideType.ADD)


"""The plugins' configs, registered with Hydra's ConfigStore (`hydra/launcher=gpujobs`, `hydra/sweeper=gpujobs`).

The launcher has no knobs of its own: a point's cluster, array parallelism, wait and dry run come from
its gpujobs config (`cluster.*`), so one schema stays the single source of truth. The sweeper takes
the basic sweeper's two (`max_batch_size`, `params`).
"""

from dataclasses import dataclass
from typing import Optional

from hydra.core.config_store import ConfigStore


@dataclass
class GpujobsLauncherConf:
    """Selects `GpujobsLauncher`."""

    _target_: str = "hydra_plugins.gpujobs_launcher.gpujobs_launcher.GpujobsLauncher"


@dataclass
class GpujobsSweeperConf:
    """Selects `GpujobsSweeper`; the fields mean what they mean for Hydra's basic sweeper."""

    _target_: str = "hydra_plugins.gpujobs_launcher.gpujobs_sweeper.GpujobsSweeper"
    max_batch_size: Optional[int] = None
    params: Optional[dict[str, str]] = None


ConfigStore.instance().store(group="hydra/launcher", name="gpujobs", node=GpujobsLauncherConf, provider="gpujobs")
ConfigStore.instance().store(group="hydra/sweeper", name="gpujobs", node=GpujobsSweeperConf, provider="gpujobs")

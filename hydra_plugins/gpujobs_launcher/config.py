"""The launcher's config, registered with Hydra's ConfigStore (group `hydra/launcher`, name `gpujobs`).

It has no knobs of its own: a point's cluster, array parallelism, wait and dry run come from its
gpujobs config (`cluster.*`), so one schema stays the single source of truth.
"""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore


@dataclass
class GpujobsLauncherConf:
    """Selects `GpujobsLauncher`."""

    _target_: str = "hydra_plugins.gpujobs_launcher.gpujobs_launcher.GpujobsLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="gpujobs", node=GpujobsLauncherConf, provider="gpujobs")

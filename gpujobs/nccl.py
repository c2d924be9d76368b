"""Typed NCCL settings and the environment they become on every rank (torch-free)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from gpujobs.errors import ConfigError

#: NCCL environment variables gpujobs accepts in `nccl.extra` (from NCCL's documented list).
#: Anything else is almost always a typo that NCCL would silently ignore.
KNOWN_NCCL_VARS: frozenset[str] = frozenset(
    {
        "NCCL_ALGO", "NCCL_BUFFSIZE", "NCCL_CHECKS_DISABLE", "NCCL_CHECK_POINTERS",
        "NCCL_COLLNET_ENABLE", "NCCL_COMM_BLOCKING", "NCCL_CROSS_NIC", "NCCL_CUMEM_ENABLE",
        "NCCL_DEBUG", "NCCL_DEBUG_FILE", "NCCL_DEBUG_SUBSYS", "NCCL_DMABUF_ENABLE",
        "NCCL_GRAPH_DUMP_FILE", "NCCL_GRAPH_FILE", "NCCL_IB_ADAPTIVE_ROUTING", "NCCL_IB_AR_THRESHOLD",
        "NCCL_IB_CUDA_SUPPORT", "NCCL_IB_DISABLE", "NCCL_IB_GID_INDEX", "NCCL_IB_HCA",
        "NCCL_IB_PCI_RELAXED_ORDERING", "NCCL_IB_QPS_PER_CONNECTION", "NCCL_IB_RETRY_CNT",
        "NCCL_IB_SL", "NCCL_IB_SPLIT_DATA_ON_QPS", "NCCL_IB_TC", "NCCL_IB_TIMEOUT",
        "NCCL_IB_USE_INLINE", "NCCL_IGNORE_CPU_AFFINITY", "NCCL_LAUNCH_MODE", "NCCL_LL128_BUFFSIZE",
        "NCCL_LL_BUFFSIZE", "NCCL_MAX_NCHANNELS", "NCCL_MIN_NCHANNELS", "NCCL_MNNVL_ENABLE",
        "NCCL_NET", "NCCL_NET_GDR_LEVEL", "NCCL_NET_GDR_READ", "NCCL_NET_PLUGIN",
        "NCCL_NSOCKS_PERTHREAD", "NCCL_NTHREADS", "NCCL_NVB_DISABLE", "NCCL_NVLS_ENABLE",
        "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_P2P_NET_CHUNKSIZE", "NCCL_PROTO",
        "NCCL_RAS_ENABLE", "NCCL_SET_STACK_SIZE", "NCCL_SHM_DISABLE", "NCCL_SOCKET_FAMILY",
        "NCCL_SOCKET_IFNAME", "NCCL_SOCKET_NTHREADS", "NCCL_TOPO_DUMP_FILE", "NCCL_TOPO_FILE",
        "NCCL_TUNER_PLUGIN",
    }
)

DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")
# Interface lists as NCCL reads them: optional ^ (exclude) or = (exact), comma-separated names.
_IFNAME = re.compile(r"^[\^=]?[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*$")
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9_.,:=^/+-]*$")


@dataclass
class NcclSettings:
    """NCCL knobs for multi-GPU jobs; unset fields leave NCCL's own defaults alone."""

    preset: str = "default"
    """Name of the preset these values came from (informational)."""
    debug: Optional[str] = None
    """NCCL_DEBUG: VERSION, WARN, INFO or TRACE."""
    debug_subsys: Optional[str] = None
    """NCCL_DEBUG_SUBSYS, e.g. INIT,NET."""
    socket_ifname: Optional[str] = None
    """NCCL_SOCKET_IFNAME: interfaces for bootstrap and socket transport, e.g. eth0 or ^lo,docker0."""
    ib_disable: Optional[bool] = None
    """NCCL_IB_DISABLE: true forces sockets even where InfiniBand exists."""
    ib_hca: Optional[str] = None
    """NCCL_IB_HCA: which InfiniBand adapters to use, e.g. mlx5_0,mlx5_1."""
    p2p_disable: Optional[bool] = None
    """NCCL_P2P_DISABLE: true disables peer-to-peer between GPUs (for broken PCIe topologies)."""
    async_error_handling: bool = True
    """TORCH_NCCL_ASYNC_ERROR_HANDLING: a failed collective aborts the job instead of hanging it."""
    extra: dict[str, str] = field(default_factory=dict)
    """Other NCCL_* variables; only names NCCL documents are accepted."""

    def __post_init__(self) -> None:
        if self.debug is not None and self.debug.upper() not in DEBUG_LEVELS:
            raise ConfigError("debug", self.debug, f"one of {', '.join(DEBUG_LEVELS)}")
        if self.socket_ifname is not None and not _IFNAME.match(self.socket_ifname):
            raise ConfigError("socket_ifname", self.socket_ifname, "interface names like eth0, ib0 or ^lo,docker0")
        for name, value in (("debug_subsys", self.debug_subsys), ("ib_hca", self.ib_hca)):
            if value is not None and not _SAFE_VALUE.match(value):
                raise ConfigError(name, value, "letters, digits and _.,:=^/+-")
        for key, value in self.extra.items():
            if key not in KNOWN_NCCL_VARS:
                raise ConfigError(f"extra.{key}", value, f"NCCL variables: {', '.join(sorted(KNOWN_NCCL_VARS))}")
            if not _SAFE_VALUE.match(str(value)):
                raise ConfigError(f"extra.{key}", value, "letters, digits and _.,:=^/+-")

    def to_env(self) -> dict[str, str]:
        """The environment variables these settings mean, ready for `os.environ.update`."""
        env = {f"{key}": str(value) for key, value in self.extra.items()}
        named = {
            "NCCL_DEBUG": self.debug.upper() if self.debug else None,
            "NCCL_DEBUG_SUBSYS": self.debug_subsys,
            "NCCL_SOCKET_IFNAME": self.socket_ifname,
            "NCCL_IB_DISABLE": _flag(self.ib_disable),
            "NCCL_IB_HCA": self.ib_hca,
            "NCCL_P2P_DISABLE": _flag(self.p2p_disable),
        }
        env.update({key: value for key, value in named.items() if value is not None})
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1" if self.async_error_handling else "0"
        return env


def _flag(value: Optional[bool]) -> Optional[str]:
    return None if value is None else str(int(value))

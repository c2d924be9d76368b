"""Typed NCCL settings and the environment they become on every rank (torch-free)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from gpujobs.base.errors import ConfigError
from gpujobs.config.modes import NcclDebug, NcclPreset
from gpujobs.config.validate import Checked, bounds

#: Set to 1 to run the ranks' group on gloo alone even on CUDA (`bench/gpu_check.py` sets it), so that more
#: ranks than GPUs can share them: NCCL refuses two ranks on a GPU, gloo takes CUDA tensors for DDP's
#: all-reduce and broadcast. A check-only knob, not config: gloo moves gradients through the host, far slower.
GLOO_ON_CUDA_ENV = "GPUJOBS_CHECK_GLOO_ON_CUDA"

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

#: Variables NCCL reads as on/off (0 or 1), and those that also take 2 (auto, or "both" for CROSS_NIC).
#: NCCL parses them as integers, so the `True` a bare `=true` override turns into would read as 0: the
#: opposite of what was asked. They take 0/1 (or 2), and true/false, yes/no, on/off become 1/0.
FLAG_NCCL_VARS: frozenset[str] = frozenset(
    {
        "NCCL_CHECKS_DISABLE", "NCCL_CHECK_POINTERS", "NCCL_COLLNET_ENABLE", "NCCL_COMM_BLOCKING",
        "NCCL_CUMEM_ENABLE", "NCCL_DMABUF_ENABLE", "NCCL_IB_ADAPTIVE_ROUTING", "NCCL_IB_CUDA_SUPPORT",
        "NCCL_IB_DISABLE", "NCCL_IB_SPLIT_DATA_ON_QPS", "NCCL_IB_USE_INLINE", "NCCL_IGNORE_CPU_AFFINITY",
        "NCCL_NET_GDR_READ", "NCCL_NVB_DISABLE", "NCCL_P2P_DISABLE", "NCCL_RAS_ENABLE", "NCCL_SET_STACK_SIZE",
        "NCCL_SHM_DISABLE",
    }
)
TRISTATE_NCCL_VARS: frozenset[str] = frozenset(
    {"NCCL_CROSS_NIC", "NCCL_IB_PCI_RELAXED_ORDERING", "NCCL_MNNVL_ENABLE", "NCCL_NVLS_ENABLE"}
)
#: Variables naming a file NCCL *writes*: every rank fopen()s it for writing, following symlinks, so a path
#: in a shared place (/tmp) is one another user can plant a link at. They take a bare file name, and each
#: rank gets it as RUN_DIR/nccl/<name> (`NcclSettings.to_env`). NCCL_GRAPH_FILE and NCCL_TOPO_FILE are
#: only read: they keep taking a path.
#: The run dir's folder of the files NCCL writes (part of the run dir's layout, `gpujobs.rundir`).
NCCL_DIR = "nccl"
OUTPUT_FILE_VARS: frozenset[str] = frozenset({"NCCL_DEBUG_FILE", "NCCL_GRAPH_DUMP_FILE", "NCCL_TOPO_DUMP_FILE"})
#: Buffer sizes in bytes: NCCL reads each as a signed 64-bit integer and sizes its buffers by it (only its
#: own -2 means "unset"), so a value <= 0 is no buffer at all. They take a positive count of bytes.
BYTES_NCCL_VARS: frozenset[str] = frozenset({"NCCL_BUFFSIZE", "NCCL_LL_BUFFSIZE", "NCCL_LL128_BUFFSIZE"})
_MAX_BYTES = 2**63 - 1
_DIGITS = re.compile(r"[0-9]+")
_TRUTH = {"1": "1", "true": "1", "yes": "1", "on": "1", "0": "0", "false": "0", "no": "0", "off": "0"}

# Interface lists as NCCL reads them: optional ^ (exclude), then = (exact names), comma-separated names.
_IFNAME = re.compile(r"\^?=?[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*")
# Interface names as gloo reads them: exact names, comma-separated.
_GLOO_IFNAME = re.compile(r"[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*")
#: gloo's variable: the interface(s) its sockets use (else the address this node's hostname resolves to).
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
_SAFE_VALUE = re.compile(r"[A-Za-z0-9_.,:=^/+-]*")
_SAFE_TEXT = "letters, digits and _.,:=^/+-"
# NCCL puts the host for %h and the pid for %p into NCCL_DEBUG_FILE: one file per rank
_FILE_NAME = re.compile(r"(?:[A-Za-z0-9_.+-]|%[hp])+")
_FILE_NAME_TEXT = f"a file name (letters, digits and _.+-; %h host, %p pid), placed in RUN_DIR/{NCCL_DIR}/"
#: The variable each typed field sets; the same variable in `extra` as well is refused.
TYPED_VARS = {
    "debug": "NCCL_DEBUG",
    "debug_subsys": "NCCL_DEBUG_SUBSYS",
    "socket_ifname": "NCCL_SOCKET_IFNAME",
    "ib_disable": "NCCL_IB_DISABLE",
    "ib_hca": "NCCL_IB_HCA",
    "p2p_disable": "NCCL_P2P_DISABLE",
}


@dataclass
class NcclSettings(Checked):
    """NCCL knobs for multi-GPU jobs; unset fields leave NCCL's own defaults alone."""

    preset: NcclPreset = NcclPreset.default
    """Name of the preset these values came from (informational): default | ethernet | infiniband | debug."""
    debug: Optional[NcclDebug] = None
    """NCCL_DEBUG: VERSION, WARN, INFO or TRACE (in any case)."""
    debug_subsys: Optional[str] = field(default=None, metadata=bounds(pattern=_SAFE_VALUE, allowed=_SAFE_TEXT))
    """NCCL_DEBUG_SUBSYS, e.g. INIT,NET."""
    socket_ifname: Optional[str] = field(
        default=None, metadata=bounds(pattern=_IFNAME, allowed="interface names like eth0, ib0 or ^lo,docker0")
    )
    """NCCL_SOCKET_IFNAME: interfaces for bootstrap and socket transport, e.g. eth0 or ^lo,docker0."""
    gloo_socket_ifname: Optional[str] = field(
        default=None, metadata=bounds(pattern=_GLOO_IFNAME, allowed="interface names like eth0 or eth0,eth1")
    )
    """GLOO_SOCKET_IFNAME, on every rank: the interface gloo uses. On GPUs the group is cpu:gloo,cuda:nccl and
    gloo carries the first collective, the stop votes, checkpoint agreement and eval sums; without it gloo
    uses the address the node's hostname resolves to, 127.0.1.1 on Debian and Ubuntu by default, where ranks
    of two nodes never meet. null: the first interface of the node that socket_ifname names (`gloo_ifname`)."""
    ib_disable: Optional[bool] = None
    """NCCL_IB_DISABLE: true forces sockets even where InfiniBand exists."""
    ib_hca: Optional[str] = field(default=None, metadata=bounds(pattern=_SAFE_VALUE, allowed=_SAFE_TEXT))
    """NCCL_IB_HCA: which InfiniBand adapters to use, e.g. mlx5_0,mlx5_1."""
    p2p_disable: Optional[bool] = None
    """NCCL_P2P_DISABLE: true disables peer-to-peer between GPUs (for broken PCIe topologies)."""
    async_error_handling: bool = True
    """TORCH_NCCL_ASYNC_ERROR_HANDLING: a failed collective aborts the job instead of hanging it."""
    flight_recorder_entries: int = field(default=2000, metadata=bounds(ge=0, le=10**6))
    """TORCH_NCCL_TRACE_BUFFER_SIZE: collectives PyTorch's NCCL flight recorder keeps per rank, dumped into
    RUN_DIR/hangs/<attempt>/ when the hang watchdog fires (0: no recorder)."""
    extra: dict[str, str] = field(default_factory=dict)
    """Other NCCL_* variables; only names NCCL documents are accepted, on/off ones as 0/1 (true/false ok),
    and none that a typed field above sets. The files NCCL writes (NCCL_DEBUG_FILE, NCCL_GRAPH_DUMP_FILE,
    NCCL_TOPO_DUMP_FILE) take a bare name, placed in RUN_DIR/nccl/ on every rank."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, value in self.extra.items():
            if key not in KNOWN_NCCL_VARS:
                raise ConfigError(f"extra.{key}", value, f"NCCL variables: {', '.join(sorted(KNOWN_NCCL_VARS))}")
            typed = next((name for name, var in TYPED_VARS.items() if var == key), None)
            if typed is not None and getattr(self, typed) is not None:
                raise ConfigError(
                    f"extra.{key}", value,
                    f"no value while nccl.{typed}={getattr(self, typed)!r} sets {key} too: set only one of "
                    f"nccl.{typed} and nccl.extra.{key}",
                )
        self.extra = {key: _extra_value(key, value) for key, value in self.extra.items()}

    def to_env(self, run_dir: Optional[Path] = None) -> dict[str, str]:
        """The environment variables these settings mean, ready for `os.environ.update`.

        The files NCCL writes are RUN_DIR/nccl/<name> for the ranks of `run_dir`. Without a run dir
        they are left out: the submit side's sbatch script serves every point of a sweep (and a rerun
        dir) alike, so only a rank knows its run dir; `gpujobs.rundir.nccl.export_nccl_env` sets them there.
        """
        env = {key: value for key, value in self.extra.items() if key not in OUTPUT_FILE_VARS}
        if run_dir is not None:
            env.update(self.output_files(run_dir))
        named = {
            "debug": self.debug.value if self.debug else None,
            "debug_subsys": self.debug_subsys,
            "socket_ifname": self.socket_ifname,
            "ib_disable": _flag(self.ib_disable),
            "ib_hca": self.ib_hca,
            "p2p_disable": _flag(self.p2p_disable),
        }
        env.update({TYPED_VARS[key]: value for key, value in named.items() if value is not None})
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1" if self.async_error_handling else "0"
        return env

    def gloo_ifname(self, interfaces: list[str]) -> Optional[str]:
        """GLOO_SOCKET_IFNAME on a node of `interfaces` (in the kernel's order): `gloo_socket_ifname` where set,
        else the first interface that `socket_ifname` lets NCCL use, read as NCCL reads it (names are prefixes,
        exact after `=`; `^` excludes; the loopback only where named), else None (gloo's own choice)."""
        if self.gloo_socket_ifname is not None:
            return self.gloo_socket_ifname
        if self.socket_ifname is None:
            return None
        spec = self.socket_ifname
        exclude = spec.startswith("^")
        spec = spec.removeprefix("^")
        exact = spec.startswith("=")
        names = spec.removeprefix("=").split(",")

        def named(interface: str) -> bool:
            return interface in names if exact else any(interface.startswith(name) for name in names)

        chosen = [i for i in interfaces if named(i) != exclude and not (exclude and i == "lo")]
        return chosen[0] if chosen else None

    def output_files(self, run_dir: Path) -> dict[str, str]:
        """The files NCCL writes, as the absolute paths a rank of `run_dir` gives NCCL."""
        folder = Path(run_dir).absolute() / NCCL_DIR
        files = {}
        for key, name in self.extra.items():
            if key in OUTPUT_FILE_VARS:
                # NCCL expands % in NCCL_DEBUG_FILE (%% is one %): the run dir's own % must stay a %
                where = str(folder).replace("%", "%%") if key == "NCCL_DEBUG_FILE" else str(folder)
                files[key] = f"{where}/{name}"
        return files


def _extra_value(key: str, value: object) -> str:
    """`value` of `extra[key]` as NCCL should read it: on/off variables as 0/1 (2 where they take it)."""
    text = str(value)
    if key in FLAG_NCCL_VARS or key in TRISTATE_NCCL_VARS:
        # OmegaConf made a YAML/override `true` the string "True"
        normal = _TRUTH.get(text.strip().lower())
        if normal is None and key in TRISTATE_NCCL_VARS and text.strip() == "2":
            normal = "2"
        if normal is None:
            three = " or 2" if key in TRISTATE_NCCL_VARS else ""
            raise ConfigError(f"extra.{key}", value, f"0 or 1{three} (true/false, yes/no, on/off for 1/0)")
        return normal
    if key in BYTES_NCCL_VARS:
        if not (_DIGITS.fullmatch(text) and 0 < int(text) <= _MAX_BYTES):
            raise ConfigError(f"extra.{key}", value, f"a positive number of bytes, at most {_MAX_BYTES}")
        return str(int(text))
    if key in OUTPUT_FILE_VARS:
        # a bare name: no directory of the user's choosing, and no way out of RUN_DIR/nccl/
        if not _FILE_NAME.fullmatch(text) or text in (".", ".."):
            raise ConfigError(f"extra.{key}", value, _FILE_NAME_TEXT)
        return text
    if not _SAFE_VALUE.fullmatch(text):
        raise ConfigError(f"extra.{key}", value, _SAFE_TEXT)
    return text


def _flag(value: Optional[bool]) -> Optional[str]:
    return None if value is None else str(int(value))

"""The process group and each rank's device (the job environment itself is read in `jobenv`)."""

from __future__ import annotations

import contextlib
import datetime
import errno
import gc
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from gpujobs.attempt.evidence import nccl_debug_env
from gpujobs.backends.jobenv import DistInfo, Rendezvous, ephemeral_ports, export_torchrun_env
from gpujobs.base.errors import ConfigError, GpujobsError
from gpujobs.base.hostname import loopback_hostname
from gpujobs.base.nvml import rank_gpu_uuid
from gpujobs.config.load import JobConfig
from gpujobs.config.nccl import GLOO_IFNAME_ENV, GLOO_ON_CUDA_ENV, NcclSettings
from gpujobs.rank import collectives
from gpujobs.rundir.nccl import export_nccl_env

log = logging.getLogger(__name__)

#: How long a rank first waits for an answer on one candidate port before it looks at the next: the store
#: there may be another job's, or something that is no store at all and never answers.
PROBE_S = 5.0


class RendezvousError(GpujobsError, RuntimeError):
    """The ranks could not meet: rank 0 found every rendezvous port taken, or the others found no store."""


def device_for(info: DistInfo) -> torch.device:
    """One GPU per rank where CUDA exists (`gpu_index_for`), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", gpu_index_for(info, torch.cuda.device_count()))
    return torch.device("cpu")


def device_names(device: torch.device) -> list[str]:
    """Every rank's device model name as CUDA reports it ("cpu" for a CPU rank); collective."""
    mine = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return [str(name) for name in collectives.all_gather_objects(mine)]


def gpu_index_for(info: DistInfo, visible: int) -> int:
    """The CUDA index of this rank's GPU among the `visible` ones: its local rank where every rank of the
    node sees the node's GPUs; 0 where it sees one (Slurm binds one GPU to each task, or else ranks share
    it: `gather_ranks` tells them apart by uuid). Fewer than one per rank is refused here, before NCCL,
    which would otherwise fail with "Duplicate GPU detected" deep in DDP's setup."""
    if visible >= info.local_world_size:
        return info.local_rank
    if visible == 1:
        return 0
    raise too_few_gpus(info.node, info.local_world_size, visible, os.environ.get("CUDA_VISIBLE_DEVICES"))


def too_few_gpus(node: str, ranks: int, visible: int, listed: Optional[str], shared: str = "") -> ConfigError:
    """The one-line error of a node whose `ranks` see `visible` GPUs, fewer than one each."""
    return ConfigError(
        "resources.gpus_per_node", ranks,
        f"at most the {visible} GPU{'s' if visible != 1 else ''} visible to the ranks on {node} "
        f"(CUDA_VISIBLE_DEVICES={listed!r}): one GPU per rank{shared}",
    )


#: Set to 1 to make a one-rank job join a process group anyway (`bench/gpu_check.py` sets it, so a
#: one-GPU machine runs every collective through a real NCCL group). A check-only knob, not config.
FORCE_GROUP_ENV = "GPUJOBS_FORCE_PROCESS_GROUP"


def backend_for(cuda: bool) -> str:
    """The process group's backend: device-aware `cpu:gloo,cuda:nccl` on CUDA, `gloo` on the CPU
    (and on CUDA too where `GPUJOBS_CHECK_GLOO_ON_CUDA` is 1).

    Why device-aware rather than plain `nccl` with every tensor copied to the GPU: DDP's gradient
    buckets live on the GPU and go to NCCL either way, while the small host-side collectives (timing
    rows, the stop flag, checkpoint agreement, object gathers) hold CPU data. Gloo takes them as they
    are: no host-to-device copy and stream sync per call, no pickled objects on the GPU, and a barrier
    that needs no guess at which GPU is this rank's. The helpers in `collectives` still place tensors
    on a device the group serves, so a CUDA-only group (a user's `nccl`) works too.
    """
    return "cpu:gloo,cuda:nccl" if cuda and os.environ.get(GLOO_ON_CUDA_ENV) != "1" else "gloo"


def torch_nccl_env(job: JobConfig, run_dir: Path, pipe_dir: Optional[Path]) -> dict[str, str]:
    """PyTorch's NCCL watchdog settings, from the same config as the hang watchdog's.

    The flight recorder keeps `nccl.flight_recorder_entries` collectives and dumps them on NCCL's own
    timeout or when the hang watchdog asks (`gpujobs.attempt.evidence`), through a pipe in `pipe_dir` (the
    rank's heartbeat's, which relays the asking). NCCL's heartbeat monitor, which
    ends a process whose NCCL watchdog thread is itself stuck (an abort that hangs), waits as long as
    the collective timeout: both come after `trainer.hang_timeout_s` + 30 s (the schema checks it), so
    the hang watchdog takes its evidence first. Harmless on gloo, which reads none of them.
    """
    env = nccl_debug_env(run_dir, job.nccl.flight_recorder_entries, pipe_dir)
    env["TORCH_NCCL_ENABLE_MONITORING"] = "1"
    env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] = str(job.trainer.pg_timeout_s)
    return env


def init_process_group(
    info: DistInfo, nccl: NcclSettings, timeout_s: int, run_dir: Optional[Path] = None, always: bool = False
) -> Optional[str]:
    """Apply NCCL settings (the files NCCL writes go to `run_dir`/nccl/), then join the group
    (`backend_for`); returns the backend, or None when there is one rank, `always` is false (a sharded
    model needs a group of one too) and `GPUJOBS_FORCE_PROCESS_GROUP` is not 1 (no group at all)."""
    export_nccl_env(nccl, run_dir)  # before the group exists: NCCL reads them at init
    if info.world_size == 1 and not always and os.environ.get(FORCE_GROUP_ENV) != "1":
        return None
    export_torchrun_env(info)
    export_gloo_ifname(nccl, info)
    cuda = torch.cuda.is_available()
    backend = backend_for(cuda)
    if cuda and backend == "gloo":
        log.warning("%s=1, a check-only switch: the ranks' GPU tensors go through gloo, not NCCL", GLOO_ON_CUDA_ENV)
    if cuda:
        # the helpers and NCCL use the current device: each rank's own GPU, before the first collective
        torch.cuda.set_device(device_for(info))
    timeout = datetime.timedelta(seconds=timeout_s)
    store = None if info.rendezvous is None else rendezvous_store(info, info.rendezvous, timeout)
    dist.init_process_group(
        backend=backend,
        init_method="env://" if store is None else None,
        store=store,
        rank=info.rank,
        world_size=info.world_size,
        timeout=timeout,
    )
    return backend


def export_gloo_ifname(nccl: NcclSettings, info: DistInfo) -> Optional[str]:
    """Set GLOO_SOCKET_IFNAME on this rank as `nccl` says (`NcclSettings.gloo_ifname`, from this node's
    interfaces); where it names none, a value the environment holds is kept. Returns what gloo will use (None:
    its own choice, the hostname's address, with a warning where that is loopback and the ranks span nodes)."""
    name = nccl.gloo_ifname([interface for _, interface in socket.if_nameindex()])
    if name is not None:
        os.environ[GLOO_IFNAME_ENV] = name
        source = "nccl.gloo_socket_ifname" if nccl.gloo_socket_ifname else f"nccl.socket_ifname={nccl.socket_ifname}"
        log.info("gloo on %s's interface %s=%s (from %s)", info.node, GLOO_IFNAME_ENV, name, source)
        return name
    if nccl.socket_ifname is not None:
        log.warning("nccl.socket_ifname=%s names no interface of %s: gloo left to its own choice",
                    nccl.socket_ifname, info.node)
    if os.environ.get(GLOO_IFNAME_ENV):
        log.info("gloo on %s's interface %s=%s (from the environment)", info.node, GLOO_IFNAME_ENV,
                 os.environ[GLOO_IFNAME_ENV])
        return os.environ[GLOO_IFNAME_ENV]
    loopback = loopback_hostname()
    if loopback is not None and info.world_size > info.local_world_size:
        log.warning("%s: gloo listens there, where the ranks of other nodes cannot reach it; set "
                    "nccl.socket_ifname or nccl.gloo_socket_ifname", loopback)
    return None


def rendezvous_store(info: DistInfo, meet: Rendezvous, timeout: datetime.timedelta) -> dist.TCPStore:
    """The store the ranks meet at: rank 0 hosts it on the first of `meet.ports` it can bind, on
    `meet.listen_addr` only (torch's own server would listen on every interface whatever MASTER_ADDR
    says); the others look at each port in turn until they find a store holding `meet.key`. No rank
    waits on another's choice: rank 0 binds or fails at once, and the others give up at `timeout`."""
    if info.is_main:
        store, port = _host_store(info, meet, timeout)
    else:
        store, port = _find_store(info, meet, timeout)
    os.environ["MASTER_PORT"] = str(port)  # torchrun's variable says where the store really is
    return store


def _host_store(info: DistInfo, meet: Rendezvous, timeout: datetime.timedelta) -> tuple[dist.TCPStore, int]:
    for port in meet.ports:
        try:
            listener = _listen(meet.listen_addr, port)
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            log.warning("rendezvous port %d is taken on %s: the other ranks look at the next one too",
                        port, info.node)
            continue
        ephemeral = ephemeral_ports()
        if port in ephemeral:  # this node's ip_local_port_range is not Linux's default
            log.warning("rendezvous port %d lies in %s's ephemeral range %d-%d: a connection going out may "
                        "hold it when a later job needs it", port, info.node, ephemeral[0], ephemeral[-1])
        fd = listener.detach()  # the store's server owns the socket from here, and closes it
        try:
            store = dist.TCPStore(info.master_addr, port, info.world_size, True, timeout,
                                  wait_for_workers=False, master_listen_fd=fd)
        except BaseException:
            os.close(fd)
            raise
        store.set(meet.key, info.node)  # first: what tells the other ranks this store is this job's
        log.info("rendezvous store on %s:%d", meet.listen_addr or "*", port)
        return store, port
    raise RendezvousError(f"every rendezvous port of this job is taken on {info.node}: {list(meet.ports)}")


def _listen(addr: str, port: int) -> socket.socket:
    """A listening socket on `addr` ("" is every interface, IPv6 too where the node has it)."""
    if addr == "" and socket.has_dualstack_ipv6():
        try:
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True,
                                        backlog=socket.SOMAXCONN)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise
            # IPv6 turned off on the node while the kernel still offers it: IPv4 alone, as torch would
    return socket.create_server((addr, port), backlog=socket.SOMAXCONN)


def _find_store(info: DistInfo, meet: Rendezvous, timeout: datetime.timedelta) -> tuple[dist.TCPStore, int]:
    deadline = time.monotonic() + timeout.total_seconds()
    # A port where something listens but did not answer gets twice as long next time: it may be no store
    # (each try leaves a thread waiting there), or this job's, on a rank 0 too loaded to answer in time.
    waits = dict.fromkeys(meet.ports, PROBE_S)
    while time.monotonic() < deadline:
        for port in meet.ports:
            if not _listening(info.master_addr, port):
                continue
            wait_s = max(min(waits[port], deadline - time.monotonic()), 1.0)
            store, answered = _store_client(info.master_addr, port, wait_s)
            if not answered:
                waits[port] *= 2
            elif store is not None and _holds(store, meet.key):
                store.set_timeout(timeout)
                return store, port
        time.sleep(0.2)
    raise RendezvousError(f"no store of this job on {info.master_addr} at ports {list(meet.ports)} "
                          f"within {timeout.total_seconds():.0f} s")


def _listening(host: str, port: int) -> bool:
    """Whether something accepts connections there (torch's client would retry and log until its timeout)."""
    try:
        socket.create_connection((host, port), timeout=PROBE_S).close()
    except OSError:
        return False
    return True


def _store_client(host: str, port: int, wait_s: float) -> tuple[Optional[dist.TCPStore], bool]:
    """A client of the store at host:port (None where the connection failed), and whether whatever
    listens there answered within `wait_s`. Built in a thread: torch's client waits for the server's
    answer to its first query without a timeout, so something that listens there but is no store would
    hold this rank forever."""
    made: list[dist.TCPStore] = []

    def connect() -> None:
        # wait_for_workers=False: joining would count this rank in a store that may be another job's
        with contextlib.suppress(dist.DistError):
            made.append(dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=wait_s),
                                      wait_for_workers=False))

    thread = threading.Thread(target=connect, name=f"rendezvous-probe-{port}", daemon=True)
    thread.start()
    thread.join(wait_s)
    return (made[0] if made else None), not thread.is_alive()


def _holds(store: dist.TCPStore, key: str) -> bool:
    """Whether `key` is in the store, or comes within a second (rank 0 sets it just after it listens)."""
    for _ in range(10):
        if store.check([key]):
            return True
        time.sleep(0.1)
    return False


def destroy_process_group() -> None:
    """Leave the group if we joined one. Call after dropping every DDP wrapper (see below)."""
    if dist.is_available() and dist.is_initialized():
        # Gloo's worker threads free finished work (and its tensors) after the caller has moved on,
        # and need the GIL to do so. If the group's destructor runs while one of them still holds such
        # work, the destructor waits for the worker's lock holding the GIL the worker waits for: a
        # deadlock seen at the end of resumed runs. Collect, then block briefly without the GIL so the
        # workers go idle before the last reference goes.
        gc.collect()
        time.sleep(0.1)
        dist.destroy_process_group()


def gather_ranks(info: DistInfo, device: torch.device) -> list[dict[str, Any]]:
    """Every rank's place (node, local rank, visible GPUs, its GPU's uuid, None on the CPU), in rank
    order; one all-gather at start (objects go through gloo: before NCCL). Ranks that share a GPU are
    refused here, on every rank alike (`one_gpu_per_rank`)."""
    uuid = rank_gpu_uuid(str(torch.cuda.get_device_properties(device).uuid)) if device.type == "cuda" else None
    mine = {
        "rank": info.rank,
        "local_rank": info.local_rank,
        "node": info.node,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "gpu_uuid": uuid,
    }
    ranks = collectives.all_gather_objects(mine)
    if os.environ.get(GLOO_ON_CUDA_ENV) != "1":  # the check-only switch puts ranks on one GPU on purpose
        one_gpu_per_rank(ranks)
    return ranks


def one_gpu_per_rank(ranks: list[dict[str, Any]]) -> None:
    """Refuse (`too_few_gpus`) where two ranks of a node report one GPU's uuid (`gather_ranks`)."""
    for node in sorted({entry["node"] for entry in ranks}):
        on_node = [entry for entry in ranks if entry["node"] == node and entry.get("gpu_uuid") is not None]
        holders: dict[str, list[int]] = {}
        for entry in on_node:
            holders.setdefault(entry["gpu_uuid"], []).append(int(entry["rank"]))
        shared = {uuid: held for uuid, held in holders.items() if len(held) > 1}
        if shared:
            uuid, held = next(iter(shared.items()))
            said = f"; ranks {', '.join(map(str, held))} all got {uuid}"
            raise too_few_gpus(node, len(on_node), len(holders), on_node[0]["cuda_visible_devices"], said)

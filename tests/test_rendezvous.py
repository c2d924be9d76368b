"""Where the ranks meet: a port that no nearby job shares, outside the ephemeral range, and a store that
only this job's ranks find (a local job's on loopback; a port already taken sends rank 0 to the next one).

Real parts: the kernel's ip_local_port_range, real sockets and torch stores held by a stand-in for another
job, real 2-rank gloo groups in spawned processes, a real local job reached from a real second host (a
network namespace joined by a veth pair).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import SLOW, missing, read_result, sacct_state, slurm_job_id, submit
from jobctl import RunningJob

from gpujobs.backends import jobenv
from gpujobs.config.nccl import NcclSettings
from gpujobs.rank import distributed


def _array_ids(first: int, arrays: int, tasks: int) -> list[str]:
    return [f"{array}_{task}" for array in range(first, first + arrays) for task in range(tasks)]


@pytest.mark.parametrize("first", [1, 31001, 987_654_321])
def test_fifty_consecutive_arrays_of_a_hundred_tasks_get_distinct_ports(first: int) -> None:
    ids = _array_ids(first, 50, 100)
    assert len({jobenv.port_for_job(job_id) for job_id in ids}) == len(ids)


def test_an_array_task_and_the_plain_jobs_its_digits_spell_do_not_share_a_port() -> None:
    ports = [jobenv.port_for_job(job_id) for job_id in ("100_1", "1001", "31001")]
    assert len(set(ports)) == 3


def test_plain_jobs_that_close_apart_and_their_neighbours_arrays_do_not_share_a_port() -> None:
    """The guarantees the comment on `_ARRAY_STRIDE` states: 10 consecutive ids with arrays of up to 878
    tasks, 100 with up to 107; plain jobs (task 0) among them."""
    for arrays, tasks in ((10, 878), (100, 107)):
        ids = _array_ids(55_000, arrays, tasks)
        assert len({jobenv.port_for_job(job_id) for job_id in ids}) == len(ids), (arrays, tasks)
    plain = [str(job_id) for job_id in range(70_000, 82_763)]
    assert len({jobenv.port_for_job(job_id) for job_id in plain}) == len(plain)


def test_rendezvous_ports_lie_outside_this_machines_ephemeral_range() -> None:
    ephemeral = jobenv.ephemeral_ports()  # the real ip_local_port_range of this kernel
    firsts = [jobenv.port_for_job(job_id) for job_id in _array_ids(123_000, 50, 100)]
    assert not [port for port in firsts if port in ephemeral]
    seconds = [jobenv.rendezvous_ports(job_id)[1] for job_id in _array_ids(123_000, 50, 100)]
    assert not [port for port in seconds if port in ephemeral]
    # the retry port is no job's first choice (12763 consecutive ids give every first port there is):
    # a rank 0 that retries takes no other job's port
    assert not set(seconds) & {jobenv.port_for_job(str(job_id)) for job_id in range(12_763)}
    locals_ = {jobenv.free_port() for _ in range(20)}
    assert not [port for port in locals_ if port in ephemeral]
    # a local job's port is no Slurm job's, first or second: a local test beside a Slurm job on one node (or a
    # local job on a Slurm node) cannot take the port the Slurm job's rank 0 is about to listen on
    assert not locals_ & (set(firsts) | set(seconds) | {jobenv.port_for_job(str(job_id)) for job_id in range(12_763)})


def test_a_job_id_that_is_no_slurm_id_is_refused() -> None:
    with pytest.raises(ValueError, match="not a Slurm job id"):
        jobenv.rendezvous_ports("12_a")


# ---------------------------------------------------------------- the store: taken ports, other jobs' stores
def _rank(rank: int, ports: tuple[int, ...], out: str) -> None:
    distributed.PROBE_S = 1.0  # what the silent port costs each rank; the test's own pace, not behaviour
    meet = jobenv.Rendezvous(ports, "", "gpujobs/1234_5/0")
    info = jobenv.DistInfo(rank, rank, 2, 2, "127.0.0.1", ports[0], "vm", rendezvous=meet)
    assert distributed.init_process_group(info, NcclSettings(), 60) == "gloo"
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"sum": total.item(), "port": os.environ["MASTER_PORT"]}))
    distributed.destroy_process_group()


def test_ranks_meet_past_a_silent_port_and_another_jobs_store_touching_neither(tmp_path: Path) -> None:
    """Rank 0 finds its first port held by something that never answers, its second by another job's
    store: it hosts the store on the third. Rank 1 is held by neither and writes nothing into the other
    job's store."""
    silent = socket.create_server(("", 0))  # listens, never accepts: torch's client would wait forever
    theirs = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    theirs.set("their/own", "key")
    keys = theirs.num_keys()
    ours = jobenv.free_port()
    ports = (silent.getsockname()[1], theirs.port, ours)
    mp.spawn(_rank, args=(ports, str(tmp_path)), nprocs=2)
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert seen == [{"sum": 3.0, "port": str(ours)}] * 2
    assert theirs.num_keys() == keys
    silent.close()


def test_a_rank_0_that_finds_every_port_taken_says_which(tmp_path: Path) -> None:
    taken = socket.create_server(("", 0))
    meet = jobenv.Rendezvous((taken.getsockname()[1],), "", "gpujobs/77/0")
    info = jobenv.DistInfo(0, 0, 2, 2, "127.0.0.1", meet.ports[0], "vm", rendezvous=meet)
    said = rf"every rendezvous port .* taken on vm: \[{meet.ports[0]}\]"
    with pytest.raises(distributed.RendezvousError, match=said):
        distributed.rendezvous_store(info, meet, datetime.timedelta(seconds=5))
    taken.close()


def test_a_slurm_job_whose_first_port_is_taken_on_its_node_meets_on_the_second(
    run_dir: Path, slurm: dict[str, str]
) -> None:
    """Something that never answers holds the job's first port on this host (both of the cluster's nodes
    are this host) from just after the job is queued: rank 0 moves to the second, rank 1 finds it there."""
    proc = submit(run_dir, "+experiment=rec", "+debug=tiny", "cluster=slurm", "resources.nodes=2",
                  "resources.procs_per_node=1", env=slurm)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = slurm_job_id(proc.stdout)
    first = jobenv.port_for_job(job_id)
    squatter = socket.create_server(("", first))  # bound before the ranks have even imported torch
    try:
        assert sacct_state(job_id, slurm, timeout=240) == "COMPLETED", proc.stdout
    finally:
        squatter.close()
    assert read_result(run_dir)["world_size"] == 2
    logs = "".join(path.read_text() for path in run_dir.rglob("*_0_log.err"))
    second = jobenv.rendezvous_ports(job_id)[1]
    assert f"rendezvous port {first} is taken on node1" in logs and f"rendezvous store on *:{second}" in logs, logs


# ---------------------------------------------------------------- a local job's store, seen from another host
@pytest.fixture
def other_host() -> Iterator[tuple[str, str]]:
    """A second host on this machine: a network namespace joined to it by a veth pair. Yields the
    namespace's name and this machine's address as that host sees it. Addresses stay on this machine."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("ss") is None:
        missing("root, and iproute2's ip and ss, to make a network namespace")
    name, net = f"gjrv{os.getpid() % 100_000}", f"10.200.{os.getpid() % 250 + 1}"
    host_side, ns_side = f"{name}h", f"{name}n"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    try:
        ip("netns", "add", name)
        ip("link", "add", host_side, "type", "veth", "peer", "name", ns_side)
        ip("link", "set", ns_side, "netns", name)
        ip("addr", "add", f"{net}.1/24", "dev", host_side)
        ip("link", "set", host_side, "up")
        ip("-n", name, "addr", "add", f"{net}.2/24", "dev", ns_side)
        ip("-n", name, "link", "set", ns_side, "up")
        yield name, f"{net}.1"
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            ip("netns", "del", name)  # takes the pair with it
        with contextlib.suppress(subprocess.CalledProcessError):
            ip("link", "del", host_side)


def _connects_from(netns: str, addr: str, ports: list[int]) -> dict[int, str]:
    """port → how a connection from the namespace to addr:port went (connected, refused, ...)."""
    probe = (
        "import json, socket, sys\n"
        "seen = {}\n"
        "for port in map(int, sys.argv[2:]):\n"
        "    try:\n"
        "        socket.create_connection((sys.argv[1], port), timeout=3).close(); seen[port] = 'connected'\n"
        "    except OSError as err:\n"
        "        seen[port] = type(err).__name__\n"
        "print(json.dumps(seen))\n"
    )
    proc = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", probe, addr, *map(str, ports)],
                          capture_output=True, text=True, timeout=60, check=True)
    return {int(port): how for port, how in json.loads(proc.stdout).items()}


def _listening_ports(pids: list[int]) -> set[int]:
    """The TCP ports these processes listen on, as the kernel lists them."""
    listing = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=30, check=True).stdout
    ports = set()
    for line in listing.splitlines():
        owners = {int(pid) for pid in re.findall(r"pid=(\d+)", line)}
        if owners & set(pids):
            ports.add(int(line.split()[3].rsplit(":", 1)[1]))
    return ports


def test_a_local_jobs_store_refuses_a_client_from_another_host(tmp_path: Path, other_host: tuple[str, str]) -> None:
    netns, host_addr = other_host
    control = socket.create_server(("", 0))  # every interface: the other host does reach this machine
    assert _connects_from(netns, host_addr, [control.getsockname()[1]]) == {control.getsockname()[1]: "connected"}
    control.close()
    job = RunningJob(tmp_path / "run", *SLOW)
    job.wait_for_step(5)
    pids = job.freeze()  # the store stays up (its socket listens) while the other host tries it
    try:
        ports = _listening_ports(pids)
        reached = _connects_from(netns, host_addr, sorted(ports))
    finally:
        RunningJob.thaw(pids)
    assert ports and all(how == "ConnectionRefusedError" for how in reached.values()), reached
    assert job.wait() == 0, job.output()
    logs = "".join(path.read_text() for path in (tmp_path / "run" / "submitit").glob("*_0_log.err"))
    store = re.search(r"rendezvous store on 127\.0\.0\.1:(\d+)", logs)
    assert store and int(store.group(1)) in ports, logs  # the store was among the ports tried

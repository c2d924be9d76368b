"""GLOO_SOCKET_IFNAME on every rank (issue 39 D3): on GPUs the group is cpu:gloo,cuda:nccl and gloo carries the
first collective, the stop votes, checkpoint agreement and eval sums, so it needs the nodes' interface as NCCL
does; and the submit side's warning where this node's hostname resolves to loopback."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from conftest import compose_job, submit

from gpujobs.base.hostname import loopback_hostname
from gpujobs.config.nccl import NcclSettings
from gpujobs.launch import warn_loopback

NODE = ["lo", "ifb0", "docker0", "eth0", "eth1", "ib0"]


@pytest.mark.parametrize(("socket_ifname", "gloo"), [
    (None, None),
    ("eth1", "eth1"),
    ("eth", "eth0"),  # NCCL reads a prefix: gloo gets the first interface it names
    ("=eth1", "eth1"),
    ("^lo,docker0", "ifb0"),  # the presets' exclusion: the first other interface, never the loopback
    ("^=lo,ifb0,docker0", "eth0"),
    ("ib1", None),  # names no interface here: gloo left to itself
    ("lo", "lo"),  # the loopback where named
])
def test_gloo_gets_the_first_interface_that_nccl_socket_ifname_names(socket_ifname: str | None,
                                                                      gloo: str | None) -> None:
    assert NcclSettings(socket_ifname=socket_ifname).gloo_ifname(NODE) == gloo


def test_its_own_key_wins_and_takes_exact_names_only() -> None:
    assert NcclSettings(socket_ifname="^lo", gloo_socket_ifname="eth1,eth0").gloo_ifname(NODE) == "eth1,eth0"
    job = compose_job("nccl=ethernet", "nccl.gloo_socket_ifname=eth1")
    assert job.nccl.gloo_socket_ifname == "eth1" and "GLOO_SOCKET_IFNAME" not in job.nccl.to_env()


def test_the_variable_reaches_every_rank_and_gloo_uses_it(tmp_path: Path) -> None:
    # two real ranks: each sets it from nccl.socket_ifname before the group forms, and the group forms on it
    run = tmp_path / "run"
    done = submit(run, "+experiment=rec", "+debug=tiny", "cluster=local", "resources.procs_per_node=2",
                  "trainer.max_steps=4", "nccl.socket_ifname=lo", "trainer.progress=false")
    assert done.returncode == 0, done.stderr[-3000:]
    logs = sorted((run / "submitit").glob("*_log.err"))
    said = [line for log in logs for line in log.read_text().splitlines() if "GLOO_SOCKET_IFNAME=lo" in line]
    assert len(logs) == 2 and len(said) == 2 and all("from nccl.socket_ifname=lo" in line for line in said), said
    # an interface this node lacks: gloo, on every rank, refuses it at once (the variable is what it reads)
    bad = tmp_path / "bad"
    done = submit(bad, "+experiment=rec", "+debug=tiny", "cluster=local", "resources.procs_per_node=2",
                  "trainer.max_steps=4", "nccl.gloo_socket_ifname=nosuch9", "cluster.max_restarts=0",
                  "trainer.progress=false", timeout=180)
    assert done.returncode != 0
    errors = "".join(log.read_text() for log in (bad / "submitit").glob("*_log.err"))
    assert "nosuch9" in errors, errors[-3000:]


def test_submit_warns_where_the_hostname_resolves_to_loopback_and_ranks_span_nodes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if loopback_hostname() is None:  # this machine's /etc/hosts maps its name to a real address: Debian's stand-in
        monkeypatch.setattr(socket, "gethostbyname", lambda host: "127.0.1.1")
    assert loopback_hostname() is not None
    two_nodes = compose_job("cluster=slurm", "resources.nodes=2", "resources.gpus_per_node=1")
    warning = warn_loopback(two_nodes)
    assert warning is not None and "resolves to 127." in warning and "nccl.socket_ifname" in warning
    assert warning in capsys.readouterr().err
    assert warn_loopback(compose_job("cluster=slurm", "resources.nodes=2", "nccl=ethernet")) is None
    assert warn_loopback(compose_job("cluster=slurm", "resources.nodes=1")) is None

"""No collective gets a tensor on a device its process group's backend does not serve (issue 11).

A group made with `backend="nccl"` serves CUDA only; a CPU tensor handed to it fails with "No backend
type associated with device type cpu". There is no NCCL on this machine, but a gloo group declared
for CUDA only (`cuda:gloo`) has exactly NCCL's device coverage and fails the same way, and
`cpu:gloo,cuda:gloo` is the device-aware group gpujobs builds on GPUs (`cpu:gloo,cuda:nccl`) with
gloo standing in for NCCL. All groups here are real 2-rank gloo groups in spawned processes.

1. Statically: no module of gpujobs/ or jobs/ but `gpujobs/rank/collectives.py` calls a collective.
2. The helpers on both groups: on `cuda:gloo` each one places its tensor on CUDA (here: fails for want
   of CUDA, never with NCCL's CPU error, which a raw CPU collective gets); on the device-aware group
   each returns the right values across the ranks, on the CPU.
3. The real job (`TrainJob`, as submitit runs it) on a device-aware group, with every torch.distributed
   collective wrapped by a checker that records the tensors' device types, the group's served types
   and the calling module; it must have seen all_gather, all_reduce and barrier, all served, all
   issued from the helper module.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp
from conftest import REPO, compose_job
from torch._C._distributed_c10d import ProcessGroup

from gpujobs.attempt.local import free_port
from gpujobs.backends.jobenv import DistInfo
from gpujobs.config.nccl import NcclSettings
from gpujobs.rank import collectives, distributed
from gpujobs.rank.train import TrainJob

HELPER_MODULE = REPO / "gpujobs" / "rank" / "collectives.py"
TINY = ("+experiment=rec", "+debug=tiny", "cluster=local", "resources.procs_per_node=2")
# Every public torch.distributed function that talks to other ranks.
COLLECTIVES = frozenset({
    "all_gather", "all_gather_coalesced", "all_gather_into_tensor", "all_gather_object", "all_reduce",
    "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "irecv", "isend", "monitored_barrier", "recv",
    "recv_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list",
    "send", "send_object_list",
})
_TORCH_DIR = str(Path(torch.__file__).parent)
_NCCL_CPU_ERROR = "No backend type associated with device type cpu"
_CHECKER_FRAMES = frozenset({"checked", "barrier", "_record"})  # the checker's own frames, skipped by _caller


# ---------------------------------------------------------------- 1. static: one place calls collectives
def direct_collective_calls(source: str) -> list[str]:
    """`line: name` of every torch.distributed collective that `source` names directly (called or not):
    `dist.X` for any alias of torch.distributed (or its distributed_c10d), `torch.distributed.X`, and
    `X` imported from either module."""
    tree = ast.parse(source)
    modules = {"torch.distributed", "torch.distributed.distributed_c10d"}
    aliases: set[str] = set()  # names bound to one of `modules`
    direct: set[str] = set()  # names bound to a collective itself
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name in modules and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if f"{node.module}.{a.name}" in modules:
                    aliases.add(a.asname or a.name)
                elif node.module in modules and a.name in COLLECTIVES:
                    direct.add(a.asname or a.name)

    def dotted(expr: ast.expr) -> Optional[str]:
        if isinstance(expr, ast.Name):
            return expr.id
        if isinstance(expr, ast.Attribute):
            head = dotted(expr.value)
            return f"{head}.{expr.attr}" if head else None
        return None

    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            owner = dotted(node.value)
            if owner in aliases or owner in modules:
                found.append((node.lineno, f"{owner}.{node.attr}"))
        elif isinstance(node, ast.Name) and node.id in direct and isinstance(node.ctx, ast.Load):
            found.append((node.lineno, node.id))
    return [f"{line}: {name}" for line, name in sorted(found)]


def test_the_static_check_sees_every_spelling() -> None:
    source = (
        "import torch\nimport torch.distributed as dist\nfrom torch import distributed as d2\n"
        "from torch.distributed import all_gather as ag\nimport torch.distributed.distributed_c10d as c\n"
        "dist.all_reduce(t)\ntorch.distributed.barrier()\nd2.broadcast(t, 0)\nag([t], t)\n"
        "hook = dist.all_gather_object\nc.reduce_scatter(t, [t])\ndist.is_initialized()\n"
    )
    assert [hit.split(": ")[1] for hit in direct_collective_calls(source)] == [
        "dist.all_reduce", "torch.distributed.barrier", "d2.broadcast", "ag", "dist.all_gather_object",
        "c.reduce_scatter",
    ]


def test_only_the_helper_module_calls_collectives() -> None:
    sources = sorted(p for top in ("gpujobs", "jobs") for p in (REPO / top).rglob("*.py") if p != HELPER_MODULE)
    assert len(sources) > 20  # the walk found the packages
    offenders = {
        str(path.relative_to(REPO)): hits
        for path in sources
        if (hits := direct_collective_calls(path.read_text()))
    }
    assert offenders == {}, "collectives must go through gpujobs/rank/collectives.py"
    assert direct_collective_calls(HELPER_MODULE.read_text())  # ...which does call them


# ---------------------------------------------------------------- the runtime checker
class CollectiveChecker:
    """Wraps every public collective (in torch.distributed and in distributed_c10d, so the tensor
    collectives inside the object ones are seen too) and `ProcessGroup.barrier`, where the barrier's
    device is decided. Each call is recorded; one on a device its group does not serve, or (with
    `require_helper`) issued from anywhere but the helper module, is a violation."""

    def __init__(self, require_helper: bool = False) -> None:
        self.require_helper = require_helper
        self.calls: list[dict[str, Any]] = []
        self.violations: list[str] = []

    def install(self) -> CollectiveChecker:
        """Patch torch.distributed in this process (a spawned worker: nothing to undo)."""
        for name in sorted(COLLECTIVES):
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapper = self._wrap(name, original)
            setattr(c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapper)
        pg_barrier = ProcessGroup.barrier

        def barrier(group: ProcessGroup, *args: Any, **kwargs: Any) -> Any:
            opts = kwargs.get("opts", args[0] if args else None)
            self._record("ProcessGroup.barrier", group, [opts.device.type] if opts is not None else [])
            return pg_barrier(group, *args, **kwargs)

        ProcessGroup.barrier = barrier  # type: ignore[method-assign,assignment]
        return self

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def checked(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            devices = sorted({t.device.type for t in _tensors(list(bound.arguments.values()))})
            self._record(name, bound.arguments.get("group"), devices)
            return original(*args, **kwargs)

        return checked

    def _record(self, name: str, group: Optional[ProcessGroup], devices: list[str]) -> None:
        pg = group if group is not None else dist.group.WORLD
        served = sorted({d.type for d in pg._device_types}) if pg is not None else []
        caller = _caller()
        self.calls.append({"name": name, "devices": devices, "served": served, "caller": caller})
        if not set(devices) <= set(served):
            self.violations.append(f"{name} from {caller}: tensors on {devices}, group serves {served}")
        from_gpujobs = caller.startswith(("gpujobs/", "jobs/"))
        if self.require_helper and from_gpujobs and not caller.startswith("gpujobs/rank/collectives.py"):
            self.violations.append(f"{name} called from {caller}, not through the helper module")


def _tensors(values: list[Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(_tensors(list(value)))
    return found


def _caller() -> str:
    """`path:line` of the nearest frame outside torch and the checker (repo-relative when inside)."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        in_checker = filename == __file__ and frame.f_code.co_name in _CHECKER_FRAMES
        if not filename.startswith(_TORCH_DIR) and not in_checker:
            path = Path(filename)
            shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
            return f"{shown}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


def _join(backend: str, rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=2)


# ---------------------------------------------------------------- 2. the helpers on both kinds of group
def _helpers_worker(rank: int, ports: tuple[int, int]) -> None:
    checker = CollectiveChecker().install()

    # NCCL's coverage: CUDA only. A raw CPU collective fails exactly as it does on NCCL ...
    _join("cuda:gloo", rank, ports[0])
    assert collectives.served_device_types() == {"cuda"}
    assert collectives.collective_device_type() == "cuda"
    with pytest.raises(RuntimeError, match=_NCCL_CPU_ERROR):
        dist.all_reduce(torch.zeros(1))
    assert len(checker.violations) == 1  # the checker sees it too
    assert checker.violations[0].startswith("all_reduce from tests/test_collectives.py:")
    assert checker.violations[0].endswith("tensors on ['cpu'], group serves ['cuda']")
    # ... while each helper puts its tensor on CUDA: with no CUDA here, that is where it fails.
    helpers: dict[str, Callable[[], Any]] = {
        "any_true": lambda: collectives.any_true(True),
        "all_true": lambda: collectives.all_true(True),
        "all_gather_rows": lambda: collectives.all_gather_rows(torch.zeros(2)),
        "start_any_true": lambda: collectives.start_any_true(True),
        "start_all_gather_rows": lambda: collectives.start_all_gather_rows(torch.zeros(2)),
        "all_gather_objects": lambda: collectives.all_gather_objects({"rank": rank}),
        "barrier": collectives.barrier,
    }
    for name, helper in helpers.items():
        with pytest.raises((AssertionError, RuntimeError)) as failure:
            helper()
        message = str(failure.value)  # a CPU build: "not compiled with CUDA"; a CUDA build: "no NVIDIA driver"
        assert ("CUDA" in message or "NVIDIA driver" in message) and _NCCL_CPU_ERROR not in message, (name, message)
    dist.destroy_process_group()

    # The device-aware group gpujobs builds on GPUs: every helper works on CPU tensors.
    checker.calls.clear()
    checker.violations.clear()
    _join("cpu:gloo,cuda:gloo", rank, ports[1])
    assert collectives.served_device_types() == {"cpu", "cuda"}
    assert collectives.collective_device() == torch.device("cpu")
    assert collectives.any_true(rank == 1) is True and collectives.any_true(False) is False
    assert collectives.all_true(rank == 0) is False and collectives.all_true(True) is True
    rows = collectives.all_gather_rows(torch.tensor([float(rank), 10.0 * rank + 1]))
    assert rows.device.type == "cpu" and rows.tolist() == [[0.0, 1.0], [1.0, 11.0]]
    # started without waiting: both run at once, each answers when waited for, in any order
    vote, table = collectives.start_any_true(rank == 0), collectives.start_all_gather_rows(torch.tensor([rank + 0.5]))
    assert table.wait().tolist() == [[0.5], [1.5]] and vote.wait() is True
    assert collectives.all_gather_objects({"rank": rank}) == [{"rank": 0}, {"rank": 1}]
    collectives.barrier()
    assert checker.violations == []
    names = [call["name"] for call in checker.calls]
    # the object gather runs tensor all-gathers inside; they and the barrier stay on the CPU backend
    assert names.count("all_reduce") == 5 and "all_gather_object" in names and "ProcessGroup.barrier" in names
    assert {d for call in checker.calls for d in call["devices"]} == {"cpu"}
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA (there gpu_check.sh runs NCCL)")
def test_helpers_place_tensors_where_the_backend_serves_them() -> None:
    mp.spawn(_helpers_worker, args=((free_port(), free_port()),), nprocs=2)


def _forced_worker(rank: int, port: int) -> None:
    info = DistInfo(0, 0, 1, 1, "127.0.0.1", port, "node")
    os.environ.pop(distributed.FORCE_GROUP_ENV, None)
    assert distributed.init_process_group(info, NcclSettings(), 30) is None and not collectives.active()
    os.environ[distributed.FORCE_GROUP_ENV] = "1"
    assert distributed.init_process_group(info, NcclSettings(), 30) == "gloo" and collectives.active()
    assert collectives.all_gather_rows(torch.tensor([2.0])).tolist() == [[2.0]]
    distributed.destroy_process_group()


def test_one_rank_joins_a_group_only_when_forced() -> None:
    # what gpu_check.sh relies on to run NCCL with one GPU; on GPUs the group is device-aware
    assert distributed.backend_for(cuda=True) == "cpu:gloo,cuda:nccl"
    assert distributed.backend_for(cuda=False) == "gloo"
    mp.spawn(_forced_worker, args=(free_port(),), nprocs=1)


def test_gpu_check_shares_one_gpu_between_ranks_on_gloo_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # NCCL refuses two ranks on one GPU: gpu_check's two-rank run on a one-GPU machine needs gloo there too
    monkeypatch.setenv(distributed.GLOO_ON_CUDA_ENV, "1")
    assert distributed.backend_for(cuda=True) == "gloo"
    monkeypatch.setenv(distributed.GLOO_ON_CUDA_ENV, "0")
    assert distributed.backend_for(cuda=True) == "cpu:gloo,cuda:nccl"


# ---------------------------------------------------------------- 3. the real job on a device-aware group
def _job_worker(rank: int, job: TrainJob, out: str) -> None:
    assert job.master_port is not None
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job.master_port))
    # Fake: gloo stands in for NCCL in the group gpujobs builds on GPUs (there is no NCCL here).
    distributed.backend_for = lambda cuda: "cpu:gloo,cuda:gloo"
    checker = CollectiveChecker(require_helper=True).install()
    try:
        result = job()
    finally:
        record = {"calls": checker.calls, "violations": checker.violations}
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    assert result["status"] == "completed" and result["world_size"] == 2


def test_a_real_job_sends_every_collective_to_a_device_its_group_serves(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # the health check's probe holds the job's barrier (the eval, now every rank's, waits at none)
    job = TrainJob(compose_job(*TINY, "cluster.health_check=true"), str(run_dir), master_port=free_port())
    mp.spawn(_job_worker, args=(job, str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["violations"] == []
        calls = record["calls"]
        names = {call["name"] for call in calls}
        assert {"all_gather", "all_reduce", "barrier", "all_gather_object", "ProcessGroup.barrier"} <= names
        assert all(call["served"] == ["cpu", "cuda"] for call in calls)  # the device-aware group
        issued = [c["caller"] for c in calls if c["caller"].startswith(("gpujobs/", "jobs/"))]
        assert issued and all(c.startswith("gpujobs/rank/collectives.py:") for c in issued)
        assert any(c["name"] == "all_gather" and c["devices"] == ["cpu"] for c in calls)

"""Will the model fit: the memory plan of a job, made before anything is queued (torch-free).

`plan_job` asks the job's model config for its shape (`shape(features)`, no torch) and makes the plan for the
configured topology: under `parallel=ddp` by arithmetic (`replicated_plan`), under `parallel=torchrec` with
TorchRec's planner in a child process (`python -m gpujobs.rank.parallel.plan`: this side never imports
torch). A model that does not fit is one ConfigError line naming the key to change, the bytes needed and
the bytes there. Submit keeps the plan in the run dir (plan.json); `gpujobs plan` prints it.

Memory comes from the config where it says (`resources.gpu_mem_gib`, `resources.host_mem_gib`, else
`resources.mem_gb` for a node), else from this machine where the job runs here (NVML for its GPUs, the
machine's memory); elsewhere it is unknown: a replicated model is then not checked against it, and a
sharded one needs it (the planner sizes the shards by it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Optional

from gpujobs.backends import backend_for
from gpujobs.base.errors import ConfigError, GpujobsError
from gpujobs.config.load import JobConfig
from gpujobs.config.memory import DoesNotFit, MemoryPlan, PlanRequest, check_replicated, replicated_plan
from gpujobs.rundir.plan import model_shape, plan_request

#: How long TorchRec's planner may take (its import is most of it: ~4 s here).
PLAN_TIMEOUT_S = 120


def plan_job(job: JobConfig, cache: Optional[dict[Any, Any]] = None) -> Optional[MemoryPlan]:
    """The memory plan of `job`, or None where its model cannot describe itself; a ConfigError line when it
    does not fit. `cache`: a sweep's points of one request share one plan."""
    shape = model_shape(job)
    if shape is None:
        return None
    request = plan_request(job, shape, here=not backend_for(job).queues)  # a queued job's nodes are elsewhere
    key = ("memory plan", json.dumps(request.to_json(), sort_keys=True))
    if cache is not None and key in cache:
        cached: MemoryPlan = cache[key]
        return cached
    try:
        if request.parallel == "ddp":
            check_replicated(request)
            plan = replicated_plan(request)
        else:
            plan = sharded_plan(request)
    except DoesNotFit as err:
        raise ConfigError(err.key, err.value, err.why) from None
    if cache is not None:
        cache[key] = plan
    return plan


def sharded_plan(request: PlanRequest) -> MemoryPlan:
    """TorchRec's plan of `request`, made in a child process (DoesNotFit with its line when none fits)."""
    command = [sys.executable, "-m", "gpujobs.rank.parallel.plan"]
    try:
        done = subprocess.run(command, input=json.dumps(request.to_json()), capture_output=True, text=True,
                              timeout=PLAN_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise GpujobsError(f"TorchRec's planner did not answer within {PLAN_TIMEOUT_S} s") from None
    if done.returncode == 2:
        refusal = json.loads(done.stdout)
        raise DoesNotFit(refusal["key"], refusal["value"], refusal["why"])
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        if "No module named 'torchrec'" in done.stderr or "No module named 'fbgemm_gpu'" in done.stderr:
            raise ConfigError("parallel", "torchrec", "installed TorchRec and FBGEMM (scripts/install-torchrec.sh "
                                                      "cpu|cuda; then pip install 'gpujobs[torchrec]')")
        raise GpujobsError(f"TorchRec's planner failed: {last}")
    return MemoryPlan.from_json(json.loads(done.stdout))


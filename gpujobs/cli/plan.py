"""`gpujobs plan OVERRIDES...`: will the model fit, before anything is queued.

The config is composed and validated as `gpujobs submit` would (the same tree and overrides), then the memory
plan of its model is made for the topology it names (`resources.nodes` x `resources.gpus_per_node`, a GPU's
memory `resources.gpu_mem_gib` (NVML where the job's GPUs are this machine's), a node's `resources.host_mem_gib`):
under `parallel=torchrec` TorchRec's planner on meta tensors, with no GPU, no cluster and no data; under
`parallel=ddp` the replicated size. It prints per table where it lives and its bytes, then per rank its GPU
and host bytes. `--out FILE` keeps the plan as JSON (what submit keeps as the run dir's plan.json).

Exit codes: 0 the model fits (the plan printed); 2 refused in one line: a bad config value, or a model that
does not fit, naming the key to change with the bytes needed and available; 1 the planner itself failed.
This module never imports torch (the planner runs in a child process).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from gpujobs.base.errors import ConfigError, GpujobsError
from gpujobs.cli.prepare import EXIT_FAILED, EXIT_REFUSED, compose_job, refused

USAGE_EPILOG = """\
Overrides are Hydra's, as for `gpujobs submit`: e.g.
  gpujobs plan +experiment=dlrm_dcnv2 parallel=torchrec resources.nodes=4 resources.gpus_per_node=3 \\
      resources.gpu_mem_gib=16
"""


def parser(prog: str) -> argparse.ArgumentParser:
    """The command's arguments: Hydra overrides, and where to keep the plan."""
    args = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=USAGE_EPILOG,
        description="Compose and validate the config as `gpujobs submit` does, then make the model's memory plan "
                    "for its topology: per table its sharding and bytes, per rank its GPU and host bytes.")
    args.add_argument("--out", type=Path, help="also write the plan as JSON to this file")
    args.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="a Hydra override: key=value, group=option")
    return args


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> int:
    """Entry point of `gpujobs plan` and `python -m gpujobs.plan`; returns the exit code."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from gpujobs.config.hydra_errors import one_line

    args = parser(prog or "gpujobs plan").parse_args(sys.argv[1:] if argv is None else argv)
    try:
        from gpujobs.base.atomic import write_text_atomic
        from gpujobs.launch.memory import plan_job

        job, _ = compose_job(args.overrides)
        plan = plan_job(job)
        if plan is None:
            raise ConfigError("model", type(job.model).__name__, "a model config that describes its tables "
                              "(shape(features)), with a data config that describes its features (features())")
        print(plan.render())
        if args.out is not None:
            write_text_atomic(args.out, json.dumps(plan.to_json(), indent=2, sort_keys=True) + "\n")
        return 0
    except ConfigError as err:
        return refused(f"config error: {err}")
    except GpujobsError as err:
        return refused(str(err), EXIT_FAILED)
    except (HydraException, OmegaConfBaseException) as err:
        return refused(f"config error: {one_line(err, args.overrides)}", EXIT_REFUSED)
    except OSError as err:
        return refused(f"plan failed: {err.strerror or err}", EXIT_FAILED)

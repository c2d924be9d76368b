"""The rank's program, named by its module path: what a supervisor starts across a process boundary.

The local launcher sits below the rank layer and never imports it: submitit pickles a `RankProgram`,
and the rank imports the module it names when it runs (on Slurm, the sbatch script's srun line names
`python -m gpujobs.rank.srun` the same way).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

#: What every local or debug rank runs: it reads the run dir's config.yaml, then runs the job.
FROM_RUN_DIR = "gpujobs.rank.main:FromRunDir"


@dataclass(frozen=True)
class RankProgram:
    """`target` ("module:callable") built with `kwargs` in the rank's process, then called."""

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self) -> Any:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)(**self.kwargs)()

"""This checkout's packages importable without installing it: imported first by every bench script that
imports gpujobs (stdlib only).

A GPU node often has its own PyTorch and no `pip install -e .` of ours: a script run as `python bench/x.py`
has `bench/` as `sys.path[0]`, not the checkout, so `import gpujobs` would fail before anything ran. Importing
this module puts the checkout (and `tests/`, whose `jobctl` the GPU check shares) first on `sys.path`, and the
checkout on `PYTHONPATH` for every child process (`python -m gpujobs.submit`, the ranks it starts, the CUDA
checks), whatever their working directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def use_checkout() -> None:
    """Put the checkout on `sys.path` and `PYTHONPATH` (once: a second call changes nothing)."""
    for path in (str(REPO / "tests"), str(REPO)):
        if path not in sys.path:
            sys.path.insert(0, path)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *paths])


use_checkout()

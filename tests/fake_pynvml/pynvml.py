"""A stand-in `pynvml` for the ranks of REAL runs: put tests/fake_pynvml first on PYTHONPATH.

A rank is its own process (submitit's local executor, or a Slurm task), which a test's monkeypatch
cannot reach; this module is what `import pynvml` finds there instead. It reports the GPUs of the
JSON file that GPUJOBS_FAKE_NVML names:

    {"gpus": [{"ecc_uncorrected": 0}, {}], "nodes": {"node1": [{"ecc_uncorrected": 2}, {}]}}

`gpus` for any node, `nodes` per node: the test cluster's nodes are all this one machine, told apart
by SLURMD_NODENAME (else the host name). Each GPU is a `fake_gpus.FakeGpu` by its field names. With
GPUJOBS_FAKE_NVML unset, nvmlInit fails as it does on a machine without the NVIDIA library.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from fake_gpus import FakeGpu, namespace

_SPEC = os.environ.get("GPUJOBS_FAKE_NVML")


def _gpus(spec_path: str) -> list[FakeGpu]:
    spec = json.loads(Path(spec_path).read_text())
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    entries = spec.get("nodes", {}).get(node, spec.get("gpus", []))
    return [FakeGpu.from_json(entry) for entry in entries]


_names = namespace(_gpus(_SPEC) if _SPEC else [])
if not _SPEC:

    def _no_library() -> Any:
        raise _names["NVMLError"]("NVML Shared Library Not Found (fake pynvml: GPUJOBS_FAKE_NVML is not set)")

    _names["nvmlInit"] = _no_library
globals().update(_names)

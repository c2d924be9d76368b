"""A stand-in `pynvml` for tests: this machine has no NVIDIA GPU and no NVML, so there is nothing real to ask.

Only GPU-side facts are faked (what the driver would report); everything above it (the sampler thread,
gpu.jsonl, picking, the report, the health check) runs for real. Install with `install(monkeypatch,
gpus)`: it reaches this test's process only. For the ranks of a real run (other processes), see
tests/fake_pynvml/pynvml.py and `fake_nvml_env`.
"""

from __future__ import annotations

import json
import os
import sys
import types
from dataclasses import asdict
from pathlib import Path

import pytest
from fake_pynvml.fake_gpus import FakeGpu, namespace

__all__ = ["FAKE_PYNVML_DIR", "FakeGpu", "fake_nvml_env", "install"]

#: Put first on PYTHONPATH, it makes `import pynvml` in any process find the file-driven fake.
FAKE_PYNVML_DIR = Path(__file__).resolve().parent / "fake_pynvml"


def install(monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu]) -> types.ModuleType:
    """Put a fake `pynvml` reporting `gpus` into sys.modules for this test."""
    nv = types.ModuleType("pynvml")
    nv.__dict__.update(namespace(gpus))
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    return nv


def fake_nvml_env(
    spec_file: Path, gpus: list[FakeGpu], nodes: dict[str, list[FakeGpu]] | None = None
) -> dict[str, str]:
    """The environment that makes every process of a real run (submit side, ranks) see these GPUs:
    `gpus` on any node, `nodes[name]` on the node named so (SLURMD_NODENAME). Writes `spec_file`."""
    spec = {"gpus": [asdict(g) for g in gpus], "nodes": {n: [asdict(g) for g in gs] for n, gs in (nodes or {}).items()}}
    spec_file.write_text(json.dumps(spec))
    path = os.pathsep.join(p for p in (str(FAKE_PYNVML_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {"GPUJOBS_FAKE_NVML": str(spec_file), "PYTHONPATH": path}

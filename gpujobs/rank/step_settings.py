"""Settings of the train step that only speed decides (DDP's and the optimizer's), and the check-only knob
that flips them for a benchmark.

Each is on or off by what `bench/bench_gpu.py --setting NAME` measured on a GPU (the GPU check runs it for
every name, one row each, and fails the row where the default is the slower): a setting is kept only where
it is not slower. None changes what a step computes.
"""

from __future__ import annotations

import os

#: Check-only, not config: `GPUJOBS_CHECK_STEP_SETTINGS=gradient_as_bucket_view=0,static_graph=1` flips the
#: named settings in this process (bench_gpu.py sets it to measure each against its default).
SETTINGS_ENV = "GPUJOBS_CHECK_STEP_SETTINGS"

DEFAULTS: dict[str, bool] = {
    # DDP's gradients as views of its all-reduce buckets: no copy into and out of the buckets each step,
    # nor the memory of a second set of gradients
    "gradient_as_bucket_view": True,
    # Adam's and AdamW's fused CUDA kernel: one launch for every parameter, its step counters on the GPU
    # (no host read of them); CUDA ranks only
    "fused_adam": True,
    # DDP's static graph (the same parameters used every step): off until a GPU shows it is not slower;
    # the rec models qualify (every table and layer is used at every step)
    "static_graph": False,
}


def step_setting(name: str) -> bool:
    """Whether setting `name` of `DEFAULTS` is on in this process (the default, unless the knob flips it)."""
    flipped = {}
    for item in filter(None, os.environ.get(SETTINGS_ENV, "").split(",")):
        key, _, value = item.partition("=")
        if key not in DEFAULTS or value not in ("0", "1"):
            raise ValueError(f"{SETTINGS_ENV}: {item!r}: NAME=0|1 with NAME one of {', '.join(DEFAULTS)}")
        flipped[key] = value == "1"
    return flipped.get(name, DEFAULTS[name])

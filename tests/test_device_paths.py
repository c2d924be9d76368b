"""What a GPU run does differently from a CPU one, checked where the CPU allows (issue 25).

Where the difference shows only on a GPU (Adam's step counters staying off it, the non-blocking copy, one
device's CUDA stream restored on a rank that sees fewer), `bench/gpu_check.sh` checks it on a real one; here
the decisions are tested, and the paths they leave to the CPU are run for real.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from gpujobs.run.precision import autocast_dtype, emulated_bf16


@pytest.mark.parametrize(
    ("amp", "capabilities", "expected"),
    [
        ("auto", [(9, 0)], torch.bfloat16),  # H100, H200
        ("auto", [(8, 0), (8, 6)], torch.bfloat16),  # A100 with an A40
        ("auto", [(7, 0)], None),  # V100: bf16 emulated
        ("auto", [(7, 5)], None),  # T4
        ("auto", [(8, 0), (7, 5)], None),  # one older GPU: the whole job in fp32, one precision for all ranks
        ("auto", [], None),  # CPU
        ("bf16", [(7, 0)], torch.bfloat16),  # asked for: honoured, with a warning
        ("bf16", [], torch.bfloat16),
        ("off", [(9, 0)], None),
    ],
)
def test_amp_auto_picks_bf16_only_where_every_gpu_computes_it_natively(
    amp: str, capabilities: list[tuple[int, int]], expected: Optional[torch.dtype]
) -> None:
    assert autocast_dtype(amp, capabilities) == expected


def test_a_precision_other_than_native_bf16_on_a_gpu_is_warned_of() -> None:
    chosen = emulated_bf16("auto", [(8, 0), (7, 0)])
    assert chosen is not None and "trainer.amp=auto trains in fp32" in chosen and "7.0" in chosen, chosen
    assert "8.0" not in chosen.split("(")[0], chosen  # names the older GPUs, not all of them
    asked = emulated_bf16("bf16", [(7, 5)])
    assert asked is not None and "emulated" in asked and "7.5" in asked, asked
    assert emulated_bf16("auto", [(9, 0)]) is None and emulated_bf16("off", [(7, 0)]) is None
    assert emulated_bf16("auto", []) is None

"""Seeds and random streams of a rank: one seed for the run, streams derived from it, states to checkpoint."""

from __future__ import annotations

import logging
import random
from typing import Any, Optional, cast

import numpy as np
import torch

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1

#: `derive_seed` stream of a rank's own random state, re-derived when a run resumes at another world size.
RANK_STREAM = 2


def derive_seed(seed: int, *stream: int) -> int:
    """A 63-bit seed for the random stream named by `stream`, derived from the user's `seed`.

    Seeding generators with `seed + epoch` would make (seed=1, epoch=0) and (seed=0, epoch=1) share a
    stream; mixing with splitmix64 keeps the streams unrelated and is stable across Python runs.
    """
    state = seed & _MASK64
    for word in (*stream, len(stream)):
        state = (state + 0x9E3779B97F4A7C15 + (word & _MASK64)) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state >> 1  # torch.Generator.manual_seed takes a signed 64-bit value


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices) from one number."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def reseed_rank(seed: int, step: int, rank: int) -> None:
    """A rank's random streams as a pure function of (seed, step, rank): what a resume at another world
    size uses, where the saved per-rank states do not map onto the new ranks."""
    seed_everything(derive_seed(seed, RANK_STREAM, step, rank))


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's random streams, in a form `torch.load(weights_only=True)` accepts: python, numpy, torch,
    and on a GPU rank the CUDA stream of its own device (`device`), tagged with the device's index."""
    _, numpy_keys, numpy_pos, *_ = cast(tuple[Any, ...], np.random.get_state(legacy=True))
    state: dict[str, Any] = {
        "python": list(random.getstate()),
        "numpy": torch.from_numpy(numpy_keys.astype(np.int64)),
        "numpy_pos": int(numpy_pos),
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        index = _cuda_index(device)
        state["cuda"] = {"device": index, "state": torch.cuda.get_rng_state(index)}
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what `rng_state` captured; the CUDA stream onto this rank's `device`, whichever index it has now."""
    if not state:
        return
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    cuda = cuda_state_for(state.get("cuda"), device)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, _cuda_index(device))


def cuda_state_for(saved: Any, device: torch.device) -> Optional[torch.Tensor]:
    """The saved CUDA stream that belongs to this rank's `device` (None: none to restore).

    The stream is the rank's, not the GPU's: a rank requeued onto another GPU, or where it sees fewer
    GPUs, continues it. Checkpoints before this format hold a list, one state per GPU the rank saw then;
    the rank's own was the one at its device's index, as restoring them all did, and one that is not
    there is logged, not guessed.
    """
    if device.type != "cuda" or saved is None:
        return None
    if isinstance(saved, dict):
        return cast(torch.Tensor, saved["state"])
    index = _cuda_index(device)
    if index < len(saved):
        return cast(torch.Tensor, saved[index])
    log.warning("the checkpoint holds the CUDA random state of %d GPU(s), none for cuda:%d: its CUDA stream "
                "continues from the run's seed", len(saved), index)
    return None


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()

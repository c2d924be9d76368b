"""DDP's gradient buckets on a resume: the same layout as the run that never stopped.

DDP reduces every gradient in one bucket on its first iteration, then rebuilds the buckets in the order the
gradients became ready, once. A run resumed from a checkpoint builds a new DDP, so its first step would reduce
with the first-iteration layout where the run that never stopped used the rebuilt one: each gradient sits at
another offset of the flat buffer, and a ring all-reduce (gloo's, NCCL's) sums more than two ranks' values in
another order. The result differs in the last bits, and a resumed run of 3 or more ranks would not end with
the digest of the straight run (2 ranks' sum has one order). One backward of a zero loss before the first
step has DDP record the ready order and rebuild on the next forward, as the straight run's step 0 did.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpujobs.rank.rng import rng_state, set_rng_state


def settle_buckets(model: torch.nn.Module, loss_of_next_batch: Callable[[], torch.Tensor],
                   device: torch.device) -> None:
    """Run one backward of `loss_of_next_batch()` times zero through DDP, leaving no trace: no gradient, the
    random streams and `model`'s buffers (BatchNorm's statistics) as they were. Collective: every rank."""
    streams = rng_state(device)
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    (loss_of_next_batch() * 0.0).backward()  # all-reduces zeros; the order DDP records is the graph's
    for param in model.parameters():
        param.grad = None
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    set_rng_state(streams, device)

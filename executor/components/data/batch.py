"""Each data-parallel rank's share of a global batch, and how many of the batch's targets the loss counts.

Every step consumes the same global batch whatever the layout: sequences
[p, p + G) of the source, where p is the data position (sequences consumed so
far) and G the global batch size. Data-parallel rank d of D takes the
contiguous block [p + d*G/D, p + (d+1)*G/D) (DistributedSampler's idea: one
global order, split by rank, no overlap); the TP and PP ranks of a replica
share its dp coordinate and so read the same block.

Targets the loss does not count (prompts, user turns) are IGNORE_INDEX, which
torch's cross_entropy skips. `counted_targets` counts the counted targets of the
whole global batch, so that each rank can scale its summed loss by that one
number (executor/train.py) without asking the others.
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index


def local_batch(source, position: int, global_batch: int, dp: int, dp_rank: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp rank's (inputs, targets) for the step starting at sequence `position`.

    Shapes (G / dp, seq_len); targets are inputs shifted by one token, IGNORE_INDEX where not counted.
    """
    local = global_batch // dp
    indices = np.arange(position + dp_rank * local, position + (dp_rank + 1) * local)
    seqs = torch.from_numpy(source.sequences(indices))
    targets = seqs[:, 1:].clone()
    mask = source.target_mask(indices)
    if mask is not None:
        targets[~torch.from_numpy(mask)] = IGNORE_INDEX
    return seqs[:, :-1].to(device, non_blocking=True), targets.to(device, non_blocking=True)


def counted_targets(source, position: int, global_batch: int) -> int:
    """How many targets of the global batch starting at `position` the loss counts (every rank gets the same)."""
    return source.counted_targets(np.arange(position, position + global_batch))

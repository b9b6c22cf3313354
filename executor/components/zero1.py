"""ZeRO-1 for DTensor parameters (TP, or FSDP2's replicate under PP): optimizer states sharded by hand.

torch's ZeroRedundancyOptimizer broadcasts parameters with c10d.broadcast_,
which DTensor has no sharding strategy for (torch 2.13), and FSDP2 has no
ZeRO-1 mode. So, as ZeroRedundancyOptimizer does for plain tensors: the
gradients are all-reduced over the data-parallel group (replicate), each
rank of that group owns whole parameters - largest first, to the rank with
the fewest elements so far (the memory model's `zero1_whole_tensors`) - and
keeps AdamW moments for those only; after its step every owner broadcasts
its parameters' local tensors to the group as one flat bucket (one
collective per owner, as ZeroRedundancyOptimizer with
parameters_as_bucket_view, instead of one per tensor).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def assign_owners(sizes: list[int], ranks: int) -> list[int]:
    """Owner rank of each tensor: largest first, to the least-loaded rank (ties: the lowest rank)."""
    load = [0] * ranks
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += sizes[i]
    return owners


class Zero1Optimizer(torch.optim.Optimizer):
    """All parameter groups for the LR scheduler; an inner optimizer (`.optim`) steps this rank's own.

    `optim` follows ZeroRedundancyOptimizer's naming so checkpoints save it the same way.
    """

    def __init__(self, groups: list[dict], optimizer_class, group, **defaults) -> None:
        super().__init__(groups, defaults)
        self.group = group
        ranks, me = dist.get_world_size(group), dist.get_rank(group)
        params = [p for g in self.param_groups for p in g["params"]]
        self.owner = dict(zip((id(p) for p in params), assign_owners([_local(p).numel() for p in params], ranks),
                              strict=True))
        self.src = [dist.get_global_rank(group, r) for r in range(ranks)]
        inner_groups = [{**{k: v for k, v in g.items() if k != "params"},
                         "params": [p for p in g["params"] if self.owner[id(p)] == me]} for g in self.param_groups]
        self.optim = optimizer_class(inner_groups, **defaults)

    @torch.no_grad()
    def step(self, closure=None):
        for outer, inner in zip(self.param_groups, self.optim.param_groups, strict=True):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        self.optim.step()
        for r, src in enumerate(self.src):  # one broadcast per owner: its parameters as one flat bucket
            tensors = [_local(p) for g in self.param_groups for p in g["params"] if self.owner[id(p)] == r]
            for dtype in sorted({t.dtype for t in tensors}, key=str):
                same = [t for t in tensors if t.dtype == dtype]
                flat = _flatten_dense_tensors(same)
                dist.broadcast(flat, src=src, group=self.group)
                torch._foreach_copy_(same, list(_unflatten_dense_tensors(flat, same)))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

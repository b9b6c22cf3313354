"""Expert parallelism: routed experts sharded over the ep group, tokens moved with all_to_all.

The ep group borrows from the data-parallel ranks (dp_shard x cp, flattened):
consecutive blocks of ep ranks form an ep group, as torchtitan splits its
dp_shard_cp axis into (dp_shard_mod_ep, ep); each holds E / ep experts,
experts [r * E/ep, (r+1) * E/ep) on ep rank r. Dispatch (one layer): the
rows, sorted by expert, are cut by owner rank; the per-expert counts are
exchanged first (a plain all_to_all, no gradient), then the rows go with an
autograd all_to_all (its backward sends the gradients back along the swapped
splits); the receiver runs its experts over the rows of every source rank
and sends the outputs back the same way.

Checkpoints: an expert weight is a plain tensor holding E / ep rows, and
every ep rank has one under the same name; DCP would take them for replicas
and keep one. `as_sharded_state` hands DCP each of them (and its optimizer
moments) as a DTensor Shard(0) over the ep group instead, so a checkpoint
holds the (E, ...) whole, resumes under another layout and exports.

Gradients: expert weights are left out of DDP / FSDP2 (ignored_params) and
reduced here after the backward: summed over the ranks holding the same
experts (dp_replicate x the expert-data-parallel ranks) and divided by the
data-parallel degree, because each expert's gradient already sums the
contributions of every token its ep group routed to it, while the loss is
the mean over all data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class ExpertGroup:
    group: object  # the ep ProcessGroup
    size: int
    local_experts: int
    mesh: object = None  # a 1-D DeviceMesh over `group`, made when a checkpoint first needs it

    @torch.no_grad()
    def split_sizes(self, counts: torch.Tensor) -> tuple[list[int], list[int], list[list[int]]]:
        """Rows this rank sends to each ep rank, rows it receives from each, and per source its local experts'.

        The per-expert counts are exchanged first (a plain all_to_all, no gradient).
        """
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        send = counts.view(self.size, self.local_experts)
        recv = received.view(self.size, self.local_experts)
        return send.sum(1).tolist(), recv.sum(1).tolist(), recv.tolist()

    def dispatch_run_combine(self, rows: torch.Tensor, counts: torch.Tensor, run) -> torch.Tensor:
        """rows sorted by global expert, counts per global expert -> the experts' outputs, same order."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        input_splits, output_splits, per_source = self.split_sizes(counts)
        got = all_to_all_single_autograd(rows, output_splits, input_splits, self.group)
        # rows arrive grouped [source rank][local expert]: run each source's groups, keep the order
        outs = [run(chunk, per_source[src]) for src, chunk in enumerate(torch.split(got, output_splits))]
        out = torch.cat(outs)
        return all_to_all_single_autograd(out, input_splits, output_splits, self.group)


def _grid(mesh, layout) -> torch.Tensor:
    """World ranks as (pp, dp_replicate, tp, expert-data-parallel, ep)."""
    t = mesh.mesh.permute(0, 1, 4, 2, 3)  # (pp, dpr, tp, dp_shard, cp)
    pp, dpr, tp = layout.pp, layout.dp_replicate, layout.tp
    return t.reshape(pp, dpr, tp, layout.dp_shard * layout.cp // layout.ep, layout.ep)


class ExpertParallel:
    """Builds the ep and expert-gradient groups (every rank, same order) and shards the MoE layers."""

    def __init__(self, mesh, layout) -> None:
        grid = _grid(mesh, layout)
        me = dist.get_rank()
        self.ep_group = self.grad_group = None
        self.ep_rank = 0
        pp, dpr, tp, edp, ep = grid.shape
        for a in range(pp):
            for c in range(tp):
                for b in range(dpr):
                    for d in range(edp):
                        ranks = grid[a, b, c, d].tolist()
                        group = dist.new_group(ranks)
                        if me in ranks:
                            self.ep_group, self.ep_rank = group, ranks.index(me)
                for e in range(ep):
                    ranks = grid[a, :, c, :, e].flatten().tolist()
                    group = dist.new_group(ranks) if len(ranks) > 1 else None
                    if me in ranks:
                        self.grad_group = group
        self.ep = ep
        self.dp_degree = layout.dp * layout.cp
        self.holders = layout.world_size // (layout.pp * ep)

    def expert_params(self, parts: list[nn.Module]) -> list[nn.Parameter]:
        """This rank's expert weights (look them up after materializing: the objects change)."""
        from executor.moe import MoE

        return [p for part in parts for m in part.modules() if isinstance(m, MoE) for p in m.expert_params()]

    def shard(self, part: nn.Module) -> list[nn.Parameter]:
        """Keep this rank's experts in every MoE layer of `part` (on meta); returns their parameters."""
        from executor.moe import MoE

        params = []
        for module in part.modules():
            if isinstance(module, MoE):
                per = module.n_experts // self.ep
                first = self.ep_rank * per
                for name in ("w1", "w2", "w3"):
                    p = getattr(module, name)
                    if p is None:
                        continue
                    local = nn.Parameter(torch.empty((per, *p.shape[1:]), device=p.device, dtype=p.dtype))
                    setattr(module, name, local)
                    params.append(local)
                # on the module, not the parameters: materializing (to_empty) makes new parameter objects
                module.expert_rows = (first, first + per)  # executor.model.init_weights slices the full value
                if self.ep > 1:
                    module.ep = ExpertGroup(self.ep_group, self.ep, per)
        return params

    @torch.no_grad()
    def reduce_grads(self, params: list[nn.Parameter]) -> None:
        """Sum expert gradients over their replicas, divide by the data-parallel degree."""
        for p in params:
            if p.grad is None:
                continue
            if self.grad_group is not None:
                dist.all_reduce(p.grad, group=self.grad_group)
            p.grad.div_(self.dp_degree)


def as_sharded_state(module: nn.Module, state: dict, prefix: str = "") -> tuple[dict, set]:
    """`state` (a model or flattened optimizer state dict of `module`) with this rank's expert rows as DTensors.

    Keys `prefix + fqn` (the weight) and `prefix + fqn + ".<moment>"` of every expert weight of an ep > 1
    MoE layer, whose values have the weight's shape, become DTensor.from_local(value, ep mesh, [Shard(0)]):
    same storage, so a DCP load into them fills the local tensors in place. Returns the state and the
    keys it changed (`.to_local()` them to hand the state back to the module).
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from executor.moe import MoE

    out, changed = dict(state), set()
    for name, m in module.named_modules():
        if not isinstance(m, MoE) or m.ep is None:
            continue
        if getattr(m.ep, "mesh", None) is None:
            device = next(iter(m.expert_params())).device.type
            m.ep.mesh = DeviceMesh.from_group(m.ep.group, device)
        for pname in ("w1", "w2", "w3"):
            param = getattr(m, pname)
            if param is None:
                continue
            fqn = f"{prefix}{name}.{pname}" if name else f"{prefix}{pname}"
            for key, value in state.items():
                if (key == fqn or key.startswith(fqn + ".")) and isinstance(value, torch.Tensor) \
                        and not isinstance(value, DTensor) and value.shape == param.shape:
                    out[key] = DTensor.from_local(value, m.ep.mesh, [Shard(0)], run_check=False)
                    changed.add(key)
    return out, changed

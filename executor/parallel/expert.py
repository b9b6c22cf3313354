"""Expert parallelism: routed experts sharded over the ep group, tokens moved with all_to_all.

Groups: the ep group borrows from the data-parallel ranks (dp_shard x cp,
flattened): consecutive blocks of ep ranks form an ep group, as torchtitan
splits its dp_shard_cp axis into (dp_shard_mod_ep, ep); each holds E / ep
experts, experts [r * E/ep, (r+1) * E/ep) on ep rank r. The ranks holding the
same experts are the experts' data-parallel group: dp_replicate x the edp =
dp_shard x cp / ep blocks (MoE layers stay replicated over tp, so each tp
rank has its own). One DeviceMesh over the world names them all
(`ExpertParallel.mesh`, dims pp, tp, ep, edp_replicate, edp_shard).

Dispatch (one layer): the per-expert counts are exchanged first (a plain
all_to_all, no gradient) and read on the host once, since all_to_all's split
sizes are host values (torchtitan syncs there too: the MoE layer's one host
sync under expert parallelism); then the rows go with an autograd all_to_all
(its backward sends the gradients back along the swapped splits); the
receiver runs its experts over every source's rows as one grouped GEMM per
projection (executor.experts: chunks (source, local expert)) and sends the
outputs back the same way.

Gradients: every data-parallel path reduces an expert's gradient over its
expert data-parallel group and divides it by the data-parallel degree (dp x
cp), not by that group's size, because each expert's gradient already sums
the contributions of every token its ep group routed to it, while the loss is
the mean over all data-parallel ranks (torchtitan's gradient divide factor).
FSDP2 units (ZeRO-2/3: sharded over edp_shard, HSDP with edp_replicate) and
FSDP2's replicate (ZeRO-0 with TP or PP) do it with that divide factor
(executor.parallel.parallelize); under DDP the experts are left out of it and
reduced here after the backward (`reduce_grads`).

Checkpoints: every ep rank holds its E / ep experts under the same name; DCP
would take them for replicas and keep one. `as_sharded_state` hands DCP each
of them (and its optimizer moments) as a DTensor of the whole (E, ...) over
(ep, edp_replicate, edp_shard): Shard(0) over ep, and over the other two
FSDP2's own placements (replicated when not sharded), so a checkpoint holds
every expert once, resumes under another layout and exports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

EXPERT_MESH_DIMS = ("pp", "tp", "ep", "edp_replicate", "edp_shard")


@dataclass
class ExpertGroup:
    group: object  # the ep ProcessGroup
    size: int
    local_experts: int
    mesh: object = None  # the 3-D (ep, edp_replicate, edp_shard) DeviceMesh checkpoints shard the experts over

    @torch.no_grad()
    def split_sizes(self, counts: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
        """(rows this rank sends to each ep rank, rows it receives from each, the received (source, local
        expert) counts on the device). The counts are exchanged first (a plain all_to_all, no gradient) and
        the split sizes read on the host in one go."""
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        recv = received.view(self.size, self.local_experts)
        sizes = torch.cat([counts.view(self.size, self.local_experts).sum(1), recv.sum(1)]).tolist()
        return sizes[:self.size], sizes[self.size:], recv

    def dispatch_run_combine(self, rows: torch.Tensor, counts: torch.Tensor, run) -> torch.Tensor:
        """rows sorted by global expert, counts per global expert -> the experts' outputs, same order.

        run(rows, chunks): the rows as they arrive, grouped [source rank][local expert], with those
        chunks' counts (ep, local experts) -> their outputs in the same order (MoE.run_experts).
        """
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        input_splits, output_splits, chunks = self.split_sizes(counts)
        got = all_to_all_single_autograd(rows, output_splits, input_splits, self.group)
        return all_to_all_single_autograd(run(got, chunks), input_splits, output_splits, self.group)


def _grid(mesh, layout) -> torch.Tensor:
    """World ranks as (pp, dp_replicate, tp, expert-data-parallel, ep)."""
    t = mesh.mesh.permute(0, 1, 4, 2, 3)  # (pp, dpr, tp, dp_shard, cp)
    pp, dpr, tp = layout.pp, layout.dp_replicate, layout.tp
    return t.reshape(pp, dpr, tp, layout.dp_shard * layout.cp // layout.ep, layout.ep)


class ExpertParallel:
    """The expert mesh (every rank, same order), the MoE layers' sharding and the experts' data parallelism."""

    def __init__(self, mesh, layout) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        grid = _grid(mesh, layout).permute(0, 2, 4, 1, 3)  # (pp, tp, ep, edp_replicate, edp_shard)
        self.mesh = DeviceMesh(mesh.device_type, grid, mesh_dim_names=EXPERT_MESH_DIMS)
        self.flat_mesh()  # its group is made here, in one order on every rank
        self.ep = layout.ep
        self.ep_group = self.mesh["ep"].get_group()
        self.ep_rank = self.mesh["ep"].get_local_rank()
        self.edp_shard = self.mesh["edp_shard"].size()
        self.dp_degree = layout.dp * layout.cp
        self.world_per_stage = layout.world_size // layout.pp
        self.sharded = False  # FSDP2 shards the experts over edp_shard (set by executor.parallel.parallelize)

    @property
    def holders(self) -> int:
        """Ranks holding the same piece of an expert weight (its norm is counted once: clip_grad_norm)."""
        return self.world_per_stage // (self.ep * (self.edp_shard if self.sharded else 1))

    def fsdp_mesh(self):
        """FSDP2's mesh for the experts: edp_shard, 2-D with edp_replicate for HSDP."""
        if self.mesh["edp_replicate"].size() > 1:
            return self.mesh["edp_replicate", "edp_shard"]
        return self.mesh["edp_shard"]

    def flat_mesh(self):
        """The experts' whole data-parallel group as one axis (FSDP2's replicate, the reduction under DDP).

        Created once and cached by DeviceMesh; asking again returns the same mesh.
        """
        return self.mesh["edp_replicate", "edp_shard"]._flatten("edp")

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
                    module.ep = ExpertGroup(self.ep_group, self.ep, per, self.mesh["ep", "edp_replicate", "edp_shard"])
        return params

    @torch.no_grad()
    def reduce_grads(self, params: list[nn.Parameter]) -> None:
        """Under DDP: sum the expert gradients over their data-parallel group, divide by the data-parallel degree.

        FSDP2's units (DTensor parameters) have reduced theirs already.
        """
        from torch.distributed.tensor import DTensor

        group = self.flat_mesh()
        for p in params:
            if p.grad is None or isinstance(p, DTensor):
                continue
            if group.size() > 1:
                dist.all_reduce(p.grad, group=group.get_group())
            p.grad.div_(self.dp_degree)


def as_sharded_state(module: nn.Module, state: dict, prefix: str = "") -> tuple[dict, dict]:
    """`state` (a model or flattened optimizer state dict of `module`) with its expert weights as whole DTensors.

    Keys `prefix + fqn` (the weight) and `prefix + fqn + ".<moment>"` of every expert weight of an ep > 1
    MoE layer, whose values have the weight's shape, become a DTensor of the whole (E, ...) over the
    (ep, edp_replicate, edp_shard) mesh (module docstring) around the same local tensor, so a DCP load into
    them fills the module's own tensors in place. Returns the state and, for the keys it changed, the values
    to hand back to the module (the original ones).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from executor.moe import MoE

    out, originals = dict(state), {}
    for name, m in module.named_modules():
        if not isinstance(m, MoE) or m.ep is None:
            continue
        for pname in ("w1", "w2", "w3"):
            param = getattr(m, pname)
            if param is None:
                continue
            fqn = f"{prefix}{name}.{pname}" if name else f"{prefix}{pname}"
            for key, value in state.items():
                if not ((key == fqn or key.startswith(fqn + ".")) and isinstance(value, torch.Tensor)
                        and value.shape == param.shape):
                    continue
                # FSDP2's placements over (edp_replicate, edp_shard), or over its flattened edp (replicate)
                inner = [Replicate(), Replicate()]
                if isinstance(value, DTensor) and value.device_mesh.ndim == 2:
                    inner = list(value.placements)
                elif isinstance(value, DTensor) and value.placements[0].is_shard():
                    inner = [Replicate(), value.placements[0]]
                local = value.to_local() if isinstance(value, DTensor) else value
                shape = (value.shape[0] * m.ep.size, *value.shape[1:])
                out[key] = DTensor.from_local(local, m.ep.mesh, [Shard(0), *inner], run_check=False, shape=shape,
                                              stride=torch.empty(shape, device="meta").stride())
                originals[key] = value
    return out, originals


def moe_units(moe, wrap, experts: ExpertParallel, expert_mesh, kwargs: dict,
              reduce_scatters: bool = False) -> None:
    """The MoE layer as two units of `wrap` (fully_shard or replicate) before its block's.

    Its router and shared experts (every data-parallel rank holds them) form one unit on the block's mesh;
    the MoE module itself is then the unit of the stacked expert weights left (their FQNs unchanged), on
    the experts' data-parallel mesh, dividing the gradients by the data-parallel degree
    (ExpertParallel). With a divide factor FSDP2 reduce-scatters with a premultiplied sum, which
    gloo lacks: on CPU ranks a unit that reduce-scatters (`reduce_scatters`: its shard group has more than
    one rank) sums and divides after. Only then: torch 2.13 divides a one-rank group's gradients by the
    factor once at the copy and again after a forced sum.
    """
    dense = moe.dense_modules()
    wrap(dense if len(dense) > 1 else dense[0], **kwargs)
    if reduce_scatters:
        kwargs = {**kwargs, "shard_placement_fn": expert_placement(expert_mesh.shape[-1])}
    unit = wrap(moe, **{**kwargs, "mesh": expert_mesh})
    unit.set_gradient_divide_factor(float(experts.dp_degree))
    if reduce_scatters and expert_mesh.device_type == "cpu":
        unit.set_force_sum_reduction_for_comms(True)


def expert_placement(shards: int):
    """FSDP2's placement of a stacked expert weight over `shards` ranks: dim 0 (the experts) as for any
    parameter, padded to a multiple of the ranks; with fewer local experts than ranks, the rows of every
    expert (dim 1) instead, as torchtitan does, so no rank holds padding in place of a share."""
    from torch.distributed.tensor import Shard

    def place(param: nn.Parameter) -> Shard:
        return Shard(1) if param.shape[0] < shards and param.shape[1] % shards == 0 else Shard(0)

    return place

"""Reserved memory: what PyTorch's CUDA caching allocator holds, beyond the tensors alive at the peak.

Two figures describe one rank of a PyTorch engine (meshplan's executor, torchtitan):

  allocated  the tensors alive at the step's largest phase (planner.memory.phases),
             what torch.cuda.max_memory_allocated reports;
  reserved   the device memory the caching allocator has mapped at its high-water
             mark, what torch.cuda.max_memory_reserved reports (torchtitan logs
             this figure: `memory_stats()["reserved_bytes.all.peak"]`).

Neither includes the CUDA context or NCCL's own buffers (cudaMalloc outside
the allocator): those stay in the fixed `other` of planner.memory.estimate.
The allocator never returns what it reserved during training (no
empty_cache), so reserved is the sum of each pool's own high-water mark, and
each of the following makes it exceed the allocated peak:

1. One pool per stream. A block freed on one CUDA stream is only reused by
   allocations on that stream. FSDP2 (torch.distributed.fsdp._fully_shard
   ._fsdp_collectives) allocates
   - the reduce-scatter output in the reduce-scatter stream; the sharded
     gradients are views into it and stay until zero_grad, so that pool holds
     every gradient shard of the rank (Gs), plus, while micro-batches
     accumulate, one unit's fresh output before it is added in;
   - the all-gather output (and its copy-in) in the all-gather copy-in
     stream; in the forward the previous unit's output is kept until the next
     unit's all-gather has been waited on (AllGatherState), so that pool
     peaks at two consecutive units gathered: D x max(embedding + first block,
     2 blocks, last block + head) for the executor's units (D x (root + block)
     for a root holding the embedding and head). FSDP2 skips the all-gather
     when the shard group has one rank (replicate).
   DDP, autocast and the single-GPU path allocate everything on the default
   stream: one pool.
   The default pool's high-water mark is the largest phase minus what lives
   in the other pools at that phase (the reduce-scatter pool's gradient shards:
   the phase's `grads` under FSDP2 and replicate, except replicate's unsharded
   sums of earlier micro-batches, kept on the default stream until reduced).
2. The loss leaves a hole (last pipeline stage, 16-bit compute). The
   forward keeps the compute-dtype logits, their fp32 copy and the fp32
   log-probabilities next to each other; the first two are freed when the
   loss returns (the logits variable is dropped before backward, as in
   torchtitan's train step). The loss backward's first fp32 gradient fills
   the fp32 copy's place, the second cannot fit in the D-byte remainder and
   is mapped above the log-probabilities: the high-water mark at the loss
   backward exceeds the allocated bytes by D per local logit.

Not modelled: holes left by a block's freed forward temporaries under the
logits (up to a block's transient), 2 MiB page rounding of expandable
segments, cuBLAS workspaces; the fixed `other` covers such slack. The
executor turns expandable segments on (executor.worker, as torchtitan's
launcher does): without them each cudaMalloc'd segment is split but never
merged across segments, and fragmentation grows beyond these terms.
"""

from __future__ import annotations

from planner.memory.params import StageParams
from planner.memory.phases import Activations, Phase, StageBytes

GRADS = 1  # index of the grads category in a Phase
AFTER_REDUCTION = ("backward_end", "optimizer_step")  # phases whose gradients are the reduced ones


def reserve_bytes(sb: StageBytes, sp: StageParams, acts: Activations, phases: dict[str, Phase]) -> int:
    """reserved - allocated for one stage's rank (module docstring): 0 for an engine without pools."""
    allocated = max(sum(p) for p in phases.values())
    if not sb.reserve_model:
        return 0
    rs_pool = sb.grads + sb.reduce_out if sb.fsdp2 else 0

    def default_pool(name: str, phase: Phase) -> float:
        in_rs = phase[GRADS] if sb.fsdp2 else 0
        if sb.accumulated_default and name not in AFTER_REDUCTION:  # replicate's no-sync sums, not yet reduced
            in_rs -= min(in_rs, sb.accumulated)
        return sum(phase) - in_rs + (acts.loss_hole if name == "backward_start" and sp.has_output else 0.0)

    default_peak = max(default_pool(name, p) for name, p in phases.items())
    return max(0, int(default_peak) + rs_pool + sb.ag_pool - allocated)

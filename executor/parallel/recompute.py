"""Activation recomputation per block: none | selective | op | full.

selective: the attention core softmax(QK^T)V only (Korthikanti et al. 2022);
op: per-op selective checkpointing with torchtitan's save list: the outputs
    of matmuls (every second one is recomputed instead), of the attention
    kernels, of reduce-scatters and of max (float8 amax) are saved, all else
    is recomputed in the backward;
full: the whole block, only its input kept.

The CPU attention kernel (_scaled_dot_product_flash_attention_for_cpu) is in
neither of torchtitan's lists (it runs on GPUs); it is saved here too so a
CPU run recomputes what a GPU run does. float8 linears (executor.components.float8)
run torch._scaled_mm instead of mm: counted and saved like mm, every second one
recomputed, so fp8 keeps what the memory model's op save list says
(planner.memory.activations.op_saved_terms). The routed experts' grouped GEMMs
(executor.experts) alternate the same way on a count of their own, so a MoE
layer keeps w1's and w2's outputs and recomputes w3's, as the memory model's
MLP of width top_k x f_e does.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn


def _save_ops() -> set:
    aten = torch.ops.aten
    ops = {aten.mm.default, aten._scaled_mm.default, aten._grouped_mm.default, aten.max.default,
           aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_cudnn_attention.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default,
           torch.ops._c10d_functional.reduce_scatter_tensor.default}
    return ops


def op_sac_context():
    """A (forward, recompute) context pair for torch.utils.checkpoint's context_fn: the op SAC policy."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = _save_ops()
    # the count each matmul alternates on: float8 linears run _scaled_mm, the experts _grouped_mm
    counter = {torch.ops.aten.mm.default: "mm", torch.ops.aten._scaled_mm.default: "mm",
               torch.ops.aten._grouped_mm.default: "grouped"}
    counts: defaultdict[tuple[str, str], int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = ("recompute" if ctx.is_recompute else "forward", counter.get(func, ""))
        if func in counter:
            counts[key] += 1
        if func in save and not (func in counter and counts[key] % 2 == 0):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_ac(part: nn.Module, recompute: str) -> None:
    """Set each block's recompute mode (the blocks apply it in their forward: no wrapper, no FQN change)."""
    for block in part.layers.values():
        block.full_recompute = recompute == "full"
        block.op_recompute = recompute == "op"
        block.attention.selective_recompute = recompute == "selective"

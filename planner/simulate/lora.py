"""What LoRA changes in a step's time: no weight gradients for the frozen base, the adapters' small GEMMs,
and data-parallel collectives and the optimizer over the adapters only.

Per layer and micro-batch of m tokens on one TP rank (planner.memory.lora
for the adapters' split), each target linear (in, out) adds two GEMMs:
  column-parallel  lora_A (m, r/t, in)  lora_B (m, out/t, r)
  row-parallel     lora_A (m, r, in/t)  lora_B (m, out, r)
run once forward, once for their input gradients and once for their weight
gradients (the same operands each time), each priced by its FLOPs or by
streaming its operands through HBM, whichever is longer (r is far below a
GEMM tile: these are memory-bound), plus the scale-and-add of lora_B's output into the base's (three
memory passes over m x out/t, or m x out for a row-parallel target, forward
and backward). The base keeps its forward and input-gradient GEMMs (the
gradient must reach the adapters of earlier layers) but drops every
weight-gradient GEMM: the zero-bubble "W" of a LoRA layer is the adapters'
alone. QLoRA dequantizes each NF4 weight to the compute dtype before each
pass that multiplies with it (bitsandbytes' and torchao's NF4 linears: read
the 4-bit codes and scales, write D bytes). The embedding's scatter-add and the output layer's weight gradient
go too. Gradients to reduce (FSDP's reduce-scatters, DDP's all-reduce) and
the optimizer's parameters are the adapters' (`trainable_layer_params`).
"""

from __future__ import annotations

from planner.layout import Layout
from planner.memory.lora import (
    COLUMN_TARGETS,
    NF4_BYTES_PER_WEIGHT,
    adapter_params_per_layer,
    dense_mlp_layers,
    stage_adapter_params,
    target_shapes,
)
from planner.memory.params import StageParams, layer_params_split
from planner.model.spec import ModelSpec
from planner.simulate.calibration import CalibrationProfile
from planner.simulate.compute import PassTimes, memory_time_s, tokens_per_micro_batch
from planner.training import TrainingSpec
from topologies.hardware import GPUSpec

ADD_PASSES = 3  # read the base's output and lora_B's, write the sum (the alpha / r scale folded into the add)


def _skinny_gemm_s(m: float, n: float, k: float, d: int, gpu: GPUSpec, peak: float, cal: CalibrationProfile) -> float:
    """An adapter GEMM: r is far below the tile size, so it is bound by streaming its operands (m x k read,
    n x k read, m x n written) unless its FLOPs take longer; the calibrated shape penalty of
    planner.simulate.compute, fitted on the blocks' wide GEMMs, would price a rank-8 GEMM like a wide one."""
    flops_s = 2.0 * m * n * k / (peak * cal.gemm_efficiency)
    return max(flops_s, memory_time_s(d * (m * k + n * k + m * n), gpu, cal))


def adapter_pass_s(model: ModelSpec, training: TrainingSpec, layout: Layout, gpu: GPUSpec, peak: float,
                   cal: CalibrationProfile) -> float:
    """One pass (forward; each of the backward's two is the same) of an average layer's adapters on one rank."""
    m, t, r, d = tokens_per_micro_batch(training.seq_len, layout), layout.tp, training.lora_rank, training.dtype_bytes
    mlp_share = dense_mlp_layers(model, model.n_layers) / model.n_layers
    total = 0.0
    for name, (n_in, n_out) in target_shapes(model).items():
        if name not in training.lora_targets:
            continue
        column = name in COLUMN_TARGETS
        a = _skinny_gemm_s(m, r / t if column else r, n_in if column else n_in / t, d, gpu, peak, cal)
        b = _skinny_gemm_s(m, n_out / t if column else n_out, r, d, gpu, peak, cal)
        add = memory_time_s(ADD_PASSES * d * m * (n_out / t if column else n_out), gpu, cal)
        total += (a + b + add) * (mlp_share if name in ("gate", "up", "down") else 1.0)
    return total


def lora_layer_times(model: ModelSpec, training: TrainingSpec, layout: Layout, gpu: GPUSpec, peak: float,
                     cal: CalibrationProfile, lt: PassTimes) -> PassTimes:
    """`lt` (planner.simulate.compute.layer_times of the full model) for a LoRA layer (module docstring)."""
    if not training.lora:
        return lt
    adapters = weight = adapter_pass_s(model, training, layout, gpu, peak, cal)
    if training.finetune == "qlora":  # each pass dequantizes the layer's NF4 weights to the compute dtype first
        dense, experts = layer_params_split(model, layout.tp, layout.ep, layout.etp)
        adapters += memory_time_s((NF4_BYTES_PER_WEIGHT + training.dtype_bytes) * (dense + experts), gpu, cal)
    redo = adapters * lt.recompute_s / lt.forward_s if lt.forward_s else 0.0
    return PassTimes(lt.forward_s + adapters, lt.backward_input_s + adapters, weight, lt.recompute_s + redo)


def frozen_end(training: TrainingSpec, times: PassTimes) -> PassTimes:
    """An end of the model (embedding, output layer) under LoRA: frozen, so no weight-gradient work."""
    return times if not training.lora else PassTimes(times.forward_s, times.backward_input_s, 0.0, times.recompute_s)


def model_flops_per_token(model: ModelSpec, training: TrainingSpec) -> float:
    """Training FLOPs per token with no recomputation: 6N + attention for full fine-tuning (ModelSpec); under
    LoRA the frozen matrices run forward and input gradient only (4N), the adapters all three (6 x theirs)."""
    full = model.model_flops_per_token(training.seq_len)
    if not training.lora:
        return full
    attention, with_mlp = adapter_params_per_layer(model, training.lora_targets, training.lora_rank, 1)
    dense = dense_mlp_layers(model, model.n_layers)
    adapters = dense * with_mlp + (model.n_layers - dense) * attention
    return full - 2.0 * model.matmul_params + 6.0 * adapters


def trainable_layer_params(model: ModelSpec, training: TrainingSpec, layout: Layout) -> tuple[int, int]:
    """(dense, routed-expert) parameters of an average layer on one TP/EP rank that have gradients."""
    if not training.lora:
        return layer_params_split(model, layout.tp, layout.ep, layout.etp)
    attention, with_mlp = adapter_params_per_layer(model, training.lora_targets, training.lora_rank, layout.tp)
    share = dense_mlp_layers(model, model.n_layers) / model.n_layers
    return round(share * with_mlp + (1 - share) * attention), 0


def trainable_stage_params(model: ModelSpec, training: TrainingSpec, layout: Layout, sp: StageParams) -> tuple[int, int]:
    """(dense, routed-expert) parameters with gradients on one rank of the stage holding `sp`."""
    if not training.lora:
        return sp.dense, sp.experts
    return stage_adapter_params(model, training, layout.tp, sp), 0

"""Precision recipes: bytes per parameter of the model states, and what 8-bit GEMMs change.

An engine's data-parallel mechanism (planner.engines.mechanisms.DataParallel)
says how parameters, gradients and the optimizer are stored; `precision_recipe`
turns that into bytes per parameter before sharding. `Fp8Recipe` says what an
engine keeps when its block GEMMs run in fp8/mxfp8: Transformer Engine's
(TE_FP8, Megatron-Core) and torchao's float8 (TORCHAO_FP8, torchtitan and
meshplan's executor).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from planner.training import DTYPE_BYTES

FP32_BYTES = DTYPE_BYTES["fp32"]
# DeepSpeed's BF16_Optimizer (its bf16 path under ZeRO 0/1, deepspeed/runtime/bf16_optimizer.py) folds
# every micro-batch's bf16 gradients into fp32 accumulators through a materialized cast (the pipeline
# engine calls update_hp_grads after every backward): cast 2 + 4, add 4 + 4 + 4 bytes per parameter
BF16_OPTIMIZER_FOLD_BYTES = 2.0 + 4.0 + 3 * 4.0


@dataclass(frozen=True)
class Recipe:
    """Bytes per parameter of one engine's precision recipe, before sharding."""

    param: int  # stored parameters (the master weights when the engine keeps fp32 parameters)
    grad: int
    optimizer: int  # master copy (when separate) + moments
    shard_params: bool  # parameter storage sharded over dp_shard
    shard_grads: bool
    shard_optimizer: bool


@dataclass(frozen=True)
class Fp8Recipe:
    """What an engine changes when its block GEMMs run in fp8/mxfp8 (TrainingSpec.precision).

    Every engine keeps the attention core, norms, embedding, output layer,
    gradients' reduction and the optimizer in the 16/32-bit recipe; only the
    linear layers of the transformer blocks cast their operands to 8 bits.
    `library` "" means the engine has no 8-bit GEMM path at that release.
    """

    library: str  # "transformer-engine" | "torchao" | ""
    weight_copy: bool  # keeps 8-bit copies of the block-linear weights between micro-batches and steps
    saves_fp8_inputs: bool  # linear layers save their 8-bit cast input for the backward (else the 16-bit one)
    fp8_all_gather: bool  # FSDP all-gathers block-linear weights in 8 bits (1 byte, not the dtype's)
    # the 8-bit copies can be the parameters themselves (TrainingSpec.fp8_params: Transformer Engine's
    # quantized_model_init under Megatron-Core's --fp8-param-gather), with no 16-bit weights beside them
    primary_weights: bool = False

    def weight_bytes(self, precision: str, any_layout: bool) -> float:
        """Bytes of 8-bit weight data per block-linear parameter (0 without copies).

        A row-wise copy for the forward GEMM (1 B; MXFP8 adds an E8M0 scale per
        32 elements) and, where the backward's GEMMs need the other layout, a
        column-wise one: always under MXFP8 (its scales run along the other
        axis), and for per-tensor fp8 on GPUs whose FP8 GEMMs take only the TN
        layout (Hopper: Transformer Engine's Float8Tensor keeps a transpose
        beside its data; quantizer.cpp makes none where
        nvte_is_non_tn_fp8_gemm_supported, sm_100 on).
        """
        if not self.weight_copy:
            return 0.0
        rowwise = fp8_rowwise_bytes(precision)
        return rowwise + (rowwise if precision == "mxfp8" or not any_layout else 0.0)


# Transformer Engine (megatron), read in TE 1.8 and 2.8 (module/linear.py, module/base.py
# get_weight_workspace): without 8-bit parameters the weight is cast into a workspace cached
# under the name "weight" whenever Megatron-Core passes is_first_microbatch (TELinear does unless
# disable_parameter_transpose_cache), so it lives between micro-batches and steps beside the bf16
# weight, with the usages the backward needs: the row-wise data, and a column-wise copy for the
# input-gradient GEMM on TN-only GPUs (Hopper) and always under MXFP8 (Fp8Recipe.weight_bytes).
# With --fp8-param-gather (Megatron-Bridge's fp8 and mxfp8 recipes, NeMo 2.0's
# bf16_with_fp8_mixed: TrainingSpec.fp8_params) those 8-bit tensors are the parameters: the
# distributed optimizer's parameter buffer is uint8 (param_and_grad_buffer.group_params_for_buffers),
# the fp32 master stays in the optimizer, and no bf16 weight exists; on Hopper TE keeps the
# transpose on the parameter after each all-gather (post_all_gather_processing). te.Linear saves
# its fp8-cast input for the backward (column-wise usage only: linear.py drops the row-wise data
# before saving).
TE_FP8 = Fp8Recipe("transformer-engine", weight_copy=True, saves_fp8_inputs=True, fp8_all_gather=False,
                   primary_weights=True)
# torchao float8 (torchtitan, meshplan's executor): Float8Linear casts in the forward and saves the
# high-precision input and weight, recasting in the backward (no persistent copy); with FSDP2 the
# weights are gathered in float8 (enable_fsdp_float8_all_gather, which torchtitan's float8 recipes
# turn on).
TORCHAO_FP8 = Fp8Recipe("torchao", weight_copy=False, saves_fp8_inputs=False, fp8_all_gather=True)
NO_FP8 = Fp8Recipe("", weight_copy=False, saves_fp8_inputs=False, fp8_all_gather=False)


def fp8_rowwise_bytes(precision: str) -> float:
    """Bytes per element of one 8-bit copy: 1, plus MXFP8's E8M0 scale per 32-element block."""
    return 1.0 + (1.0 / 32 if precision == "mxfp8" else 0.0)


def bf16_optimizer_runs(dtype: str, zero_stage: int) -> bool:
    """Whether DeepSpeed trains through its BF16_Optimizer: bf16 with fp32 gradient accumulation
    (its default) under ZeRO 0 or 1 (DeepSpeedEngine's optimizer choice; ZeRO 2/3 use their own)."""
    return dtype == "bf16" and zero_stage <= 1


@lru_cache(maxsize=256)
def precision_recipe(master_params: bool, grads: str, zero2_shards_params: bool, dtype_bytes: int, optimizer: str,
                     zero_stage: int, grad_bytes: int = FP32_BYTES, fp32_grad_copy: bool = False,
                     moment_bytes: int = FP32_BYTES) -> Recipe:
    """Bytes per parameter (planner.engines.mechanisms.DataParallel: master_params, grads, zero2_shards_params).

    grad_bytes: the training's grad_dtype (used where the engine keeps main gradients in it);
    fp32_grad_copy: DeepSpeed's BF16_Optimizer keeps fp32 accumulators beside the bf16 gradients;
    moment_bytes: the optimizer's moments (16-bit under Megatron's precision-aware optimizer).
    """
    moments = moment_bytes * (2 if optimizer == "adamw" else 1)  # AdamW: two moments; SGD: one momentum
    shards = dict(shard_grads=zero_stage >= 2, shard_optimizer=zero_stage >= 1,
                  shard_params=zero_stage >= (2 if zero2_shards_params else 3))
    grad = {"fp32": FP32_BYTES, "grad_dtype": grad_bytes, "dtype": dtype_bytes}[grads]
    grad += FP32_BYTES if fp32_grad_copy else 0
    if master_params:  # the fp32 parameters are the master weights
        return Recipe(FP32_BYTES, grad, moments, **shards)
    master = FP32_BYTES if dtype_bytes < FP32_BYTES else 0
    return Recipe(dtype_bytes, grad, master + moments, **shards)

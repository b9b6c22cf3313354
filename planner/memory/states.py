"""Model states of one rank: parameters, gradients and optimizer states after ZeRO and offload.

The bytes per parameter come from the engine's precision recipe
(`planner.engines.Engine.recipe`); the sharding follows the ZeRO stage over
dp_shard for dense parameters and over the expert data-parallel group for
routed experts (`StageParams.expert_shard`). The table of what each engine
keeps is in the docstring of planner.memory.estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.engines import FP32_BYTES, Engine, fp8_rowwise_bytes, get_engine
from planner.layout import Layout
from planner.memory.lora import base_bytes, stage_adapter_params
from planner.memory.params import StageParams, ceil_div, pipeline_params, zero1_rank_params
from planner.model.spec import ModelSpec
from planner.training import DTYPE_BYTES, TrainingSpec


@dataclass(frozen=True)
class ModelStates:
    """Model-state bytes on the GPU of one rank of a stage, and what offload moved to the host."""

    params: int  # parameter storage (+ buffers)
    compute_copy: int  # compute-dtype weights kept from forward to backward (module docstring)
    grads: int  # the step's gradients once the backward is done
    optimizer: int
    host: int

    @property
    def total(self) -> int:
        """params + grads + optimizer: together at the optimizer step, so never above the peak."""
        return self.params + self.grads + self.optimizer


def _compute_copy(eng: Engine, layout: Layout, sp: StageParams, d: int) -> int:
    """Compute-dtype weights kept from forward to backward by a PyTorch engine that stores fp32 parameters
    (module docstring of estimate), by its data-parallel path (Engine.dp_path)."""
    if not eng.data_parallel.master_params:
        return 0
    path = eng.dp_path(layout)
    if path == "fsdp":
        return d * sp.total if layout.zero_stage == 2 or layout.pp > 1 else 0
    if d >= FP32_BYTES:
        return 0
    if path == "replicate":
        return d * sp.total
    # autocast: full recomputation casts the blocks' weights again in the backward; the head's copy stays
    return d * sp.head if layout.recompute == "full" else d * (sp.total - sp.uncast)


def state_floor_bytes(eng: Engine, training: TrainingSpec, dense: int, experts: float | np.ndarray,
                      zero_stage: np.ndarray, shard_ranks: np.ndarray, dp_shard: np.ndarray,
                      expert_dp_shard: np.ndarray, ep: np.ndarray, offload: str = "none"
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Lower bounds of (params + optimizer, grads) of `stage_states` for a stage holding `dense` and `experts`
    parameters, for many data-parallel splits at once (arrays of ZeRO stage and group sizes), without a Layout.

    The same recipe and groups as stage_states (the executor's experts over the most ranks it may shard them
    over), each sharded term at its exact quotient (stage_states rounds
    up; ZeroRedundancyOptimizer's most loaded rank holds at least the average of `zero1_rank_params`' split);
    what stage_states adds beyond the recipe (compute copies, 8-bit copies, rope buffers) is left out, and so
    are the parameters where 8-bit primary weights replace part of them. Offloaded states and LoRA's (a frozen
    base beside trained adapters: planner.memory.lora) are not bounded (0). The search rules out data-parallel
    splits whose states cannot fit before it builds them (planner.search.families).
    """
    zero_stage = np.asarray(zero_stage)
    if offload != "none" or training.lora:
        zeros = np.zeros(zero_stage.shape)
        return zeros, zeros
    table = _recipe_table(eng, training)[zero_stage]
    shard_ranks, expert_dp_shard = np.asarray(shard_ranks), np.asarray(expert_dp_shard)
    n = np.where(zero_stage >= 1, shard_ranks, np.asarray(dp_shard))  # ZeRO's group takes in the cp ranks
    expert_shard = expert_dp_shard
    if eng.experts.executor_experts:  # the executor's E / ep experts: sharded over at most dp_shard x cp / ep
        expert_shard = np.maximum(1, shard_ranks // np.asarray(ep))
    sharded = dense / n + experts / np.asarray(expert_shard, dtype=np.float64)
    whole = np.asarray(dense + experts, dtype=np.float64)

    def term(column: int) -> np.ndarray:
        return table[:, column] * np.where(table[:, column + 3] > 0, sharded, whole)

    params = np.zeros(zero_stage.shape) if eng.fp8_primary_weights(training) else term(0)
    optimizer = term(2)
    if eng.data_parallel.zero1_whole_tensors:  # zero1_rank_params: routed experts over their own ZeRO group
        whole_tensors = dense / n + experts / np.asarray(expert_dp_shard, dtype=np.float64)
        optimizer = np.where(zero_stage == 1, table[:, 2] * whole_tensors, optimizer)
    return params + optimizer, term(1)


_RECIPE_TABLES: dict[tuple, tuple[Engine, TrainingSpec, np.ndarray]] = {}


def _recipe_table(eng: Engine, training: TrainingSpec) -> np.ndarray:
    """Per ZeRO stage 0-3: the recipe's (param, grad, optimizer bytes, shard params, grads, optimizer), cached
    on the engine's and the training's identities (checked on a hit)."""
    key = (id(eng), id(training))
    hit = _RECIPE_TABLES.get(key)
    if hit is not None and hit[0] is eng and hit[1] is training:
        return hit[2]
    recipes = [eng.recipe(training.dtype_bytes, training.optimizer, z, DTYPE_BYTES[training.grad_dtype],
                          training.dtype, DTYPE_BYTES[training.optimizer_dtype]) for z in range(4)]
    table = np.array([(r.param, r.grad, r.optimizer, r.shard_params, r.shard_grads, r.shard_optimizer)
                      for r in recipes], dtype=np.float64)
    if len(_RECIPE_TABLES) > 256:
        _RECIPE_TABLES.clear()
    _RECIPE_TABLES[key] = (eng, training, table)
    return table


def stage_states(model: ModelSpec, training: TrainingSpec, layout: Layout, sp: StageParams,
                 engine: str | Engine, fp8_any_layout: bool = True) -> ModelStates:
    """The model states of one rank of the stage holding `sp` (module docstring table).

    fp8_any_layout: the GPU's FP8 GEMMs take any operand layout (GPUSpec.fp8_any_layout); True, the
    smaller figure, where no GPU is known (the pruning lower bound).
    """
    eng = get_engine(engine)
    recipe = eng.recipe(training.dtype_bytes, training.optimizer, layout.zero_stage,
                        DTYPE_BYTES[training.grad_dtype], training.dtype, DTYPE_BYTES[training.optimizer_dtype])
    if training.lora:
        return _lora_states(model, training, layout, sp, eng, recipe)
    d, total = training.dtype_bytes, sp.total
    n = layout.shard_ranks if layout.zero_stage >= 1 else layout.dp_shard  # ZeRO's group takes in the cp ranks
    expert_shard = sp.expert_shard
    if eng.experts.executor_experts:  # meshplan's FSDP2 shards its E / ep experts over dp_shard x cp / ep, not tp
        expert_shard = layout.dp_shard * layout.cp // layout.ep if eng.dp_path(layout) == "fsdp" else 1

    def shard(bytes_per_param: int) -> int:
        return ceil_div(bytes_per_param * sp.dense, n) + ceil_div(bytes_per_param * sp.experts, expert_shard)

    params = shard(recipe.param) if recipe.shard_params else recipe.param * total
    grads = shard(recipe.grad) if recipe.shard_grads else recipe.grad * total
    if layout.zero_stage == 1 and eng.data_parallel.zero1_whole_tensors:
        optimizer = recipe.optimizer * zero1_rank_params(model, layout.tp, sp, n,
                                                         tied_vocab_parallel=eng.tensor_parallel.splits_tied_vocab)
    else:
        optimizer = shard(recipe.optimizer) if recipe.shard_optimizer else recipe.optimizer * total
    copy = _compute_copy(eng, layout, sp, d)
    if copy and training.fp8 and eng.fp8.fp8_all_gather and eng.dp_path(layout) == "fsdp" and model.moe is None:
        # the kept unsharded blocks are what FSDP2 gathered: torchao's float8 all-gather makes each linear
        # weight a Float8Tensor over the gathered 1-byte data (fsdp_post_all_gather), norms stay in D
        copy -= (d - 1) * sp.layers * max(0, sp.block - model.norms_per_layer * model.hidden)
    host = 0
    if layout.offload != "none":
        host, optimizer = optimizer, 0
        if layout.offload == "optimizer+params":
            host += params
            # what the GPU still multiplies with: the stage's compute-dtype weights below ZeRO-3
            params, copy = 0, (0 if layout.zero_stage == 3 else d * total)
            if recipe.shard_grads:
                host, grads = host + grads, 0
    # 8-bit weights kept between steps (planner.engines.Fp8Recipe.weight_bytes), for every block weight
    # this rank multiplies with: Transformer Engine's cached workspaces beside the 16-bit weights, or,
    # with 8-bit parameters (fp8_params), in their place. Unsharded parameters: the stage's blocks.
    # Sharded (ZeRO-3): a rank holds a block's weights only while that unit is gathered, and Megatron
    # FSDP drops the workspaces with them (its keep_fp8_transpose_cache, off in Megatron-Bridge's
    # recipes); its 8-bit parameters are sharded row-wise bytes (a uint8 buffer) instead of 16-bit ones.
    # The gathered unit is counted in comm_buffers
    linear = sp.block * sp.layers
    if eng.fp8_primary_weights(training) and params:  # (parameters offloaded to the host: nothing to replace)
        if recipe.shard_params:
            params -= ceil_div(int((recipe.param - fp8_rowwise_bytes(training.precision)) * linear), n)
        else:
            params += int((eng.fp8_weight_bytes(training, fp8_any_layout) - recipe.param) * linear)
    elif not recipe.shard_params:
        params += int(eng.fp8_weight_bytes(training, fp8_any_layout) * linear)
    if eng.model_code.rope_buffers and model.position == "rope":
        params += 2 * model.max_seq_len * model.head_dim * FP32_BYTES
    return ModelStates(params, copy, grads, optimizer, host)


def _lora_states(model: ModelSpec, training: TrainingSpec, layout: Layout, sp: StageParams, eng: Engine,
                 recipe) -> ModelStates:
    """A frozen base and trained adapters (planner.memory.lora): the base in the compute dtype (QLoRA: NF4),
    sharded where the recipe shards parameters; the adapters as any trained parameter. Offload moves the
    adapters' optimizer states (and the base with optimizer+params) to the host."""
    n = layout.shard_ranks if layout.zero_stage >= 1 else layout.dp_shard
    adapters = stage_adapter_params(model, training, layout.tp, sp)
    base = base_bytes(model, training, sp)
    params = ceil_div(int(base), n) if recipe.shard_params else int(base)
    params += ceil_div(recipe.param * adapters, n) if recipe.shard_params else recipe.param * adapters
    grads = ceil_div(recipe.grad * adapters, n) if recipe.shard_grads else recipe.grad * adapters
    optimizer = ceil_div(recipe.optimizer * adapters, n) if recipe.shard_optimizer else recipe.optimizer * adapters
    # FSDP keeps the gathered blocks between forward and backward under ZeRO-2 or a pipeline (_compute_copy)
    copy = _compute_copy(eng, layout, sp, training.dtype_bytes) if eng.dp_path(layout) == "fsdp" else 0
    host = 0
    if layout.offload != "none":
        host, optimizer = optimizer, 0
        if layout.offload == "optimizer+params":
            host, params = host + params, 0
            copy = 0 if layout.zero_stage == 3 else int(base)
    if eng.model_code.rope_buffers and model.position == "rope":
        params += 2 * model.max_seq_len * model.head_dim * FP32_BYTES
    return ModelStates(params, copy, grads, optimizer, host)


def model_states(model: ModelSpec, training: TrainingSpec, layout: Layout,
                 engine: str | Engine = "meshplan") -> ModelStates:
    """The model states of the pipeline stage with the most (params + grads + optimizer)."""
    distinct = {id(sp): sp for sp in pipeline_params(model, layout, engine)}  # equal stages share one object
    states = [stage_states(model, training, layout, sp, engine) for sp in distinct.values()]
    return max(states, key=lambda s: s.total)


def model_state_bytes(model: ModelSpec, training: TrainingSpec, layout: Layout,
                      engine: str | Engine = "meshplan") -> int:
    """params + grads + optimizer on the GPU of the worst stage: a lower bound of the peak to prune with."""
    return model_states(model, training, layout, engine).total

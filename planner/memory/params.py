"""Which parameters one pipeline rank holds, after TP, PP and EP (before ZeRO).

Counts, not bytes: planner.memory.estimate turns them into bytes with an engine's
precision recipe and shards them by ZeRO.

Per layer (h hidden, q = a*d, k = kv*d, f ffn, t = tp):
  split by t      attention q, k, v, o weights and the q, k, v biases
                  dense MLP matrices and the first layer's bias (f)
                  MoE shared experts (matrices and first biases)
  split by ep*t   routed experts (ModelSpec.expert_params_per_layer)
  replicated      2 norms, the row-parallel biases (attention o, MLP out: h each),
                  the MoE router (h * n_experts)
Embedding: V*h/t (vocabulary-parallel) + learned positions S*h (replicated).
Output: final norm (replicated) + V*h/t, unless tied and on the embedding's
rank (then the one copy serves both; on different ranks both hold one).
A tied matrix is split by t only where the engine does so
(`planner.engines.MemoryTraits.tied_vocab_parallel`): meshplan's executor keeps it
replicated on every TP rank, Megatron splits it like an untied one.

Chunks of pipeline rank r (n = pp * virtual_stages chunks in model order):
  1f1b / gpipe: r;  interleaved-1f1b: r, r + pp, ..., r + (v-1)*pp;
  zb-v: r and 2*pp - 1 - r (the V shape: rank 0 holds the first and last chunk).

Two per-tensor facts the phases of a step need (planner.memory.phases):
`largest`, the biggest parameter tensor on the rank (gradient clipping's
temporaries scale with it), and `zero1_rank_params`, the parameters of the
most loaded rank when ZeroRedundancyOptimizer hands out whole tensors.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

from planner.engines import get_engine
from planner.layout import Layout, balanced_layers, rank_chunks
from planner.model.spec import ModelSpec


def ceil_div(x: float, n: int) -> int:
    return -int(-x // n)


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank of a pipeline stage holds (counts)."""

    dense: int  # sharded by ZeRO over dp_shard
    experts: int  # routed experts, sharded by ZeRO over expert_shard
    expert_shard: int  # ZeRO group of the routed experts
    block: int  # one transformer block on this rank (an FSDP unit)
    root: int  # embedding + final norm + output on this rank (the stage's root FSDP unit)
    head: int  # output-layer weight on this rank (0 off the last stage)
    layers: int  # transformer layers on this rank (all its chunks)
    has_embedding: bool
    has_output: bool
    uncast: int = 0  # never multiplied, so autocast makes no copy: embedding table (unless it is the head), norms
    largest: int = 0  # the biggest parameter tensor on this rank

    @property
    def total(self) -> int:
        return self.dense + self.experts


@lru_cache(maxsize=4096)
def layer_params_split(model: ModelSpec, tp: int, ep: int) -> tuple[int, int]:
    """(dense, routed-expert) parameters of one layer on one TP/EP rank."""
    h = model.hidden
    row_bias = h if model.bias else 0
    attention = (model.attention_params - row_bias) / tp + row_bias
    replicated = 2 * model.norm_params
    experts = 0.0
    if model.moe is None:
        mlp = (model.mlp_params - row_bias) / tp + row_bias
    else:
        router = h * model.moe.n_experts
        shared = model.mlp_params - model.expert_params_per_layer - router
        shared_row_bias = model.moe.n_shared_experts * row_bias
        mlp = (shared - shared_row_bias) / tp + shared_row_bias + router
        experts = model.expert_params_per_layer / (ep * tp)
    return round(attention + mlp + replicated), round(experts)


def stage_params(model: ModelSpec, layout: Layout, rank: int, engine: str = "meshplan") -> StageParams:
    """Parameters pipeline rank `rank` holds under `layout` (layers_per_stage may be empty)."""
    return pipeline_params(model, layout, engine)[rank]


def pipeline_params(model: ModelSpec, layout: Layout, engine: str = "meshplan") -> tuple[StageParams, ...]:
    """stage_params for every pipeline rank, computed once per distinct placement."""
    return _pipeline_params(model, layout.pp, layout.virtual_stages, layout.pp_schedule, layout.layers_per_stage,
                            layout.tp, layout.ep, layout.dp_shard, layout.cp,
                            tied_vocab_parallel=get_engine(engine).memory.tied_vocab_parallel)


@lru_cache(maxsize=16384)
def _pipeline_params(model: ModelSpec, pp: int, v: int, schedule: str, lps: tuple[int, ...], tp: int, ep: int,
                     dp_shard: int, cp: int, *, tied_vocab_parallel: bool) -> tuple[StageParams, ...]:
    lps = lps or balanced_layers(model.n_layers, pp * v)
    dense_layer, expert_layer = layer_params_split(model, tp, ep)
    vocab_h = model.vocab * model.hidden
    matrix = _vocab_matrix(model, tp, tied_vocab_parallel=tied_vocab_parallel)
    positions = model.embedding_params - vocab_h
    biggest_layer_matrix = max(_layer_tensors(model, tp)[0], default=0)
    expert_shard = max(1, min(dp_shard, dp_shard * cp // ep))
    stages: list[StageParams] = []
    distinct: dict[StageParams, StageParams] = {}  # equal stages share one object: callers may key on id()
    for rank in range(pp):
        chunks = rank_chunks(schedule, pp, v, rank)
        layers = sum(lps[c] for c in chunks)
        has_embedding, has_output = 0 in chunks, len(lps) - 1 in chunks
        embedding = (matrix + positions) if has_embedding else 0
        head = matrix if has_output else 0
        shared_here = model.tie_embeddings and has_embedding  # the embedding's matrix serves as the head
        output = (model.norm_params + (0 if shared_here else head)) if has_output else 0
        table_is_head = model.tie_embeddings and has_output
        uncast = (((0 if table_is_head else matrix) + positions) if has_embedding else 0) + \
            2 * layers * model.norm_params + (model.norm_params if has_output else 0)
        largest = max(biggest_layer_matrix if layers else 0, matrix if has_embedding or has_output else 0,
                      positions if has_embedding else 0)
        sp = StageParams(layers * dense_layer + embedding + output, layers * expert_layer, expert_shard,
                         dense_layer + expert_layer, embedding + output, head, layers, has_embedding, has_output,
                         uncast, largest)
        stages.append(distinct.setdefault(sp, sp))
    return tuple(stages)


def _vocab_matrix(model: ModelSpec, tp: int, *, tied_vocab_parallel: bool) -> int:
    """The embedding (or output) matrix on one TP rank: V*h/t, or V*h for a tied one the engine keeps whole."""
    vocab_h = model.vocab * model.hidden
    return vocab_h if model.tie_embeddings and not tied_vocab_parallel else -(-vocab_h // tp)


@lru_cache(maxsize=1024)
def _layer_tensors(model: ModelSpec, tp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(matrices, 1-D tensors) of one dense layer on one TP rank, as the executor's Block holds them."""
    h, q, kv, f, t = model.hidden, model.q_dim, model.kv_dim, model.ffn_hidden, tp
    split = lambda n: -(-n // t)  # noqa: E731 - column/row split of a matrix or bias
    matrices = [split(q * h), split(kv * h), split(kv * h), split(q * h)]
    matrices += [split(f * h)] * (3 if model.mlp == "swiglu" else 2)
    vectors = [h] * (4 if model.norm == "layernorm" else 2)  # two norms: weight (+ bias)
    if model.bias:
        vectors += [split(q), split(kv), split(kv), h, split(f), h] + ([split(f)] if model.mlp == "swiglu" else [])
    return tuple(matrices), tuple(vectors)


@lru_cache(maxsize=4096)
def zero1_rank_params(model: ModelSpec, tp: int, sp: StageParams, dp_shard: int, *, tied_vocab_parallel: bool) -> int:
    """Parameters of the most loaded rank when torch's ZeroRedundancyOptimizer partitions a stage's tensors.

    It walks the parameter groups in order (matrices, which AdamW decays,
    then 1-D tensors), each sorted largest first, and gives every tensor
    whole to the rank with the fewest parameters so far. A matrix larger
    than total / dp_shard (a 128k-vocabulary embedding) sets the maximum by
    itself. MoE layers (which the executor does not build) fall back to an
    even split.
    """
    if dp_shard == 1:
        return sp.total
    if model.moe is not None:
        return -(-sp.total // dp_shard)
    layer_matrices, layer_vectors = _layer_tensors(model, tp)
    matrix = _vocab_matrix(model, tp, tied_vocab_parallel=tied_vocab_parallel)
    matrices = list(layer_matrices) * sp.layers
    vectors = list(layer_vectors) * sp.layers
    if sp.has_embedding:
        matrices.append(matrix)
        if model.position == "learned":
            matrices.append(model.max_seq_len * model.hidden)
    if sp.has_output:
        vectors += [model.hidden] * (model.norm_params // model.hidden)
        if not (model.tie_embeddings and sp.has_embedding):
            matrices.append(matrix)
    loads = [(0, rank) for rank in range(dp_shard)]
    for group in (matrices, vectors):
        for size in sorted(group, reverse=True):
            load, rank = heapq.heappop(loads)
            heapq.heappush(loads, (load + size, rank))
    return max(load for load, _ in loads)

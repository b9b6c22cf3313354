"""Which parameters one pipeline rank holds, after TP, PP and EP (before ZeRO).

Counts, not bytes: planner.memory.estimate turns them into bytes with an engine's
precision recipe and shards them by ZeRO.

Per layer (h hidden, q = a*d, k = kv*d, f ffn, t = tp):
  split by t      attention q, k, v, o weights and the q, k, v biases
                  dense MLP matrices and the first layer's bias (f)
                  MoE shared experts (matrices and first biases)
  split by ep*etp routed experts (ModelSpec.expert_params_per_layer): ep ranks
                  hold disjoint experts, etp ranks split each one (planner.layout)
  replicated      the norms, the row-parallel biases (attention o, MLP out: h each),
                  the MoE router (h * n_experts)
MoE models mix dense-MLP and MoE layers (first dense layers, interleaving): a
stage counts the MoE layers of its own chunks (`moe_layers_in`). The last
stage also holds the multi-token-prediction modules (ModelSpec.mtp_params).
Routed experts are sharded by ZeRO over the expert data-parallel group
(Layout.expert_dp_shard = dp_shard*cp*tp / (ep*etp)), never over TP: their
gradients and optimizer states follow ep x etp and EDP.
Embedding: V*h/t (vocabulary-parallel) + learned positions S*h (replicated).
Output: final norm (replicated) + V*h/t, unless tied and on the embedding's
rank (then the one copy serves both; on different ranks both hold one).
A tied matrix is split by t only where the engine does so
(`planner.engines.TensorParallel.splits_tied_vocab`): DTensor TP keeps it
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

import dataclasses
import heapq
from dataclasses import dataclass
from functools import lru_cache

from planner.engines import Engine, get_engine
from planner.layout import Layout, balanced_layers, rank_chunks
from planner.model.spec import ModelSpec


def ceil_div(x: float, n: int) -> int:
    return -int(-x // n)


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank of a pipeline stage holds (counts)."""

    dense: int  # sharded by ZeRO over dp_shard
    experts: int  # routed experts, sharded by ZeRO over expert_shard
    expert_shard: int  # ZeRO group of the routed experts: the expert data-parallel ranks of a replica
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
def layer_kind_params(model: ModelSpec, tp: int, ep: int, etp: int = 1) -> tuple[tuple[int, int], tuple[int, int]]:
    """((dense, experts) of a dense-MLP layer, (dense, experts) of a MoE layer) on one rank."""
    h = model.hidden
    row_bias = h if (model.bias or model.attention_bias) else 0
    attention = (model.attention_params - row_bias) / tp + row_bias
    replicated = model.norms_per_layer * model.norm_params
    mlp_bias = h if model.bias else 0
    dense_mlp = (model.dense_mlp_params - mlp_bias) / tp + mlp_bias
    dense_layer = (round(attention + dense_mlp + replicated), 0)
    if model.moe is None:
        return dense_layer, dense_layer
    shared = model.shared_expert_params
    shared_row_bias = model.moe.n_shared_experts * mlp_bias
    moe_dense = (shared - shared_row_bias) / tp + shared_row_bias + model.router_params
    experts = model.expert_params_per_layer / (ep * etp)
    return dense_layer, (round(attention + moe_dense + replicated), round(experts))


def layer_params_split(model: ModelSpec, tp: int, ep: int, etp: int = 1) -> tuple[int, int]:
    """(dense, routed-expert) parameters of an average layer on one TP/EP rank (MoE and dense layers mixed)."""
    (d_dense, _), (m_dense, m_experts) = layer_kind_params(model, tp, ep, etp)
    n_moe = model.n_moe_layers
    if n_moe in (0, model.n_layers):
        return (m_dense, m_experts) if n_moe else (d_dense, 0)
    f = n_moe / model.n_layers
    return round(f * m_dense + (1 - f) * d_dense), round(f * m_experts)


def moe_layers_in(model: ModelSpec, lps: tuple[int, ...], chunks: tuple[int, ...]) -> int:
    """MoE layers among the layers of `chunks` (model order: chunk c holds the next lps[c] layers)."""
    if model.moe is None:
        return 0
    per_chunk = _moe_layers_per_chunk(model, lps)
    return sum(per_chunk[c] for c in chunks)


@lru_cache(maxsize=4096)
def _moe_layers_per_chunk(model: ModelSpec, lps: tuple[int, ...]) -> tuple[int, ...]:
    assert model.moe is not None
    out, start = [], 0
    for n in lps:
        out.append(sum(1 for i in range(start, start + n) if model.moe.is_moe_layer(i)))
        start += n
    return tuple(out)


def stage_params(model: ModelSpec, layout: Layout, rank: int, engine: str | Engine = "meshplan") -> StageParams:
    """Parameters pipeline rank `rank` holds under `layout` (layers_per_stage may be empty)."""
    return pipeline_params(model, layout, engine)[rank]


def pipeline_params(model: ModelSpec, layout: Layout, engine: str | Engine = "meshplan") -> tuple[StageParams, ...]:
    """stage_params for every pipeline rank, computed once per distinct placement."""
    return _pipeline_params(model, layout.pp, layout.virtual_stages, layout.pp_schedule, layout.layers_per_stage,
                            layout.tp, layout.ep, layout.etp, layout.expert_dp_shard,
                            tied_vocab_parallel=get_engine(engine).tensor_parallel.splits_tied_vocab)


@lru_cache(maxsize=16384)
def _pipeline_params(model: ModelSpec, pp: int, v: int, schedule: str, lps: tuple[int, ...], tp: int, ep: int,
                     etp: int, expert_shard: int, *, tied_vocab_parallel: bool) -> tuple[StageParams, ...]:
    """`_placement` with the expert ZeRO group filled in (equal stages still share one object)."""
    stages = _placement(model, pp, v, schedule, lps, tp, ep, etp, tied_vocab_parallel=tied_vocab_parallel)
    distinct: dict[int, StageParams] = {}
    for sp in stages:
        if id(sp) not in distinct:
            distinct[id(sp)] = dataclasses.replace(sp, expert_shard=expert_shard)
    return tuple(distinct[id(sp)] for sp in stages)


@lru_cache(maxsize=4096)
def _placement(model: ModelSpec, pp: int, v: int, schedule: str, lps: tuple[int, ...], tp: int, ep: int,
               etp: int, *, tied_vocab_parallel: bool) -> tuple[StageParams, ...]:
    """The parameters of every pipeline rank, with expert_shard 1: what does not depend on the data-parallel
    split (dense models' stages are the same at every dp_shard)."""
    expert_shard = 1
    lps = lps or balanced_layers(model.n_layers, pp * v)
    (plain_dense, _), (moe_dense, moe_experts) = layer_kind_params(model, tp, ep, etp)
    vocab_h = model.vocab * model.hidden
    matrix = _vocab_matrix(model, tp, tied_vocab_parallel=tied_vocab_parallel)
    positions = model.embedding_params - vocab_h
    biggest_layer_matrix = max(_layer_tensors(model, tp)[0], default=0)
    stages: list[StageParams] = []
    distinct: dict[StageParams, StageParams] = {}  # equal stages share one object: callers may key on id()
    for rank in range(pp):
        chunks = rank_chunks(schedule, pp, v, rank)
        layers = sum(lps[c] for c in chunks)
        n_moe = moe_layers_in(model, lps, chunks)
        has_embedding, has_output = 0 in chunks, len(lps) - 1 in chunks
        layer_dense = n_moe * moe_dense + (layers - n_moe) * plain_dense
        layer_experts = n_moe * moe_experts
        if has_output and model.mtp_layers:  # MTP modules: one layer each plus a 2h -> h projection
            mtp_dense = moe_dense if model.moe is not None else plain_dense
            layer_dense += model.mtp_layers * (mtp_dense + -(-2 * model.hidden * model.hidden // tp)
                                               + 3 * model.norm_params)
            layer_experts += model.mtp_layers * moe_experts
        embedding = (matrix + positions) if has_embedding else 0
        head = matrix if has_output else 0
        shared_here = model.tie_embeddings and has_embedding  # the embedding's matrix serves as the head
        output = (model.norm_params + (0 if shared_here else head)) if has_output else 0
        table_is_head = model.tie_embeddings and has_output
        uncast = (((0 if table_is_head else matrix) + positions) if has_embedding else 0) + \
            model.norms_per_layer * layers * model.norm_params + (model.norm_params if has_output else 0)
        largest = max(biggest_layer_matrix if layers else 0, matrix if has_embedding or has_output else 0,
                      positions if has_embedding else 0)
        block = (moe_dense + moe_experts) if n_moe else plain_dense
        sp = StageParams(layer_dense + embedding + output, layer_experts, expert_shard,
                         block, embedding + output, head, layers, has_embedding, has_output,
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
        return -(-sp.dense // dp_shard) + -(-sp.experts // sp.expert_shard)
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

"""The shapes a plan of one model runs, for `meshplan calibrate --model`: what to measure.

A generic grid fits the GEMM model (efficiency and knee) over shapes the plan
may never use; where one dimension is small (a micro-batch of tokens, a TP
shard of a 384-wide layer) the roofline's one knee misprices it by tens of
percent. Given the model, the sequence length and the micro-batch sizes, this
module lists the kernels and messages of every layout of up to `ranks` ranks,
from the simulator's own shape formulas (`planner.simulate.compute`), so the
fit is made where the predictions will be read:

  GEMMs       every forward GEMM of a layer (QKV, O, MLP up and down) and the
              output layer, for each TP degree dividing `ranks` and the heads,
              at m = micro-batch * seq tokens (`layer_gemms`)
  attention   causal SDPA over micro-batch x heads / tp
  messages    a TP point (m * hidden), one layer's parameters / tp (FSDP
              gathers), the root unit (embedding or output matrix), a stage's
              and the whole model's parameters / tp (DP all-reduce)
  AdamW       the model's parameters (at most 2^24: the time is linear in it)

Pure Python: no torch, so tests check the lists without a device.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.layout import Layout, divisors
from planner.memory.params import layer_params_split
from planner.model.spec import ModelSpec
from planner.simulate.compute import layer_gemms, tokens_per_micro_batch

MAX_ADAMW_PARAMS = 1 << 24


@dataclass(frozen=True)
class PlanShapes:
    gemm: tuple[tuple[int, int, int], ...]  # (m, n, k)
    attention: tuple[tuple[int, int, int, int], ...]  # (batch, heads, seq, head_dim)
    comm_bytes: tuple[int, ...]  # message sizes, nccl-tests convention
    adamw_params: int


def tp_degrees(model: ModelSpec, ranks: int) -> tuple[int, ...]:
    """TP degrees up to `ranks` that divide the ranks and both head counts (the executor's rule)."""
    return tuple(t for t in divisors(ranks) if model.n_heads % t == 0 and model.n_kv_heads % t == 0)


def plan_shapes(model: ModelSpec, seq_len: int, micro_batches: tuple[int, ...], ranks: int,
                dtype_bytes: int) -> PlanShapes:
    """Kernels and messages of the layouts of `model` on up to `ranks` ranks (see the module docstring)."""
    gemm: dict[tuple[int, int, int], None] = {}
    attention: dict[tuple[int, int, int, int], None] = {}
    comm: dict[int, None] = {}
    for tp in tp_degrees(model, max(ranks, 1)):
        dense, experts = layer_params_split(model, tp, 1)
        for size in (dense + experts, model.vocab * model.hidden // tp,
                     model.total_params // tp, model.total_params // (2 * tp)):
            comm[int(size * dtype_bytes)] = None
        for mb in micro_batches:
            layout = Layout(tp=tp, micro_batch_size=mb)
            m = tokens_per_micro_batch(seq_len, layout)
            for _, gm, gn, gk in layer_gemms(model, m, layout):
                gemm[(int(gm), int(gn), int(gk))] = None
            gemm[(int(m), model.vocab // tp, model.hidden)] = None
            attention[(mb, model.n_heads // tp, seq_len, model.head_dim)] = None
            comm[int(m * model.hidden * dtype_bytes)] = None
    return PlanShapes(tuple(gemm), tuple(attention), tuple(sorted(comm)),
                      min(model.total_params, MAX_ADAMW_PARAMS))

"""Context parallelism as PyTorch's `context_parallel` runs it: K/V all-gather, c SDPA calls, fp32 merges.

Source: pytorch/pytorch torch/distributed/tensor/experimental/_attention.py,
the late-2024 version torchtitan 9dec370 ran on (torch 1963fc8, 2024-12-23:
`_RotateMethod.PRE_ALL_GATHER` still present, `typing.List` annotations) and
unchanged in structure at 0123248a (2025). torchtitan sets the rotate method
from `--experimental.context_parallel_rotate_method`, default "allgather"
(torchtitan/config_manager.py at 9dec370), which is also torch's own default
(`_ContextParallelOptions.rotate_method = ALL_GATHER`).

What one layer runs on cp rank r of c, each holding L = b*s/c tokens as two
head-tail chunks (load balancing is on by default):

* forward (`_templated_ring_attention`): step 0 concatenates K and V and
  issues ONE async all-gather of them over the cp group, then runs the local
  causal SDPA (L x L); every later step i = 1..c-1 waits for that gather and
  runs one non-causal SDPA of L x L/2 (i <= r: the first half of the peer's
  K/V) or L/2 x L (i > r: the second half of the queries). Every call covers
  L^2/2 scores, so the FLOPs equal one causal L x s call (what
  `attention_core_times` prices); the gather hides only under step 0's call,
  1/c of the attention core. Each step still concatenates K and V for the
  rotater (`exchange_buffers`), a bf16 copy that the all-gather then ignores.
* merge (`_SDPAMerger`, convert_to_f32 True): the first output is cast to fp32,
  each later one is cast too and folded in by
  out - sigmoid(lse_i - lse) * (out - out_i): elementwise fp32 passes over
  the whole output, 38 bytes per output element per step (cast 2+4; the
  difference 4+4+4; the sigmoid product 4+4; the update 4+4+4), and the result
  is cast back (4+2). Rank c-1 is the busiest: all its later steps merge the
  full output (i <= r), the others merge half plus a concatenation.
* backward (`_templated_ring_attention_backward`): a new rotater all-gathers
  K and V again (hidden only under step 0's SDPA backward), the c SDPA
  backwards run on the same chunks, and the K/V gradients travel around the
  ring in fp32 (`dkv_rotater`, always ALL_TO_ALL = `permute_tensor` to the
  next rank): after each step's backward the accumulated dK/dV are sent on,
  awaited after the next step's backward; the last send is awaited at once.
  Accumulation is fp32: zero-initialised dQ, dK, dV, `+=` of each step's
  bf16 gradients, `_partial_update` (an add into one half and a `torch.cat`
  copy of the whole), the send buffer's `torch.cat`, the final casts.
* under full recomputation the forward, gather and merges included, runs again.

`ModelCode.repeats_kv`: torchtitan's Llama (9dec370 through ff0829c10,
2026-01-27) repeats the K/V heads to the query heads (`repeat_kv`) before
SDPA, so everything above moves n_heads-wide K/V, not n_kv_heads-wide.

Memory-bound passes are priced like the rest of the engine's elementwise work
(`memory_time_s` at the engine's calibrated HBM rate, halved by compile since
the block is compiled whole with fullgraph=True and the merge is traced into
it). The ring that Transformer Engine runs (Megatron) stays in
`planner.simulate.comm.StepComm.cp_ring_s`.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.layout import Layout, recomputed_fraction
from planner.model.spec import ModelSpec
from planner.simulate.calibration import CalibrationProfile
from planner.simulate.compute import COMPILE_ELEMENTWISE_FACTOR, memory_time_s, tokens_per_micro_batch
from topologies.hardware import GPUSpec

FP32_BYTES = 4
# fp32 bytes per output element of one later step's merge (module docstring) and of the first/last casts
MERGE_STEP_BYTES = 38.0
MERGE_CASTS_BYTES = 12.0  # first output to fp32 (2+4), result back to bf16 (4+2)
# backward fp32 accumulation, bytes per element (module docstring); rank c-1's chunks
DQ_FIXED_BYTES = 20.0  # zero init 4, step 0's += 10, final cast 6
DQ_STEP_BYTES = 10.0  # += of a later step's bf16 dQ into the fp32 accumulator
# per element of K (and again of V): zero init 4, step 0's += 10, step 0's send-buffer cat 8, final cast of the
# received fp32 buffer 6
DKV_FIXED_BYTES = 28.0
DKV_STEP_BYTES = 21.0  # _partial_update: += into one half (5) and the cat copy (8); the send-buffer cat (8)
# one bf16 read and write of K (and of V): the `.contiguous()` copy each pass makes of its transposed input, and
# the rotater's concatenation at every step but the last; only step 0's feeds the all-gather, so a compiled
# block drops the other c - 2 (no users)
KV_COPY_BYTES = 4.0


@dataclass(frozen=True)
class TorchCpCost:
    """What torch's context_parallel adds to one layer pass of one micro-batch on the busiest cp rank."""

    forward_s: float  # merge passes, K/V concatenations (GPU, memory-bound)
    backward_s: float  # fp32 gradient accumulation and casts (GPU, memory-bound)
    recompute_s: float  # the forward's passes again under full recomputation
    comm_f: float  # exposed: the K/V all-gather beyond step 0's SDPA
    comm_b: float  # exposed: the backward's all-gather, the fp32 dK/dV sends, the recomputed forward's gather
    calls_f: int
    calls_b: int


def sdpa_kv_width(model: ModelSpec, tp: int, repeats_kv: bool) -> float:
    """Width of the K (or V) tensor SDPA receives on one TP rank: the query heads' when the model
    repeats K/V before SDPA, else the K/V heads'."""
    heads = model.n_heads if repeats_kv else model.n_kv_heads
    return heads * model.head_dim / tp


def torch_cp_cost(model: ModelSpec, seq_len: int, dtype_bytes: int, layout: Layout, comm, gpu: GPUSpec,
                  cal: CalibrationProfile, core_f: float, core_b: float, *, repeats_kv: bool,
                  compile: bool) -> TorchCpCost:
    """Extra GPU time and exposed communication of torch's all-gather context parallelism (module docstring).

    core_f, core_b: the attention core's forward and backward time of the layer on this rank (all c SDPA
    calls); `comm` a `planner.simulate.comm.StepComm`. cp == 1 costs nothing.
    """
    c = layout.cp
    if c <= 1:
        return TorchCpCost(0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)
    m = tokens_per_micro_batch(seq_len, layout)
    kv = m * sdpa_kv_width(model, layout.tp, repeats_kv)  # elements of K (and of V) on this rank
    out = m * model.n_heads * model.v_head_dim / layout.tp  # elements of the attention output
    squeeze = COMPILE_ELEMENTWISE_FACTOR if compile else 1.0
    kv_copies = 2 * kv * KV_COPY_BYTES * (2 + (0 if compile else c - 2))  # contiguous, gathered cat, unused cats
    fwd_bytes = out * (MERGE_CASTS_BYTES + MERGE_STEP_BYTES * (c - 1)) + kv_copies
    bwd_bytes = out * (DQ_FIXED_BYTES + DQ_STEP_BYTES * (c - 1)) + \
        2 * kv * (DKV_FIXED_BYTES + DKV_STEP_BYTES * (c - 1)) + kv_copies
    fwd_s, bwd_s = (memory_time_s(b, gpu, cal) * squeeze for b in (fwd_bytes, bwd_bytes))
    # the gather is issued before step 0's SDPA and awaited after it: only that call (1/c of the core) hides it
    overlap = cal.comm_overlap
    gather = comm.time_s("all_gather", c * 2 * kv * dtype_bytes, ("cp",))
    gather_f = max(0.0, gather - overlap * core_f / c)
    gather_b = max(0.0, gather - overlap * core_b / c)
    # each fp32 dK/dV send to the next rank (the wrap-around hop is the slowest) hides under the next step's
    # SDPA backward; the last one is awaited right after the loop
    send = comm.pair_time_s(2 * kv * FP32_BYTES, ("cp",), 0, c - 1)
    sends_b = (c - 1) * max(0.0, send - overlap * core_b / c) + send
    share = recomputed_fraction(layout, model.n_layers)
    return TorchCpCost(fwd_s, bwd_s, share * fwd_s, gather_f, gather_b + sends_b + share * gather_f,
                       1, 1 + c + (1 if share else 0))

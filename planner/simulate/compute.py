"""Compute time of one micro-batch through a transformer layer, the model's ends and the optimizer.

Three kinds of GPU work, each priced by its own roofline term (parameters in
`planner.simulate.calibration`):

* GEMMs, t = 2mnk / (peak * eff) * (1 + knee/m + knee/n + knee/k). Per layer
  and micro-batch of m = b*s/cp tokens on one TP rank (h hidden, q = a*d
  query width, kv = k*d, f ffn, t = tp), forward:
      QKV (m, (q + 2kv)/t, h)  O (m, h, q/t)  MLP up (m, u*f/t, h)  down (m, h, f/t)
  with u = 2 for SwiGLU (gate and up), 1 for GELU. The backward runs the same
  shapes twice: input gradients (B) and weight gradients (W); the formula is
  symmetric in m, n, k, so each costs one forward GEMM time.
* Attention core (QK^T, softmax, AV) over a/t heads. Fused (FlashAttention,
  SDPA): 4*b*s_q*s_kv*d FLOPs per head forward, halved when causal, at the
  attention efficiency; its backward runs 5 products against the forward's 2
  (2.5x). Unfused (the softmax kernels of older Megatron): two batched GEMMs
  at the GEMM model plus memory-bound passes over the b*(a/t)*s_q*s_kv score
  matrix (write scores, read+write softmax, read for AV: 4 passes, 2.5 more
  with dropout; the backward twice that).
* Memory-bound elementwise work at HBM bandwidth, bytes per token forward:
  dtype_bytes * (11*h/(t if sp else 1) + 2*u'*f/t) -- two norms (read+write),
  two bias-dropout-residual adds (3 passes + mask), the MLP activation
  (GELU: read+write f; SwiGLU: read 2f, write f, so u' = 1.5); backward twice.
  A clamped GLU (GPT-OSS) adds its unfused clamp passes
  (planner.simulate.recompute.GLU_CLAMP_PASSES_FORWARD/_BACKWARD), routed
  experts with output biases the probability-weighted bias added after fc2
  (EXPERT_BIAS_PASSES_FORWARD/_BACKWARD, `expert_bias_times`).

* FSDP copies (ZeRO-2/3 over dp_shard x cp > 1): every all-gather is followed by a
  copy-out of the gathered flat buffer into the parameters, every
  reduce-scatter preceded by a copy-in (and cast) of the gradients into its
  flat buffer, so each communicated byte is read and written once more
  (FSDP_COPY_PASSES = 2). Per layer and micro-batch, P parameters on the rank:
  forward 2*P*D (ZeRO-3's all-gather), backward 2*(P*D + P*G) (its all-gather
  again and the reduce-scatter). ZeRO-2 gathers once per step: no per
  micro-batch all-gather copy.

* FP8/MXFP8 (TrainingSpec.precision): the block GEMMs run at the GPU's 8-bit
  peak at `fp8_gemm_efficiency` (its own fitted fraction: 8-bit GEMMs reach a
  smaller share of their doubled peak than 16-bit ones, Hopper's FP8 tensor
  cores accumulate at reduced precision and stall on scale handling), with
  the same shape penalty. Each GEMM also casts its operands:
  forward the input [m,k] and the weight [n,k], backward the output gradient
  [m,n], `fp8_cast_bytes` per element (read 2 bytes, write the 8-bit copy,
  and its transpose for the other GEMM of the backward where FP8 GEMMs are
  TN-only; MXFP8 writes a row-wise and a column-wise block-scaled copy; the
  amax reduction is fused into the cast). Attention, norms, the output layer and the
  optimizer stay in the 16-bit model (planner.engines.Fp8Recipe).
* torch.compile per block (TrainingSpec.compile): Inductor fuses the norms,
  rotary, activation and residual adds of a block into a few kernels, so the
  memory-bound work (and the FP8 casts) moves COMPILE_ELEMENTWISE_FACTOR of the eager bytes and
  the block issues fewer kernels (COMPILE_HOST_FACTOR of the host time).

Recomputation redoes forward work before the backward: full = the whole
layer forward, selective = the attention core, op = per-op selective
checkpointing (planner.memory.activations): the elementwise work and every
second projection (wk, wo, w3 / fc2's partner: the GEMMs whose outputs the
save list skips); the attention core and the saved projections are not redone. The host issues every pass;
`combine` overlaps host and GPU time (see `CalibrationProfile`).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.layout import Layout, recomputed_fraction, selective_modules
from planner.memory.params import layer_params_split
from planner.model.spec import ModelSpec
from planner.simulate.calibration import CalibrationProfile
from planner.simulate.gemm_shapes import (  # gemm_flops, layer_gemms: re-exported for their callers
    attention_gemms,
    gemm_flops,  # noqa: F401
    layer_gemms,  # noqa: F401
    mlp_gemms,
    moe_fraction,
)
from planner.simulate.recompute import (
    EXPERT_BIAS_PASSES_BACKWARD,
    EXPERT_BIAS_PASSES_FORWARD,
    ModuleParts,
    glu_clamp_passes,
    module_forward_s,
)
from topologies.hardware import GPUSpec

FUSED_BWD_OVER_FWD = 2.5  # FlashAttention-2 backward: 5 matmuls vs 2 in the forward
UNFUSED_SCORE_PASSES = 4.0  # write QK^T, read+write softmax, read by AV (per fwd)
DROPOUT_SCORE_PASSES = 2.5  # read, write, 1-byte mask (in 2-byte units)
NORM_RESIDUAL_PASSES = 11.0  # 2 norms r+w, 2 bias-dropout-add (r x, r residual, w out, mask)
# Read + write of every byte an FSDP collective moves (copy-out after all-gather,
# copy-in before reduce-scatter). Fitting 1, 2 or 3 against LLM Foundry's FSDP
# runs on H100 gave 3.9%, 3.1% and 3.8% validation MAPE: the design's 2 fits best.
FSDP_COPY_PASSES = 2.0
# Bytes per element of one GEMM operand's 8-bit cast (amax fused into the same pass). Per-tensor
# scaling on TN-only FP8 GEMMs (Hopper): read 2 bytes, write the 8-bit copy and its transpose.
FP8_CAST_BYTES = 4.0
# Per-tensor scaling where FP8 GEMMs take any layout (GPUSpec.fp8_any_layout, Blackwell): one
# 8-bit copy serves both GEMMs of the backward: read 2, write 1.
FP8_ANY_LAYOUT_CAST_BYTES = 3.0
# MXFP8 (Transformer Engine's MXFP8BlockScaling): a 1-byte E8M0 scale per 32 elements along
# the contraction axis, so the backward's other GEMM cannot reuse a transpose: the quantizer
# writes a row-wise and a column-wise copy, each with its scales, on every GPU: read 2,
# write 2 * (1 + 1/32).
MXFP8_CAST_BYTES = 2.0 + 2.0 * (1.0 + 1.0 / 32.0)
# torch.compile per block: torchtitan reports +10-20% tokens/s from compile on Llama 3 8B/70B
# on H100 (docs/performance.md, FSDP bf16), all of it from fused elementwise kernels and
# fewer launches; 0.5 of the eager memory-bound bytes and 0.5 of the host time per block
# gives +12% on an 8B FSDP step at 8K tokens, inside that range. A documented factor, not fitted.
COMPILE_ELEMENTWISE_FACTOR = 0.5
COMPILE_HOST_FACTOR = 0.5


def gemm_time_s(m: float, n: float, k: float, peak_flops: float, cal: CalibrationProfile,
                efficiency: float | None = None) -> float:
    """Time of one [m,k] x [k,n] GEMM; see the module docstring for the shape penalty.

    efficiency: None is the 16-bit `gemm_efficiency`; 8-bit GEMMs pass `fp8_gemm_efficiency`.
    """
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    shape = 1.0 + cal.gemm_knee * (1.0 / m + 1.0 / n + 1.0 / k)
    return 2.0 * m * n * k / (peak_flops * (efficiency or cal.gemm_efficiency)) * shape


def memory_time_s(n_bytes: float, gpu: GPUSpec, cal: CalibrationProfile) -> float:
    """Time to stream n_bytes through HBM (reads plus writes)."""
    return n_bytes / (gpu.memory_gbytes_per_s * 1e9 * cal.memory_efficiency)


def combine(gpu_s: float, host_s: float, exponent: float) -> float:
    """Wall time of a pass whose host issue time overlaps its GPU time: a p-norm of the two."""
    if host_s <= 0.0:
        return gpu_s
    top = max(gpu_s, host_s)  # scaled by the larger term: no overflow for absurd rates (a GPU of 1e-190 FLOP/s)
    return top * ((gpu_s / top) ** exponent + (host_s / top) ** exponent) ** (1.0 / exponent)


@dataclass(frozen=True)
class PassTimes:
    """GPU time of one unit (a layer, or an end of the model) for one micro-batch."""

    forward_s: float  # forward pass
    backward_input_s: float  # gradients of the activations (zero-bubble "B")
    backward_weight_s: float  # gradients of the weights (zero-bubble "W")
    recompute_s: float = 0.0  # forward work redone before the backward

    @property
    def backward_s(self) -> float:
        return self.backward_input_s + self.backward_weight_s + self.recompute_s

    def __add__(self, other: PassTimes) -> PassTimes:
        return PassTimes(self.forward_s + other.forward_s, self.backward_input_s + other.backward_input_s,
                         self.backward_weight_s + other.backward_weight_s, self.recompute_s + other.recompute_s)

    def scaled(self, factor: float) -> PassTimes:
        return PassTimes(self.forward_s * factor, self.backward_input_s * factor,
                         self.backward_weight_s * factor, self.recompute_s * factor)


def attention_core_times(batch_heads: float, s_q: float, s_kv: float, head_dim: int, dtype_bytes: int,
                         dropout: float, fused: bool, gpu: GPUSpec, peak: float,
                         cal: CalibrationProfile) -> tuple[float, float]:
    """(forward, backward) time of QK^T-softmax-AV for batch_heads independent heads (causal).

    Fused: a score tile's exponentials wait for its QK^T and AV waits for them
    (the softmax sits between the two MMAs), so the tensor-core time and the
    SFU time at `GPUSpec.exp_per_s` add, and the kernel reaches
    `attention_efficiency` of that serial bound. Where the GPU has no
    exponential rate catalogued the efficiency covers the softmax alone.
    """
    if fused:
        scores = batch_heads * s_q * s_kv * 0.5  # causal: half the tiles are skipped
        mma_s = 4.0 * scores * head_dim / peak
        # one exponential per score in the forward, one more where the backward recomputes P
        exp_s = scores / gpu.exp_per_s if gpu.exp_per_s else 0.0
        return ((mma_s + exp_s) / cal.attention_efficiency,
                (FUSED_BWD_OVER_FWD * mma_s + exp_s) / cal.attention_efficiency)
    gemms = batch_heads * (gemm_time_s(s_q, s_kv, head_dim, peak, cal) + gemm_time_s(s_q, head_dim, s_kv, peak, cal))
    passes = UNFUSED_SCORE_PASSES + (DROPOUT_SCORE_PASSES if dropout > 0 else 0.0)
    scores = memory_time_s(batch_heads * s_q * s_kv * dtype_bytes * passes, gpu, cal)
    return gemms + scores, 2.0 * (gemms + scores)


def tokens_per_micro_batch(seq_len: int, layout: Layout) -> float:
    """Tokens one rank's GEMMs see per micro-batch: b * s / cp (SP gathers the sequence back)."""
    return layout.micro_batch_size * seq_len / layout.cp


def fp8_peak_flops(precision: str, gpu: GPUSpec) -> float:
    """The 8-bit peak block GEMMs run at under `precision`, 0 for 16/32-bit precisions."""
    return gpu.peak_flops(precision) if precision in ("fp8", "mxfp8") else 0.0


def fp8_cast_bytes(precision: str, gpu: GPUSpec) -> float:
    """HBM bytes per element one 8-bit operand cast moves under `precision` (0 for 16/32-bit precisions)."""
    if precision == "mxfp8":
        return MXFP8_CAST_BYTES
    if precision == "fp8":
        return FP8_ANY_LAYOUT_CAST_BYTES if gpu.fp8_any_layout else FP8_CAST_BYTES
    return 0.0


def _block_gemms_s(gemms, peak: float, fp8_peak: float, cal: CalibrationProfile) -> tuple[float, float, float]:
    """(GEMM time of one pass, forward cast time, backward cast time) of a layer's block GEMMs."""
    if not fp8_peak:
        return sum(c * gemm_time_s(gm, gn, gk, peak, cal) for c, gm, gn, gk in gemms), 0.0, 0.0
    t = sum(c * gemm_time_s(gm, gn, gk, fp8_peak, cal, cal.fp8_gemm_efficiency) for c, gm, gn, gk in gemms)
    cast_f = sum(c * (gm * gk + gn * gk) for c, gm, gn, gk in gemms) * FP8_CAST_BYTES
    cast_b = sum(c * gm * gn for c, gm, gn, gk in gemms) * FP8_CAST_BYTES
    return t, cast_f, cast_b


def moe_times(model: ModelSpec, m: float, dtype_bytes: int, layout: Layout, peak: float, gpu: GPUSpec,
              cal: CalibrationProfile, fp8_peak: float = 0.0) -> tuple[float, float, float, float]:
    """(routed-expert GEMMs, MoE memory-bound work, FP8 cast bytes forward, backward) of an average
    layer, forward, on the busiest rank.

    Expert GEMMs run as grouped GEMMs at `grouped_gemm_efficiency` of the
    dense GEMM rate when a rank holds several experts (one launch per expert
    in Transformer Engine's grouped linear; one expert is a plain GEMM); the busiest expert rank gets `moe_imbalance` times the
    balanced share of tokens (a capacity factor caps it: tokens beyond it are
    dropped). Under an 8-bit precision (fp8_peak > 0) they run at the 8-bit
    rate with their operand casts, as the block GEMMs do (Transformer
    Engine's grouped linear layers sit under the same FP8 recipe as its
    dense ones), at `fp8_expert_efficiency` of the block GEMMs' 8-bit rate. Memory-bound work per token and layer: router scores and top-k
    over n_experts (fp32, read + write), then permutation before and
    unpermutation after the experts, each reading and writing top_k copies
    of the hidden state.
    """
    if model.moe is None:
        return 0.0, 0.0, 0.0, 0.0
    _, experts = mlp_gemms(model, m, layout)
    imbalance = _moe_imbalance(model, cal)
    gemm, cast_f, cast_b = _block_gemms_s(experts, peak, fp8_peak, cal)
    grouped = cal.grouped_gemm_efficiency if model.moe.n_experts > layout.ep else 1.0  # one expert: a plain GEMM
    gemm *= imbalance / (grouped * (cal.fp8_expert_efficiency if fp8_peak else 1.0))
    tokens = m / layout.tp
    router = tokens * model.moe.n_experts * 4 * 2
    permute = imbalance * 2 * 2 * tokens * model.moe.top_k * model.hidden * dtype_bytes
    return (gemm, moe_fraction(model) * memory_time_s(router + permute, gpu, cal), imbalance * cast_f,
            imbalance * cast_b)


def _moe_imbalance(model: ModelSpec, cal: CalibrationProfile) -> float:
    """Tokens on the busiest expert rank over the average: the calibration's, capped by a capacity factor."""
    if model.moe is not None and model.moe.capacity_factor:
        return min(cal.moe_imbalance, model.moe.capacity_factor)
    return cal.moe_imbalance


def expert_bias_times(model: ModelSpec, m: float, dtype_bytes: int, layout: Layout, gpu: GPUSpec,
                      cal: CalibrationProfile) -> tuple[float, float]:
    """(forward, backward) memory-bound time of the routed experts' output biases in the average layer on the
    busiest rank: fc2's bias times each routed row's probability, added after the GEMM
    (planner.simulate.recompute.EXPERT_BIAS_PASSES_*); rows as `moe_times` permutes them."""
    moe = model.moe
    if moe is None or not moe.expert_bias:
        return 0.0, 0.0
    row_bytes = moe_fraction(model) * _moe_imbalance(model, cal) * (m / layout.tp) * moe.top_k * model.hidden * dtype_bytes
    return (memory_time_s(EXPERT_BIAS_PASSES_FORWARD * row_bytes, gpu, cal),
            memory_time_s(EXPERT_BIAS_PASSES_BACKWARD * row_bytes, gpu, cal))


def _attention_keys(model: ModelSpec, seq_len: int, cp: int) -> float:
    """Keys per query of the average layer, as the causal core prices them: s, or ~2*window on sliding layers."""
    if not model.sliding_window or not model.sliding_layers:
        return seq_len
    sliding = min(2.0 * model.sliding_window * cp, seq_len)
    return ((model.n_layers - model.sliding_layers) * seq_len + model.sliding_layers * sliding) / model.n_layers


def layer_attention_core_times(model: ModelSpec, seq_len: int, dtype_bytes: int, layout: Layout, gpu: GPUSpec,
                               peak: float, cal: CalibrationProfile, fused_attention: bool = True
                               ) -> tuple[float, float]:
    """(forward, backward) attention core of the average layer on one rank: its s/cp queries against the
    causal share of the sequence's keys, over the rank's heads (`attention_core_times`)."""
    heads = layout.micro_batch_size * model.n_heads / layout.tp
    head_dim = (model.head_dim + model.v_head_dim) / 2  # QK^T at the key width, AV at the value width
    return attention_core_times(heads, seq_len / layout.cp, _attention_keys(model, seq_len, layout.cp),
                                head_dim, dtype_bytes, model.dropout, fused_attention, gpu, peak, cal)


def layer_times(model: ModelSpec, seq_len: int, dtype_bytes: int, layout: Layout, gpu: GPUSpec,
                peak: float, cal: CalibrationProfile, fused_attention: bool = True, *, fp8_peak: float = 0.0,
                compile: bool = False, cast_bytes: float = FP8_CAST_BYTES) -> PassTimes:
    """GPU time of one transformer layer for one micro-batch on one rank (no communication, no FSDP copies).

    Depends on the layout's tp, cp, ep, etp, micro-batch, recompute and sequence
    parallelism, and on the precision (fp8_peak > 0: 8-bit block and routed-expert GEMMs)
    and compile only (planner.search.bound caches it by those). cast_bytes: HBM bytes per
    element of an 8-bit operand cast (`fp8_cast_bytes`).
    """
    h, tp = model.hidden, layout.tp
    m = tokens_per_micro_batch(seq_len, layout)
    dense, _ = mlp_gemms(model, m, layout)
    gemms, cast_f, cast_b = _block_gemms_s(attention_gemms(model, m, tp) + dense, peak, fp8_peak, cal)
    expert_gemms, moe_memory, expert_cast_f, expert_cast_b = moe_times(model, m, dtype_bytes, layout, peak, gpu,
                                                                       cal, fp8_peak)
    gemms += expert_gemms
    cast_f, cast_b = cast_f + expert_cast_f, cast_b + expert_cast_b
    core_f, core_b = layer_attention_core_times(model, seq_len, dtype_bytes, layout, gpu, peak, cal, fused_attention)
    act_ffn = model.ffn_hidden
    if model.moe is not None:
        f, moe = moe_fraction(model), model.moe
        shared = moe.n_shared_experts * (moe.shared_ffn_hidden or moe.expert_ffn_hidden)
        act_ffn = (1 - f) * model.ffn_hidden + f * (moe.expert_ffn_hidden * moe.top_k + shared)
    act_passes = 3.0 if model.mlp == "swiglu" else 2.0
    replicated = NORM_RESIDUAL_PASSES * h / (tp if layout.sequence_parallel else 1)
    elementwise = memory_time_s(dtype_bytes * m * (replicated + act_passes * act_ffn / tp), gpu, cal) + moe_memory
    clamp_f, clamp_b = (memory_time_s(p * dtype_bytes * m * act_ffn / tp, gpu, cal) for p in glu_clamp_passes(model))
    bias_f, bias_b = expert_bias_times(model, m, dtype_bytes, layout, gpu, cal)
    clamp_f, clamp_b = clamp_f + bias_f, clamp_b + bias_b  # eager passes around the expert GEMMs
    cast_scale = cast_bytes / FP8_CAST_BYTES  # the GEMM helpers count casts at FP8_CAST_BYTES per element
    cast_f, cast_b = memory_time_s(cast_f * cast_scale, gpu, cal), memory_time_s(cast_b * cast_scale, gpu, cal)
    if compile:  # Inductor fuses the casts (and a GLU clamp) into the kernels around them as well
        elementwise, cast_f, cast_b, clamp_f, clamp_b = (x * COMPILE_ELEMENTWISE_FACTOR for x in
                                                         (elementwise, cast_f, cast_b, clamp_f, clamp_b))
    forward = gemms + cast_f + core_f + elementwise + clamp_f
    if layout.recompute == "op":
        redo, redo_cast, _ = _block_gemms_s(_op_recomputed_gemms(model, m, layout), peak, fp8_peak, cal)
        recompute = redo + memory_time_s(redo_cast * cast_scale, gpu, cal) + elementwise + clamp_f
    elif layout.recompute == "selective":  # Megatron-Core's modules (planner.simulate.recompute)
        squeeze = COMPILE_ELEMENTWISE_FACTOR if compile else 1.0  # as `elementwise` and the casts are priced

        def gemms_s(shapes) -> float:  # GEMMs of one module with their 8-bit casts
            t, cast, _ = _block_gemms_s(shapes, peak, fp8_peak, cal)
            return t + memory_time_s(cast * cast_scale, gpu, cal) * squeeze

        def bytes_s(n_bytes: float) -> float:
            return memory_time_s(n_bytes, gpu, cal) * squeeze

        experts_s = expert_gemms + memory_time_s(expert_cast_f * cast_scale, gpu, cal) * squeeze
        parts = ModuleParts(core_f, gemms_s, bytes_s, experts_s, (moe_memory + bias_f) * squeeze)
        recompute = sum(module_forward_s(model, module, m, dtype_bytes, layout, parts)
                        for module in selective_modules(layout))
    else:
        share = recomputed_fraction(layout, model.n_layers)
        recompute = {"none": 0.0, "full": share * forward}[layout.recompute]
    # B: input-gradient GEMMs, attention core backward, elementwise backward; W: weight GEMMs.
    return PassTimes(forward, gemms + cast_b + core_b + 2.0 * elementwise + clamp_b, gemms, recompute)


def _op_recomputed_gemms(model: ModelSpec, m: float, layout: Layout) -> tuple[tuple[float, float, float, float], ...]:
    """The projections per-op SAC does not save (every second mm: wk, wo, and w3 or fc2's partner)."""
    h, tp = model.hidden, layout.tp
    ffn = model.ffn_hidden if model.moe is None else model.moe.top_k * model.moe.expert_ffn_hidden
    out = [(1.0, m, model.kv_dim / tp, h), (1.0, m, h, model.q_dim / tp)]
    if model.mlp == "swiglu":
        out.append((1.0, m, ffn / tp, h))
    return tuple(out)


def fsdp_copy_times(model: ModelSpec, dtype_bytes: int, grad_bytes: int, layout: Layout, gpu: GPUSpec,
                    cal: CalibrationProfile, grad_params: float | None = None) -> PassTimes:
    """HBM time of FSDP's copies around one layer's collectives for one micro-batch (module docstring).

    Not recomputed: under full recomputation the backward's all-gather serves both. grad_params: the
    layer's parameters with gradients where not all of them (LoRA: planner.simulate.lora).
    """
    if layout.zero_stage < 2 or layout.shard_ranks == 1:
        return PassTimes(0.0, 0.0, 0.0)
    params = sum(layer_params_split(model, layout.tp, layout.ep, layout.etp))
    grads = params if grad_params is None else grad_params
    gather = params * dtype_bytes if layout.zero_stage == 3 else 0.0
    forward = memory_time_s(FSDP_COPY_PASSES * gather, gpu, cal)
    return PassTimes(forward, memory_time_s(FSDP_COPY_PASSES * (gather + grads * grad_bytes), gpu, cal), 0.0)


def output_times(model: ModelSpec, seq_len: int, layout: Layout, gpu: GPUSpec, peak: float,
                 cal: CalibrationProfile) -> PassTimes:
    """Final norm, vocabulary-parallel output layer and fp32 cross-entropy for one micro-batch."""
    m = tokens_per_micro_batch(seq_len, layout)
    logits = gemm_time_s(m, model.vocab / layout.tp, model.hidden, peak, cal)
    # loss: read logits, write fp32 softmax, read it again in the backward (3 fp32 passes)
    loss = memory_time_s(3 * 4 * m * model.vocab / layout.tp, gpu, cal)
    return PassTimes(logits + loss / 2, logits + loss / 2, logits)


def embedding_times(model: ModelSpec, seq_len: int, dtype_bytes: int, layout: Layout, gpu: GPUSpec,
                    cal: CalibrationProfile) -> PassTimes:
    """Token (+ position) embedding lookup and its scatter-add backward: memory-bound."""
    m = tokens_per_micro_batch(seq_len, layout)
    rows = memory_time_s(2 * dtype_bytes * m * model.hidden, gpu, cal)
    return PassTimes(rows, 0.0, 2 * rows)


def optimizer_time_s(local_params: float, optimizer: str, gpu: GPUSpec, cal: CalibrationProfile) -> float:
    """One optimizer step over the parameters this rank updates: memory-bound.

    AdamW streams `cal.optimizer_bytes_per_param` bytes per parameter (fp32
    param, grad, two moments read and written, plus the low-precision copy);
    SGD with momentum about half of it.
    """
    per_param = cal.optimizer_bytes_per_param * (1.0 if optimizer == "adamw" else 0.5)
    return memory_time_s(local_params * per_param, gpu, cal)

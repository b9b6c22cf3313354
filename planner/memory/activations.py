"""Activation memory of one transformer layer and of one pipeline rank.

Per layer, for one micro-batch, the bytes autograd keeps for the backward
pass, following Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", section 4) term by term. Symbols: s sequence,
b micro-batch, h hidden, a query heads, t tensor-parallel degree, D bytes of
the compute dtype (2 for bf16), and one byte per dropout-mask element.

With a GPT block (LayerNorm, GELU, f = 4h, MHA, dropout > 0, eager
attention, D = 2) the terms below add up to the paper's
    sbh(34 + 5as/h)                    no parallelism
    sbh(10 + 24/t + 5as/(ht))          tensor parallel
    sbh(34/t + 5as/(ht))               tensor + sequence parallel
    sbh(34/t)                          + selective recomputation
because (bytes per token, "sp" = split by t only with sequence parallel,
"tp" = always split by t):
    attention  norm1 input     D*h       sp   (2)
               QKV input       D*h       sp   (2)
               Q, K            D*(a*d + k*d)  tp  (4: GQA makes K smaller)
               V               D*k*d     tp   (2)
               softmax output  D*a*s     tp   (2as/h)  eager only
               dropout mask    1*a*s     tp   (as/h)   eager, dropout > 0
               dropout output  D*a*s     tp   (2as/h)  eager, dropout > 0
               output-proj in  D*a*d     tp   (2)
               dropout mask    1*h       sp   (1)      dropout > 0
    MLP        norm2 input     D*h       sp   (2)
               fc1 input       D*h       sp   (2)
               GELU in, out    2*D*f     tp   (16 when f = 4h)
               SwiGLU          4*D*f     tp   (w1 out, w3 out, silu out, product)
                               3*D*f     tp   fused (Megatron: fc1's 2f output, the product)
               dropout mask    1*h       sp   (1)      dropout > 0
Fused (flash) attention, the meshplan engine's default because our executor
calls SDPA, keeps no s^2 term: it saves Q, K, V, its output (which is also the
output projection's input, counted once) and an fp32 log-sum-exp per head and
token (4*a bytes). Selective recomputation (the attention core under
torch.utils.checkpoint, as the executor does) drops the eager s^2 terms, or
with fused attention only the log-sum-exp, and pays them back once per rank,
for the one layer whose attention is being recomputed. Full
recomputation keeps only each layer's input (D*h, split by t with sequence
parallel) plus, once per rank, the rest of the one layer being recomputed.
That transient, and the gradients a layer's backward holds beyond its saved
tensors (`layer_backward_transient`), exist while a block runs its backward,
not at the loss (planner.memory.phases: block_backward).

Sequence parallel in PyTorch (meshplan's executor: DTensor PrepareModuleInput
before attention, MLP and output layer) all-gathers the sequence and autograd
saves the gathered tensor, so the q/k/v, w1/w3 and output-layer inputs stay
D*h per token (not /t as in Megatron, which saves its shard and gathers again
in the backward): `sp_saves_gathered`.

Context parallel divides the tokens of every term by cp, the fused attention
core's included: every implementation keeps only this rank's Q, K, V, output
and fp32 softmax statistics and brings the other ranks' K/V back in the
backward. Transformer Engine (Megatron-Core) saves the local q, kv, out and
softmax_lse under p2p (AttnFuncWithCPAndKVP2P), the local k and v (not the
gathered ones, gathered again in the backward) under all_gather, and the
post-all-to-all q/k/v of s tokens and a/cp heads (the same bytes) under a2a;
torch's context_parallel (torchtitan) dispatches the SDPA op on local shards,
so autograd saves those, and its backward rotates K/V again. The K/V in
flight are communication buffers (planner.memory.estimate, CP row), and
meshplan's executor, which saves the all-gathered K/V, adds the other ranks'
share in planner.memory.estimate. Eager attention with cp keeps its local
queries against all s keys (DeepSpeed-Ulysses: a/cp heads over s tokens, the
same bytes); Megatron-Core and torch run cp only inside fused kernels
(Engine.cp_needs_fused refuses the rest).

MoE layers replace the MLP terms: the router input (D*h, sp), fp32 router
probabilities (4*E per token), and for each of top_k routed copies of a token
the expert input (D*h), the expert MLP (2 or 4 * D*f_e) and the expert output
kept for the weighted combine (D*h; not where the probabilities weigh the
experts' activation, as in Megatron-Core: `_mlp_terms`), all split by t;
shared experts as a dense MLP. EP moves tokens between ranks but keeps the
per-rank average.

torch.autocast (meshplan's DDP and single-GPU paths run fp32 parameters under
autocast): the embedding output and every residual add stay fp32, so the two
norm inputs cost 4 bytes per element instead of D, and the norms return fp32,
which every projection casts to D on its own: the executor's separate q, k, v
projections save three D-byte copies of the attention input (3*D*h) and w1, w3
two of the MLP input (2*D*h; GELU's w1 one).

Rotary tables (`rope_table_bytes`): an executor that hands the whole fp32
cos/sin buffers (max_seq_len rows) to every FSDP2 block gets D-byte copies of
both whole tables per block (FSDP2's mixed precision casts a block's inputs),
2*S*d*D per layer; one that slices s rows per block under autocast, 4*s*d*D.
meshplan's executor cuts the tables to the sequence and casts them once per
forward (executor.model.Transformer.forward), so the estimate leaves them out.

Per-op selective checkpointing ("op", torchtitan's default `selective` mode
with `selective_ac_option = "op"`): each block runs under
torch.utils.checkpoint with a policy that saves the outputs of the ops in
its save list -- aten.mm, the SDPA kernels (flash, memory-efficient) and the
functional reduce-scatter -- except every second mm of a block, counted in
call order; everything else (norms, activations, rotary, the skipped mms) is
recomputed in the backward. Besides the block's input that keeps, per token,
with the projections called in torchtitan's order (wq, wk, wv, wo; w1, w3,
w2 for SwiGLU, fc1, fc2 for GELU): the 1st, 3rd, 5th ... mm outputs (Llama:
wq q/t, wv kv/t, w1 f/t, w2 h -- w2's output is the row-parallel partial
sum, full width), and the fused attention's output (q/t) with its fp32
log-sum-exp (4a/t). Eager attention's math ops are not in the list: nothing
of the core is kept. `op_saved_terms`.

FP8 with Transformer Engine (Fp8Recipe.saves_fp8_inputs): te.Linear saves
the 8-bit cast of its input (its column-wise usage: one byte per element on
every GPU), so the QKV, fc1 and fc2 inputs cost 1 byte per element; the
output projection saves its 8-bit cast of the attention output beside the
D-byte output the fused attention keeps for its own backward (TE's
FusedAttnFunc saves q, k, v and out): "proj_fp8_input", 1 byte more per
element. torchao's float8 saves the 16-bit input (no change).

Norms are assumed fused (they save their input only, plus an fp32 statistic per
token that is ignored). The logits of the output layer are counted by the
caller (`output_activation_bytes`).
"""

from __future__ import annotations

from functools import lru_cache

from planner.layout import SELECTIVE_DEFAULT_MODULES
from planner.model.spec import ModelSpec
from planner.training import DTYPE_BYTES

FP32_BYTES = DTYPE_BYTES["fp32"]

MASK_BYTES = 1  # torch.nn.functional.dropout keeps a bool mask
# Cross-entropy on fp32 logits with PyTorch's log_softmax + nll_loss: the
# forward saves the fp32 log-probabilities (4 B/element, Korthikanti's "4sbv");
# at the start of the backward, LogSoftmaxBackward holds them together with
# the incoming fp32 gradient and its fp32 output gradient: 12 B/element at the
# moment that matters for the peak (the last stage's first backward).
LOGIT_SAVED_BYTES = 4
LOGIT_TRANSIENT_BYTES = 8
# DTensor's loss_parallel (torch.distributed.tensor.parallel.loss, the same code from its 2024 release on)
# replaces that backward with one fused step, _nll_loss_and_log_softmax_backward: zeros_like of the saved
# log-probabilities (the -1 at each target goes in), exp of them, the sum of the two and its product with
# the incoming gradient; three fp32 tensors live beside the saved one at its peak (the product is written
# once exp is freed). A CPU replay under torch 2.13 (fake process group, tp 2, the profiler's allocation
# events) shows 4 B per local logit at the loss backward's start and 16 B at its peak.
LOGIT_LOSS_PARALLEL_TRANSIENT_BYTES = 12


@lru_cache(maxsize=8192)
def layer_activation_terms(
    model: ModelSpec,
    seq_len: int,
    micro_batch: int,
    tp: int = 1,
    cp: int = 1,
    *,
    sequence_parallel: bool = False,
    dtype_bytes: int = 2,
    fused_attention: bool = True,
    autocast: bool = False,
    sp_saves_gathered: bool = False,
    fp8_inputs: bool = False,
    fused_swiglu: bool = False,
    moe_probs_in_experts: bool = False,
) -> dict[str, float]:
    """Bytes of each saved tensor of one layer for one micro-batch (no recomputation).

    Keys name the tensors of the module docstring (MLA's attention: `_mla_terms`;
    MoE layers' pre-MLP norm output: "router_input"); RECOMPUTED_TERMS says
    which of them each selectively recomputed module drops (what the
    attention core keeps, eager scores or the fused kernel's log-sum-exp,
    starts with "core_"). sp_saves_gathered: see the module docstring
    (PyTorch's sequence parallel).
    """
    d = dtype_bytes
    li = 1 if fp8_inputs else d  # bytes per element of a saved linear input (module docstring: FP8)
    r = FP32_BYTES if autocast else d  # residual stream (norm inputs)
    qkv_casts, mlp_casts = (3, 2 if model.mlp == "swiglu" else 1) if autocast else (1, 1)
    tokens = seq_len * micro_batch / cp  # tokens on this rank
    sp_div = tp if sequence_parallel else 1
    in_div = 1 if sp_saves_gathered else sp_div  # the projections' saved inputs
    h, a = model.hidden, model.n_heads
    drop = model.dropout > 0
    terms: dict[str, float] = {"norm1_input": r * h / sp_div}
    if model.mla is None:
        terms.update({"qkv_input": qkv_casts * li * h / in_div, "q_k": d * (model.q_dim + model.kv_dim) / tp,
                      "v": d * model.n_kv_heads * model.v_head_dim / tp})
    else:
        terms.update(_mla_terms(model, d, li, tp, in_div))
    terms["proj_input"] = d * model.n_heads * model.v_head_dim / tp  # the core's output: a*d, MLA a*v_head_dim
    if fp8_inputs:  # the output projection's own 8-bit cast of it (module docstring: FP8)
        terms["proj_fp8_input"] = li * model.n_heads * model.v_head_dim / tp
    if fused_attention:
        terms["core_logsumexp"] = FP32_BYTES * a / tp
    else:
        keys = seq_len  # eager: local queries against every key (cp: upper bound)
        terms["core_softmax"] = d * a * keys / tp
        if drop:
            terms["core_dropout_mask"] = MASK_BYTES * a * keys / tp
            terms["core_dropout_output"] = d * a * keys / tp
    if drop:
        terms["attn_dropout_mask"] = MASK_BYTES * h / sp_div
        terms["mlp_dropout_mask"] = MASK_BYTES * h / sp_div
    terms["norm2_input"] = r * h / sp_div
    terms["mlp_input"] = mlp_casts * li * h / in_div
    terms.update(_mlp_terms(model, d, tp, fused_swiglu, moe_probs_in_experts))
    if model.moe is not None:  # MoE layers: the pre-MLP norm's output feeds the router and shared experts
        share = model.n_moe_layers / model.n_layers
        terms["router_input"] = share * terms["mlp_input"]
        terms["mlp_input"] *= 1 - share
    if fp8_inputs and model.moe is None:  # fc2's saved input is one of the f-wide tensors
        terms["mlp_inner"] -= (d - li) * model.ffn_hidden / tp
    return {k: v * tokens for k, v in terms.items()}


def _mla_terms(model: ModelSpec, d: int, li: int, tp: int, in_div: int) -> dict[str, float]:
    """Per-token bytes MLA's attention keeps before its core (Megatron-Core MLASelfAttention, DeepSeek-V2/V3).

    The input norm is a module of its own (gpt_layer_specs: TENorm ahead of
    the down projections), whose output the q/kv down projections save
    ("mla_down_input"); the compressed latents are saved twice by the
    up projections, which fuse the latent norms (their input and the normed
    copy), with the rotary key part (64 wide): `mla_latents`, whole on every
    TP rank. The up projections and RoPE make Q and K (a * (nope + rope))
    and V (a * v_head_dim), split by t, which the core attention keeps
    ("mla_q_k", "mla_v").
    """
    mla, a = model.mla, model.n_heads
    latents = 2 * mla.q_lora_rank + 2 * mla.kv_lora_rank + mla.qk_rope_head_dim
    return {"mla_down_input": li * model.hidden / in_div, "mla_latents": d * latents,
            "mla_q_k": d * 2 * a * mla.qk_head_dim / tp, "mla_v": d * a * mla.v_head_dim / tp}


def _mlp_terms(model: ModelSpec, d: int, tp: int, fused_swiglu: bool = False,
               probs_in_experts: bool = False) -> dict[str, float]:
    """Per-token bytes of the MLP's inner tensors of an average layer (dense, or MoE experts + router).

    MoE layers keep the fp32 router probabilities and the top-k routing map,
    the permuted tokens (top_k copies of the hidden state: the experts'
    input after the dispatch all-to-all), each expert's inner tensors and
    its output kept for the weighted combine; shared experts as a dense MLP.
    Where the router's probabilities weigh the experts' activation instead of
    the combine (probs_in_experts: Megatron-Core since 0.13, TEGroupedMLP's
    permuted_probs; its unpermute takes no probabilities) no expert output is
    kept ("expert_output" absent). A routed expert's inner tensors are fc1's
    output (2f with SwiGLU, f with GELU: "experts") and what its activation saves beyond
    that input ("expert_act": SwiGLU's silu output and product, 2f, or only
    the product fc2 keeps, f, when the activation is one fused kernel, as
    Megatron-Core's weighted_bias_swiglu; GELU's output f).
    Models that mix dense and MoE layers (first dense layers, interleaving)
    are averaged over their layers, as the simulator's average layer is.
    """
    # saved tensors of width f per token; one fewer when SwiGLU is one fused kernel (fc1's 2f output, the product)
    per_f = (4 if model.mlp == "swiglu" else 2) - (1 if fused_swiglu and model.mlp == "swiglu" else 0)
    dense = {"mlp_inner": per_f * d * model.ffn_hidden / tp}
    if model.moe is None:
        return dense
    moe = model.moe
    f = model.n_moe_layers / model.n_layers
    shared_ffn = moe.shared_ffn_hidden or moe.expert_ffn_hidden
    up = 2 if model.mlp == "swiglu" else 1  # fc1's output width, in f
    terms = {
        "mlp_inner": (1 - f) * dense["mlp_inner"],
        "router_probs": f * (FP32_BYTES + 1) * moe.n_experts,  # fp32 probabilities + boolean routing map
        "moe_permuted": f * d * moe.top_k * model.hidden / tp,  # dispatched copies, the experts' input
        "expert_output": 0.0 if probs_in_experts else f * d * moe.top_k * model.hidden / tp,
        "experts": f * d * moe.top_k * up * moe.expert_ffn_hidden / tp,
        "expert_act": f * d * moe.top_k * (per_f - up) * moe.expert_ffn_hidden / tp,
        "shared_experts": f * per_f * d * moe.n_shared_experts * shared_ffn / tp,
    }
    return {k: v for k, v in terms.items() if v > 0}


@lru_cache(maxsize=4096)
def op_saved_terms(model: ModelSpec, seq_len: int, micro_batch: int, tp: int = 1, cp: int = 1,
                   dtype_bytes: int = 2, fused_attention: bool = True) -> dict[str, float]:
    """Bytes per-op selective checkpointing keeps of one layer beyond its input (module docstring).

    Under float8 the same GEMM outputs are kept: torchao's float8 linear calls torch.mm on its
    Float8TrainingTensor operands, and the checkpoint's policy mode sees that aten.mm before the
    subclass turns it into aten._scaled_mm (torchtitan's December 2024 H100 table: 77.0 GiB compiled
    bf16, 76.8 GiB with float8; bench/accuracy_torchtitan_h100.py).
    """
    d, h = dtype_bytes, model.hidden
    tokens = seq_len * micro_batch / cp
    # a MoE layer's experts see top_k rows per token: their second GEMM's output too, before the combine
    rows = 1 if model.moe is None else model.moe.top_k
    ffn = model.ffn_hidden if model.moe is None else rows * model.moe.expert_ffn_hidden
    mlp = [("w1", ffn / tp), ("w3", ffn / tp), ("w2", rows * h)] if model.mlp == "swiglu" else \
        [("fc1", ffn / tp), ("fc2", rows * h)]
    mms = [("wq", model.q_dim / tp), ("wk", model.kv_dim / tp), ("wv", model.kv_dim / tp), ("wo", h), *mlp]
    terms = {f"mm_{name}": d * width for i, (name, width) in enumerate(mms) if i % 2 == 0}
    if fused_attention:
        terms["sdpa_output"] = d * model.q_dim / tp
        terms["sdpa_logsumexp"] = FP32_BYTES * model.n_heads / tp
    return {k: v * tokens for k, v in terms.items()}


# Megatron-Core's selective recomputation (TransformerConfig.recompute_modules, --recompute-modules): the
# saved tensors of `layer_activation_terms` each module drops, read from megatron/core/transformer:
#   core_attn       the attention core under tensor_parallel.checkpoint / te_checkpoint (attention.py):
#                   its saved scores (eager) or the fused kernel's log-sum-exp; Q, K, V are its inputs, kept
#   mla_up_proj     multi_latent_attention.py: the q/kv up projections and RoPE run under
#                   CheckpointWithoutOutput, whose outputs (Q, K, V, which the core attention saves) are
#                   freed once the core has run and rebuilt from the kept latents in its backward
#   layernorm       transformer_layer.py: input_layernorm and pre_mlp_layernorm under
#                   CheckpointWithoutOutput: the norm's input stays, its output (what the next linear
#                   saves) is freed. Only norms that are modules of their own: the TE layer specs
#                   (gpt_layer_specs.py) fuse the norm into the QKV and dense fc1 linears (IdentityOp, nothing
#                   to drop), so it reaches MLA's input norm and MoE layers' pre-MLP norm
#   moe_act         moe/experts.py TEGroupedMLP: the activation under CheckpointWithoutOutput; fc1's
#                   output (the activation's input) stays, the activation's output and internals go
#   mlp             dense MLP layers under a checkpoint (not MoE layers): the residual input stays, the
#                   fused norm's output and the MLP's inner tensors go
#   moe             moe/moe_layer.py: the whole MoE layer under a checkpoint of its input (the norm's output)
#   shared_experts  moe/moe_layer.py: the shared experts under a checkpoint of the same input
RECOMPUTED_TERMS: dict[str, tuple[str, ...]] = {
    "core_attn": ("core_logsumexp", "core_softmax", "core_dropout_mask", "core_dropout_output"),
    "mla_up_proj": ("mla_q_k", "mla_v"),
    "layernorm": ("mla_down_input", "router_input"),
    "moe_act": ("expert_act",),
    "mlp": ("mlp_input", "mlp_inner"),
    "moe": ("router_probs", "moe_permuted", "experts", "expert_act", "expert_output", "shared_experts"),
    "shared_experts": ("shared_experts",),
}


def recomputed_terms(modules: tuple[str, ...]) -> frozenset[str]:
    """Keys of `layer_activation_terms` that selective recomputation of `modules` drops (RECOMPUTED_TERMS)."""
    return frozenset(key for module in modules for key in RECOMPUTED_TERMS[module])


def layer_activation_bytes(terms: dict[str, float], recompute: str,
                           op_saved: dict[str, float] | None = None,
                           modules: tuple[str, ...] = SELECTIVE_DEFAULT_MODULES) -> tuple[float, float]:
    """(bytes one layer keeps per micro-batch, transient bytes of recomputing one layer).

    none: every term, nothing recomputed. selective: every term but those
    the recomputed `modules` drop (RECOMPUTED_TERMS; Megatron's default, the
    attention core's "core_" terms: eager scores, or the fused kernel's
    log-sum-exp), which come back for one layer at a time in the backward.
    op: the layer input plus `op_saved` (op_saved_terms); the backward
    rebuilds the rest of one layer.
    full: only the layer input (the norm1 input); the backward rebuilds the
    rest of one layer (the input itself is not copied again). Counting the
    transient once per rank keeps none >= selective >= full for any number of
    layers: with X = in-flight micro-batches * layers, selective - full =
    (X - 1) * (selective per layer - input) >= 0.
    """
    total = sum(terms.values())
    if recompute == "none":
        return total, 0.0
    if recompute == "selective":
        dropped_keys = recomputed_terms(modules)
        dropped = sum(v for k, v in terms.items() if k in dropped_keys)
        return total - dropped, dropped
    if recompute == "op":
        kept = min(total, terms["norm1_input"] + sum((op_saved or {}).values()))
        return kept, total - kept
    return terms["norm1_input"], total - terms["norm1_input"]


def output_activation_bytes(
    model: ModelSpec, seq_len: int, micro_batch: int, tp: int, cp: int, *, sequence_parallel: bool,
    dtype_bytes: int, autocast: bool = False, vocab_parallel_loss: bool = True, sp_saves_gathered: bool = False,
    dtensor_loss_parallel: bool = False, fused_loss_parallel_backward: bool = False, eager_final_norm: bool = False,
) -> tuple[float, float, float]:
    """(saved per micro-batch, logits saved per micro-batch, transient once) on the last stage.

    Final norm input (residual dtype) and output-layer input (D): (R + D)*h
    per token, split by t with sequence parallel (the output-layer input not
    when sp_saves_gathered); Korthikanti's 4sbh/t when R = D = 2. Logits:
    V/t per token with a vocabulary-parallel loss, V when the engine gathers
    them; fp32 log-probabilities saved (4 B) plus the loss backward's
    transient (8 B). DTensor's loss_parallel, as meshplan's executor
    (dtensor_loss_parallel) and torchtitan (fused_loss_parallel_backward) run
    it under TP: 4 B saved and 12 B in its fused backward
    (LOGIT_LOSS_PARALLEL_TRANSIENT_BYTES); neither keeps the logits or their
    fp32 copy (validate-memory, Llama 3 8B at TP 4 x FSDP 16: -0.0%).
    eager_final_norm (torchtitan, which compiles only the blocks): the final
    RMSNorm runs as eager ops on an fp32 copy of its input, and autograd keeps
    that copy and the normalized compute-dtype tensor, not the input: 4 + D
    bytes per element in place of R.
    """
    tokens = seq_len * micro_batch / cp
    sp_div = tp if sequence_parallel else 1
    residual = FP32_BYTES if autocast else dtype_bytes
    if eager_final_norm and model.norm == "rmsnorm":
        residual = FP32_BYTES + dtype_bytes
    saved = (residual / sp_div + dtype_bytes / (1 if sp_saves_gathered else sp_div)) * model.hidden * tokens
    logits = tokens * model.vocab / (tp if vocab_parallel_loss else 1)
    if (dtensor_loss_parallel or fused_loss_parallel_backward) and vocab_parallel_loss and tp > 1:
        return saved, LOGIT_SAVED_BYTES * logits, LOGIT_LOSS_PARALLEL_TRANSIENT_BYTES * logits
    return saved, LOGIT_SAVED_BYTES * logits, LOGIT_TRANSIENT_BYTES * logits


def layer_backward_transient(model: ModelSpec, seq_len: int, micro_batch: int, tp: int, cp: int,
                             dtype_bytes: int) -> float:
    """Gradients one layer's backward holds beyond its saved tensors (once per rank, at its MLP).

    SwiGLU w2(s * u): w2's backward frees its input s*u and makes its
    gradient; the product's backward then makes the gradients of s and u while
    both are still saved: 3 - 1 = 2 tensors of width f per token. GELU: 1.
    MoE: the top_k routed expert widths. Measured with PyTorch's tracker at
    the block backward phase (tests/test_memory_phases.py).
    """
    width = model.ffn_hidden if model.moe is None else model.moe.top_k * model.moe.expert_ffn_hidden
    tensors = 2 if model.mlp == "swiglu" else 1
    return tensors * width * dtype_bytes * seq_len * micro_batch / (cp * tp)


def rope_table_bytes(model: ModelSpec, seq_len: int, dtype_bytes: int, *, cast_block_inputs: bool,
                     recompute: str) -> float:
    """Rotary tables one layer keeps per micro-batch (module docstring; meshplan's executor only).

    cast_block_inputs: FSDP2 (or its replicate) with a low-precision
    param_dtype casts the whole tables for every block; else autocast casts
    s-row slices.
    """
    if model.position != "rope" or dtype_bytes >= FP32_BYTES:
        return 0.0
    if cast_block_inputs:
        return 2.0 * model.max_seq_len * model.head_dim * dtype_bytes
    return 0.0 if recompute == "full" else 4.0 * seq_len * model.head_dim * dtype_bytes


def embedding_dropout_bytes(model: ModelSpec, seq_len: int, micro_batch: int, tp: int, cp: int, *,
                            sequence_parallel: bool) -> float:
    """The embedding dropout mask (first stage), 1 byte per element when dropout > 0."""
    if model.dropout <= 0:
        return 0.0
    sp_div = tp if sequence_parallel else 1
    return MASK_BYTES * model.hidden * seq_len * micro_batch / cp / sp_div

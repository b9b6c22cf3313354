"""Host operations one transformer layer dispatches per pass, counted from its structure.

The host issues a layer's work one operation at a time: a Python call into
Transformer Engine or PyTorch that checks its arguments, allocates its
outputs and launches its kernel(s). NVIDIA's profile of DeepSeek-V3 on GB200
(Megatron-LM docs/discussions/deepseek-v3-gb200-optimization, Nov 2025) found
the mid-2025 Megatron-Core stack host-bound there: fine-grained MoE layers
launch many small kernels and the GPU finishes them faster than the host
issues them. A layer's host time is therefore (operations it dispatches) x
(host time of one operation); the profile's `layer_overhead_s` is the host
time of a reference dense layer (`DENSE_REFERENCE_OPS`), so one operation
costs layer_overhead_s / DENSE_REFERENCE_OPS and every existing profile keeps
its meaning: a dense layer with fused attention has host_scale 1.

Counts are forward operations of Megatron-Core + Transformer Engine in eager
mode, one per Python-level dispatch (a TE module's call, a torch operator; a
communication call is priced apart by collective_overhead_s). The backward
pass runs two operations (input and weight gradients) for each forward
operation on the gradient path and none for the rest: autograd records only
operations whose outputs need gradients, so the router's selection (top-k
indices, masks, group choice, capacity drop) and the dispatcher's routing
counts are forward-only. Each component below names its forward count and
how many of those carry gradients.

* dense reference: two norms, two residual adds (bias-dropout-add), the
  fused QKV GEMM, its split into q/k/v, fused RoPE on q and k, the output
  GEMM, a fused attention kernel with its two layout changes, and the MLP's
  fc1, fused activation, fc2 (2 + 2 + 6 + 3 + 3 = 16).
* MLA (DeepSeek-V2/V3, Kimi-K2; megatron/core/transformer/multi_latent_attention.py):
  q and kv down-projections, their RMSNorms, q and kv up-projections, the
  splits into the no-RoPE and RoPE parts and into k/v, RoPE applied to the
  split heads outside the fused kernel (slice, rotate, multiply-add on q and
  k), the concatenations rebuilding q and k (k's RoPE part expanded over
  heads), contiguous copies, the output GEMM: 28.
* unfused attention (TE's UnfusedDotProductAttention: the fallback where no
  fused kernel takes the head shape): reshapes of q, k, v, an output
  allocation, baddbmm, mask and softmax, bmm, the permute back: 10 instead of 3.
* router: the gating GEMM plus the score function and top-k. DeepSeek-V3's
  sigmoid scores with the score-correction bias, group-limited top-k and its
  sequence auxiliary loss launch 72 kernels unfused (NVIDIA's count in the
  profile above, before TE's router fusion); a softmax top-k with the
  load-balancing loss needs about 28 (softmax, top-k, routing map, the loss's
  sums and scaling). On the gradient path: the gating GEMM, the scores, the
  gathered top-k probabilities and their normalisation, the auxiliary loss:
  12 (DeepSeek) and 10 (softmax). With router fusion (Megatron-Core's
  --moe-router-fusion, Transformer Engine's fused top-k with score function
  and fused auxiliary-loss kernels) either router is the gating GEMM, one
  fused score/top-k kernel (score function, expert bias, group limit and
  normalisation inside), the aux-loss scores, the tokens-per-expert sum, the
  fused aux loss, attaching it to the graph and the probabilities' cast: 7, of
  which 5 carry gradients (the tokens-per-expert sum and the cast do not).
  A capacity factor adds the token-drop pass (capacity top-k, mask scatter,
  mask product): 8, one with a gradient.
* token dispatch (the all-to-all dispatcher with fused permutation): routing
  counts (8, forward-only), permute, sort by local expert, and their inverses
  on the way back (12): 20.
* routed experts: a grouped GEMM is one dispatch per matrix (TE's
  GroupedLinear launches the per-expert GEMMs from C++): split sizes, fc1,
  activation, probability scaling, fc2 and the merge: 6. Without grouped GEMM
  (Megatron-Core's SequentialMLP) each local expert runs its own fc1,
  activation, fc2 and slice: 4 per expert plus the split and concatenation.
* shared experts: fc1, activation, fc2 and the add onto the routed output: 4.
* routed experts with output biases (GPT-OSS; Megatron-Core 0.15-0.18
  TEGroupedMLP._apply_bias): per local expert the bias times the routing
  probabilities and its add onto fc2's output (2), around them the splits of
  the output and the probabilities, the concatenation, a view and the cast
  back (5); on the gradient path both per-expert operations, the two splits
  and the concatenation.
* a clamped GLU (GPT-OSS; Megatron-Core 0.15-0.18 weighted_bias_quick_geglu_impl):
  the chunk of fc1's output, two clamps, their concatenation and the
  offset's scalar tensor built on the GPU at every call: 5 more, 4 of them on
  the gradient path (the scalar is not). Building that tensor from a Python
  float copies it host to device without non_blocking, which PyTorch ends
  with a stream synchronisation: the host waits for the GPU once per MoE
  activation (and once more where moe_act is recomputed). Not priced beyond
  its operation: where the GPU is the bottleneck the host catches up within
  the next kernels.

Selective recomputation (Megatron-Core's modules, default the core
attention: planner.simulate.recompute) runs each recomputed module's forward
operations again inside the backward (`recompute_ops`; MLA's up projections:
its projection operations but the two down projections, their norms and the
output GEMM); full recomputation's extra forward is `planner.simulate.host`'s.

CUDA graphs (a recipe option: `TrainingSpec.cuda_graphs`) replay what was
captured as one launch per graph. Static shapes are capturable: a whole layer
when routing drops at a capacity (NeMo's Grok-1 recipe on GB200); with
dropless routing the expert part's shapes follow the routing, so dispatch and
experts stay eager while attention and the router replay (Megatron-Core's
partial graphs, `--cuda-graph-scope attn moe_router`). A narrower scope
(`TrainingSpec.moe_router_graphs`: `--cuda-graph-scope moe_router
moe_preprocess`, the Megatron-Bridge Qwen3 presets) replays only the router and
the dispatcher's preprocessing (its routing counts, forward-only): one replay
per pass in their place, attention, dispatch and experts eager.
"""

from __future__ import annotations

from planner.layout import Layout, selective_modules
from planner.model.spec import ModelSpec

NORM_OPS = 1
RESIDUAL_OPS = 1
GQA_PROJECTION_OPS = 6
QK_NORM_OPS = 2
MLA_PROJECTION_OPS = 28
FUSED_CORE_OPS = 3
UNFUSED_CORE_OPS = 10
DENSE_MLP_OPS = 3
SOFTMAX_ROUTER_OPS = 28
GROUPED_SIGMOID_ROUTER_OPS = 72
SOFTMAX_ROUTER_GRAD_OPS = 10  # of SOFTMAX_ROUTER_OPS on the gradient path
GROUPED_SIGMOID_ROUTER_GRAD_OPS = 12
FUSED_ROUTER_OPS = 7
FUSED_ROUTER_GRAD_OPS = 5
CAPACITY_OPS = 8
CAPACITY_GRAD_OPS = 1
DISPATCH_OPS = 20
DISPATCH_PREPROCESS_OPS = 8  # of DISPATCH_OPS: the routing counts, forward-only
DISPATCH_GRAD_OPS = 12
GROUPED_EXPERT_OPS = 6
SEQUENTIAL_EXPERT_OPS = 4  # per local expert, plus SEQUENTIAL_MERGE_OPS
SEQUENTIAL_MERGE_OPS = 2
SHARED_EXPERT_OPS = 4
MOE_ACT_OPS = 2  # of GROUPED_EXPERT_OPS: the activation and the probability scaling
GLU_CLAMP_OPS = 5  # chunk, two clamps, concatenation, the offset's scalar tensor
GLU_CLAMP_GRAD_OPS = 4
EXPERT_BIAS_OPS = 2  # per local expert: bias * probability, the add
EXPERT_BIAS_MERGE_OPS = 5  # split output and probabilities, concatenate, view, cast back
EXPERT_BIAS_MERGE_GRAD_OPS = 3
MLA_UP_OPS = MLA_PROJECTION_OPS - 5  # but the q/kv down projections, their norms and the output GEMM
GRAPH_REPLAY_OPS = 1

DENSE_REFERENCE_OPS = 2 * NORM_OPS + 2 * RESIDUAL_OPS + GQA_PROJECTION_OPS + FUSED_CORE_OPS + DENSE_MLP_OPS


def router_ops(model: ModelSpec, fused: bool = False) -> tuple[int, int]:
    """(forward operations, those on the gradient path) of the router. A per-expert bias without
    expert biases is DeepSeek's e_score_correction_bias (topk_method noaux_tc: sigmoid scores,
    group-limited top-k, `planner.model.hf_config`); GPT-OSS's router bias sits in a softmax
    router's linear. fused: router fusion, where both kinds run as the same few fused kernels."""
    moe = model.moe
    assert moe is not None
    if fused:
        ops, grad = FUSED_ROUTER_OPS, FUSED_ROUTER_GRAD_OPS
    elif moe.router_bias and not moe.expert_bias:
        ops, grad = GROUPED_SIGMOID_ROUTER_OPS, GROUPED_SIGMOID_ROUTER_GRAD_OPS
    else:
        ops, grad = SOFTMAX_ROUTER_OPS, SOFTMAX_ROUTER_GRAD_OPS
    if moe.capacity_factor > 0:
        ops, grad = ops + CAPACITY_OPS, grad + CAPACITY_GRAD_OPS
    return ops, grad


def expert_ops(model: ModelSpec, layout: Layout, grouped_gemm: bool = True) -> int:
    """Forward operations of the routed experts on one rank (all on the gradient path): one grouped
    GEMM per matrix, or each local expert's own MLP when grouped GEMM is off."""
    moe = model.moe
    assert moe is not None
    if grouped_gemm:
        return GROUPED_EXPERT_OPS
    local = max(1, moe.n_experts // layout.ep)
    return SEQUENTIAL_EXPERT_OPS * local + SEQUENTIAL_MERGE_OPS


def attention_ops(model: ModelSpec, fused_attention: bool) -> int:
    """Forward operations of the attention block (projections, RoPE, the attention core)."""
    projections = MLA_PROJECTION_OPS if model.mla is not None else GQA_PROJECTION_OPS
    if model.qk_norm:
        projections += QK_NORM_OPS
    return projections + (FUSED_CORE_OPS if fused_attention else UNFUSED_CORE_OPS)


def recompute_ops(model: ModelSpec, layout: Layout, fused_attention: bool, grouped_gemm: bool = True,
                  router_fusion: bool = False) -> float:
    """Forward operations of the average layer that selective recomputation of Megatron-Core's modules runs
    again in the backward (module docstring)."""
    f = model.n_moe_layers / model.n_layers if model.moe is not None else 0.0
    per_module = {
        "core_attn": FUSED_CORE_OPS if fused_attention else UNFUSED_CORE_OPS,
        "mla_up_proj": MLA_UP_OPS if model.mla is not None else 0,
        "layernorm": NORM_OPS * ((1 if model.mla is not None else 0) + f),
        "moe_act": f * (MOE_ACT_OPS + (GLU_CLAMP_OPS if model.glu_clamp else 0)),
        "mlp": (1.0 - f) * DENSE_MLP_OPS,
        "shared_experts": f * SHARED_EXPERT_OPS if model.moe is not None and model.moe.n_shared_experts else 0.0,
    }
    if model.moe is not None:
        (static, _), (routed, _) = moe_mlp_ops(model, layout, grouped_gemm, router_fusion)
        per_module["moe"] = f * (static + routed)
    return sum(per_module.get(module, 0.0) for module in selective_modules(layout))


def moe_mlp_ops(model: ModelSpec, layout: Layout, grouped_gemm: bool = True, router_fusion: bool = False
                ) -> tuple[tuple[int, int], tuple[int, int]]:
    """One MoE layer's MLP as ((forward, gradient-path) operations static shapes let a CUDA graph
    capture: router and shared experts; the same for dispatch and routed experts, whose shapes
    follow the routing when it is dropless)."""
    moe = model.moe
    assert moe is not None
    router, router_grad = router_ops(model, router_fusion)
    shared = SHARED_EXPERT_OPS if moe.n_shared_experts else 0
    experts = expert_ops(model, layout, grouped_gemm)
    clamp, clamp_grad = (GLU_CLAMP_OPS, GLU_CLAMP_GRAD_OPS) if model.glu_clamp else (0, 0)
    bias, bias_grad = expert_bias_ops(model, layout)
    return (router + shared, router_grad + shared), (DISPATCH_OPS + experts + clamp + bias,
                                                      DISPATCH_GRAD_OPS + experts + clamp_grad + bias_grad)


def expert_bias_ops(model: ModelSpec, layout: Layout) -> tuple[int, int]:
    """(forward operations, those on the gradient path) of the routed experts' output biases on one rank."""
    if model.moe is None or not model.moe.expert_bias:
        return 0, 0
    local = max(1, model.moe.n_experts // layout.ep)
    return EXPERT_BIAS_OPS * local + EXPERT_BIAS_MERGE_OPS, EXPERT_BIAS_OPS * local + EXPERT_BIAS_MERGE_GRAD_OPS


def layer_ops(model: ModelSpec, layout: Layout, fused_attention: bool, cuda_graphs: bool = False,
              grouped_gemm: bool = True, router_fusion: bool = False, router_graphs: bool = False
              ) -> tuple[float, float]:
    """(forward, backward) host operations of one pass of the model's average layer (dense and MoE
    layers mixed by their counts); a CUDA graph replay counts as one operation per pass.
    router_graphs: only the router and the dispatch preprocessing replay (cuda_graphs covers more)."""
    common = model.norms_per_layer * NORM_OPS + 2 * RESIDUAL_OPS + attention_ops(model, fused_attention)
    f = model.n_moe_layers / model.n_layers if model.moe is not None else 0.0
    dense = common + DENSE_MLP_OPS
    graph = float(GRAPH_REPLAY_OPS)
    # selective recomputation runs its modules' forward once more inside the backward
    redo = recompute_ops(model, layout, fused_attention, grouped_gemm, router_fusion)
    if not f:
        return (graph, graph) if cuda_graphs else (float(dense), 2.0 * dense + redo)
    (static, static_grad), (routed, routed_grad) = moe_mlp_ops(model, layout, grouped_gemm,
                                                                      router_fusion)
    if router_graphs and not cuda_graphs:
        router, router_grad = router_ops(model, router_fusion)
        static, static_grad = static - router + graph, static_grad - router_grad
        routed -= DISPATCH_PREPROCESS_OPS
        forward = (1.0 - f) * dense + f * (common + static + routed)
        return forward, 2.0 * ((1.0 - f) * dense + f * (common + static_grad + routed_grad)) + f * graph + redo
    if not cuda_graphs:
        forward = (1.0 - f) * dense + f * (common + static + routed)
        return forward, 2.0 * ((1.0 - f) * dense + f * (common + static_grad + routed_grad)) + redo
    if model.moe.capacity_factor > 0:  # static shapes end to end: the whole layer is one graph
        return graph, graph
    # dropless: attention + router replay as graphs, dispatch and experts run eagerly in between
    return (1.0 - f) * graph + f * (2 * graph + routed), (1.0 - f) * graph + f * (2 * graph + 2.0 * routed_grad)


def host_scale(model: ModelSpec, layout: Layout, fused_attention: bool, cuda_graphs: bool = False,
               grouped_gemm: bool = True, router_fusion: bool = False, router_graphs: bool = False
               ) -> tuple[float, float]:
    """A layer's (forward, backward) eager host time over the reference dense layer's forward
    (`layer_overhead_s`); the reference's backward is 2."""
    forward, backward = layer_ops(model, layout, fused_attention, cuda_graphs, grouped_gemm, router_fusion,
                                  router_graphs)
    return forward / DENSE_REFERENCE_OPS, backward / DENSE_REFERENCE_OPS

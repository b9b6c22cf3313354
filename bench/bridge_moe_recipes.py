"""What the Megatron-Bridge performance recipes behind the MoE hold-out rows ran, beyond the table's layout.

Read from NVIDIA-NeMo/Megatron-Bridge scripts/performance/configs at the
release tags of the containers the summaries name (25.11: v0.2.2,
configs/{deepseek,gpt_oss,qwen3}/workload_base_configs.py; 26.02: v0.3.0,
configs/{deepseek,gpt_oss,qwen}/*_workload_base_configs.py, the V2 presets
whose batch the table gives) and their *_llm_pretrain.py:

* every DeepSeek-V3, GPT-OSS and Qwen3 recipe sets moe_router_fusion True
  (and Qwen3's moe_router_force_load_balancing, which the recipe notes is
  required for dropless routing: balanced expert load, moe_imbalance 1);
* cuda_graph_impl "transformer_engine" with a cuda_graph_scope: a scope with
  "attn" captures attention and the router (TrainingSpec.cuda_graphs, as
  planner.simulate.launches prices partial graphs for dropless routing); a
  scope of only "moe_router"/"moe_preprocess" replays the router and the
  dispatcher's preprocessing, attention eager (TrainingSpec.moe_router_graphs);
* moe_a2a_overlap (Megatron-Core --overlap-moe-expert-parallel-comm):
  TrainingSpec.moe_a2a_overlap;
* recompute_modules ("mla_up_proj", "moe_act", "layernorm"): the
  performance scripts' set_workload_base_configs turns
  recompute_granularity "selective" on with them (DeepSeek-V3's common
  settings set it too), and the list replaces Megatron-Core's default
  ["core_attn"]: Layout.recompute_modules, priced by
  planner.memory.activations.RECOMPUTED_TERMS and planner.simulate.recompute.
  Not for the 25.11 GPT-OSS rows: scripts/performance/utils/helpers.py's
  set_recompute_overrides set only recompute_modules until commit 6afd5c74b
  ("selective recompute", 2025-12-10) added the granularity, after those
  rows were measured (published 2025-12-04 and 2025-12-09, below); GPT-OSS's
  recipe and provider set no granularity, and Megatron-Core 0.15 recomputes
  layernorm (transformer_layer.py) and moe_act (moe/experts.py) only under
  "selective", so those runs recomputed nothing;
* moe_flex_dispatcher_backend "hybridep" / "deepep" (the flex token
  dispatcher instead of the all-to-all one): listed, not modelled.

GPT-OSS kernels, checked in the sources because its rows are predicted fast:
attention with learnable sinks (softmax_type "learnable", 128-token window
on every other layer) runs fused. Bridge v0.2.2 pins Transformer Engine
2.9 (v0.3.0: 2.10-2.12) and falls back to Megatron's local attention only
below TE 2.8; TE 2.9's get_attention_backend drops FlashAttention for a
non-vanilla softmax but keeps cuDNN's arbitrary-seqlen kernel, which
fused_attn.cpp accepts for learnable softmax from cuDNN 9.13.1 (TE 2.9 utils.py:
sliding windows (left, 0) stay on cuDNN's F16_arbitrary_seqlen backend,
which Megatron's window (128, 0) is). Memory rules the unfused path out as
well: TE's UnfusedDotProductAttention keeps [b, 64, s, s] probabilities,
8.6 GB per layer at 4 x 4096 (and at 1 x 8192), more than the GPUs hold
over 36 layers. So the rows keep TrainingSpec attention "fused". The clamped GLU (quick_gelu,
glu_linear_offset 1, clamp 7) is NOT one fused kernel: Megatron-Core
0.15-0.18 TEGroupedMLP calls weighted_bias_quick_geglu_impl under
bias_activation_fusion (the provider sets it), and that function
(megatron/core/fusions/fused_bias_geglu.py) chunks fc1's output, clamps
each half and concatenates them in eager PyTorch before the fused kernel,
and builds the offset as torch.tensor(1.0, device=cuda) on every call (a
blocking host-to-device copy: one stream synchronisation per MoE layer's
activation, and per recomputation of it under moe_act; pytorch/pytorch
issue 120996). ModelSpec.glu_clamp
(config.json swiglu_limit) prices the clamp's memory passes and operations
(planner.simulate.recompute.GLU_CLAMP_PASSES_*, planner.simulate.launches).
The experts' fc2 biases are not fused either: TEGroupedMLP builds fc2 with
skip_bias_add and _apply_bias adds bias * probability per local expert in
eager PyTorch, then concatenates (EXPERT_BIAS_PASSES_*, expert_bias_ops).
The synchronisation itself is not priced: it falls right after fc1 in the
forward and right before fc2's backward in the recomputation, so the host
regains its lead while the expert GEMMs run; an operation-level timeline of
the GB200 4 x 4096 layer (the planner's GPU times, 86 us per host operation)
puts it at ~2% of the step, under the p-norm's own overlap error.

Which runs the 25.11 GPT-OSS rows are: the table first printed (docs commit
44dae92b0, 2025-12-04) the v0.2.2 presets on GB300 and GB200 (mb 4 x 4096,
GBS 512: 18618 and 15754 tokens/s/GPU) and replaced them on 2025-12-09
(00b7660be) with runs at 8192 tokens, GBS 1280, GB300 mb 2 and GB200 mb 1:
the presets of branch gaod/r0.2.0_test (6b296ac10..4a82e1651, 2025-12-06),
whose set_gpt_oss_common_configs sets seq_length 8192, whose GB300 preset
keeps the attention + router graphs and whose GB200 preset runs the flex
dispatcher with HybridEP (moe_flex_dispatcher_backend "hybridep", applied
through apply_flex_dispatcher_backend, 32 SMs) beside recompute_modules
layernorm and moe_act (inert then, above): the dispatcher is listed for
that row, not modelled. The B200 and H100 rows (EP 8 mb 4, and mb 4 over
PP 4 with a GA that disagrees) match no preset in the file's history (up to
2025-11-20 every GPU ran the base EP 8, mb 8, full-iteration CUDA graphs;
then B200 EP 64 and H100 mb 1); they keep the v0.2.2 options but the
recomputation.

What is still unexplained (measured per layer and micro-batch on these rows,
after the clamp and the biases): GPT-OSS runs 1.76 us per token and layer
on GB200 at 4 x 4096 in both releases (26.02, and 25.11's first table), 1.4x
what the GEMM, attention, memory-bound and all-to-all terms price (1.23 us).
The shortfall scales with the GPU work, not with the host's operations: the
26.02 GB300 row (attention and router replayed as graphs, no recomputation:
about 0.6 of GB200's host operations) and the GB200 row (eager, recomputing)
miss by the same share (-20.6%, -20.9%), which a host term would not do;
scaling the routed experts' GEMMs or the memory-bound passes fits both,
which these rows cannot tell apart. B300 (800 Gbit/s NICs) runs the EP64
rows no faster than B200 (400 Gbit/s): 54.5 vs 56.6 ms per layer and
micro-batch, as if its network all-to-all ran at B200's rate (a network
figure, not a GPT-OSS one). The 26.02.01 patch container's table (docs
commit 2c2425ace, not among these rows) ran both at EP 8 inside the node:
13722 (B200) and 15031 (B300) tokens/s/GPU, 1.7x and 1.8x their EP 64 rows,
so the EP 64 rows' extra time is the network all-to-all, as long on B300 as
on B200: 4.2 s a step, against 4.75 s for its 238 GB per GPU (4 passes x
5 micro-batches x 36 layers x 7/8 of 377 MB) at 400 Gbit/s line rate, so it
runs near line rate (EP 8 pays costs EP 64 does not), where the profile's
all_to_all_net_efficiency (0.569, fitted on DGX Cloud H100 rows) prices
8.7 s and makes the B200 row slow. Qwen3-30B-A3B on H100 FP8 runs 3.9-4.1 us per
token and layer on both releases (mb 2 over 1-layer chunks with the
all-to-all dispatcher, mb 1 over 2-layer chunks with DeepEP), 3.3x the model,
where B200 runs 2.1 at mb 1 (priced right only through the Grace host cost
it falls back to).

Keys: (release, system, model); a missing key means none of these options.

DeepSeek-V3's pipeline split is the recipe's, not Megatron's default
(recipes/deepseek/deepseek_v3.py set_deepseek_v3_pipeline_model_parallel_layout,
and the GB300 preset's pp_layout "Et*4|(t*4|)*14tmL"): over 16 chunks the
first holds the embedding and 4 layers, 14 hold 4, the last 1 layer with the
MTP layer and the loss; over 8 chunks 8 layers each, 5 in the last; over 4
chunks 16, 16, 16, 13.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeRecipe:
    cuda_graphs: bool = False  # graph scope includes attention
    router_only_graphs: bool = False  # scope moe_router/moe_preprocess only
    a2a_overlap: bool = False
    dispatcher: str = "alltoall"  # alltoall | hybridep | deepep
    recompute_modules: tuple[str, ...] = ()  # selective recomputation of these modules (none: no recompute)


_HYBRID = "hybridep"
RECIPES: dict[tuple[str, str, str], MoeRecipe] = {
    # 25.11: Megatron-Bridge v0.2.2
    ("25.11", "gb300", "deepseek-v3"): MoeRecipe(cuda_graphs=True, dispatcher=_HYBRID, recompute_modules=("moe_act",)),
    ("25.11", "gb200", "deepseek-v3"): MoeRecipe(router_only_graphs=True, dispatcher=_HYBRID,
                                                 recompute_modules=("mla_up_proj",)),
    ("25.11", "b200", "deepseek-v3"): MoeRecipe(recompute_modules=("mla_up_proj",)),
    ("25.11", "gb300", "gpt-oss-120b"): MoeRecipe(cuda_graphs=True),
    # the published row's run: branch gaod/r0.2.0_test's GB200 preset (module docstring)
    ("25.11", "gb200", "gpt-oss-120b"): MoeRecipe(dispatcher=_HYBRID),
    ("25.11", "gb300", "qwen3-30b-a3b"): MoeRecipe(router_only_graphs=True, dispatcher=_HYBRID),
    ("25.11", "gb200", "qwen3-30b-a3b"): MoeRecipe(router_only_graphs=True, dispatcher=_HYBRID),  # FP8-MX preset
    ("25.11", "b200", "qwen3-30b-a3b"): MoeRecipe(router_only_graphs=True),
    ("25.11", "h100", "qwen3-30b-a3b"): MoeRecipe(a2a_overlap=True),
    ("25.11", "gb300", "qwen3-235b-a22b"): MoeRecipe(router_only_graphs=True, dispatcher=_HYBRID),
    ("25.11", "gb200", "qwen3-235b-a22b"): MoeRecipe(cuda_graphs=True, dispatcher=_HYBRID),
    ("25.11", "b200", "qwen3-235b-a22b"): MoeRecipe(a2a_overlap=True),
    ("25.11", "h100", "qwen3-235b-a22b"): MoeRecipe(a2a_overlap=True),
    # 26.02: Megatron-Bridge v0.3.0, V2 presets
    ("26.02", "gb300", "deepseek-v3"): MoeRecipe(dispatcher=_HYBRID, recompute_modules=("mla_up_proj",)),  # FP8 V2
    ("26.02", "gb200", "deepseek-v3"): MoeRecipe(cuda_graphs=True, dispatcher=_HYBRID,
                                                 recompute_modules=("mla_up_proj",)),
    ("26.02", "b300", "deepseek-v3"): MoeRecipe(dispatcher=_HYBRID, recompute_modules=("mla_up_proj",)),
    ("26.02", "b200", "deepseek-v3"): MoeRecipe(dispatcher=_HYBRID, recompute_modules=("mla_up_proj",)),
    ("26.02", "gb300", "gpt-oss-120b"): MoeRecipe(cuda_graphs=True),
    ("26.02", "b300", "gpt-oss-120b"): MoeRecipe(cuda_graphs=True),
    ("26.02", "gb200", "gpt-oss-120b"): MoeRecipe(recompute_modules=("layernorm", "moe_act")),
    ("26.02", "b200", "gpt-oss-120b"): MoeRecipe(recompute_modules=("layernorm", "moe_act")),
    ("26.02", "h100", "gpt-oss-120b"): MoeRecipe(recompute_modules=("layernorm", "moe_act")),
    ("26.02", "gb300", "qwen3-30b-a3b"): MoeRecipe(router_only_graphs=True, dispatcher=_HYBRID),
    ("26.02", "gb200", "qwen3-30b-a3b"): MoeRecipe(router_only_graphs=True, dispatcher=_HYBRID),  # FP8-MX preset
    ("26.02", "b300", "qwen3-30b-a3b"): MoeRecipe(router_only_graphs=True, dispatcher=_HYBRID),
    ("26.02", "b200", "qwen3-30b-a3b"): MoeRecipe(router_only_graphs=True),
    ("26.02", "h100", "qwen3-30b-a3b"): MoeRecipe(a2a_overlap=True, dispatcher="deepep"),
    ("26.02", "gb300", "qwen3-235b-a22b"): MoeRecipe(cuda_graphs=True, dispatcher=_HYBRID),  # FP8 V2
    ("26.02", "gb200", "qwen3-235b-a22b"): MoeRecipe(cuda_graphs=True, dispatcher=_HYBRID),
    ("26.02", "b300", "qwen3-235b-a22b"): MoeRecipe(a2a_overlap=True),
    ("26.02", "b200", "qwen3-235b-a22b"): MoeRecipe(),
    ("26.02", "h100", "qwen3-235b-a22b"): MoeRecipe(a2a_overlap=True),
}


def recipe(release: str, system: str, model: str) -> MoeRecipe:
    return RECIPES.get((release, system, model), MoeRecipe())


def unmodelled(r: MoeRecipe) -> list[str]:
    """The recipe's options the planner prices no term for."""
    out = []
    if r.dispatcher != "alltoall":
        out.append(f"{r.dispatcher} dispatcher")
    return out


def deepseek_v3_chunk_layers(chunks: int) -> tuple[int, ...] | None:
    """Decoder layers per pipeline chunk of Megatron-Bridge's DeepSeek-V3 layout (61 layers), None
    where the recipe sets none."""
    return {16: (4,) * 15 + (1,), 8: (8,) * 7 + (5,), 4: (16, 16, 16, 13)}.get(chunks)

"""Megatron (NVIDIA/Megatron-LM, Megatron-Core; what NeMo and Megatron-Bridge run), by release.

Megatron-LM as the 2021-22 papers ran it, then Megatron-Core as people run it
today: Transformer Engine's fused attention and FP8, the distributed
optimizer's gradient reduction overlapped with the backward, the TP
all-reduce of the input gradient under the weight-gradient GEMM;
vocabulary-parallel embedding, output and cross entropy; gradients
accumulated in a persistent contiguous buffer, so every state and buffer is
counted at once (the papers' accounting); a flat, evenly sharded optimizer;
sequence parallel saves shards and gathers again in the backward. It
reproduces published NeMo H100 runs within a few percent
(bench/accuracy_published.py, bench/accuracy_dgxc.py).

Releases: `2021` (the Narayanan et al. 2021 runs), `2022` (Korthikanti et al.
2022; the Megatron-DeepSpeed fork behind vTrain's measurements), and
Megatron-Core `core-0.7` to `core-0.16` (NeMo containers 24.05 to 26.02:
24.05 core-0.7, 24.07 core-0.8, 24.09 core-0.9, 24.12 core-0.10, 25.02
core-0.11, 25.04 core-0.12, Megatron-Bridge 25.09 core-0.14, 25.11
core-0.15, 26.02 core-0.16). Each change below names the first of these
whose tag contains its commit (git merge-base --is-ancestor), or the patch
that brought it into that release's branch.
"""

from __future__ import annotations

from planner.engines.base import Engine
from planner.engines.mechanisms import (
    GROUPED_EXPERTS,
    MEGATRON_DDP,
    MEGATRON_EXPERTS_PROBS,
    MEGATRON_LOCAL_DDP,
    MEGATRON_MODEL,
    MEGATRON_PIPELINE,
    MEGATRON_TP,
    MEGATRON_TP_2021,
    TE_P2P_RING,
    TE_UB_DEFAULT,
    CommSms,
    Loss,
    TpOverlapSms,
)
from planner.engines.precision import TE_FP8, Fp8Recipe
from planner.engines.releases import Change, Release, build_releases

RING = CommSms(1, True)  # RingExchangeOverlapCfg(num_sm=1, set_sm_margin=True)


def _pipe(sms: int) -> CommSms:  # PipelineOverlapCfg(num_sm=sms, set_sm_margin=True)
    return CommSms(sms, True)


def _ub(proj: CommSms, fc2: CommSms, qkv_dgrad: int, fc1_dgrad: int, qkv_wgrad: int, fc1_wgrad: int
        ) -> TpOverlapSms:
    """A userbuffers config: proj/fc2 fprop reduce-scatters as given, the bulk backward overlaps with num_sm
    SMs and set_sm_margin False (every NeMo and Megatron-Bridge config sets it so for bulk)."""
    return TpOverlapSms((proj, fc2), (CommSms(qkv_dgrad, False), CommSms(fc1_dgrad, False)),
                        (CommSms(qkv_wgrad, False), CommSms(fc1_wgrad, False)))


# Named userbuffers configs (TrainingSpec.tp_overlap_cfg, `--recipe tp_overlap_cfg=NAME`): the SMs each
# overlapped TP collective takes from its GEMM. NeMo 2.2-2.3's
# nemo/collections/llm/recipes/tp_overlap_configs/userbuffers.py (the performance recipes of NeMo
# 25.02/25.04: gpt3_175b, llama3_70b, llama31_405b, nemotron4_340b; the b200 configs run on GB200 too):
_H100_H8192 = _ub(_pipe(24), _pipe(16), 4, 2, 24, 4)
_H100_H16384 = _ub(_pipe(24), _pipe(8), 2, 2, 24, 2)
_B200_H18432 = _ub(RING, _pipe(24), 8, 2, 32, 8)
NEMO_UB_CONFIGS: tuple[tuple[str, TpOverlapSms], ...] = (
    ("userbuffers_bf16_h100_h12288_tp4_mbs1_seqlen2048", _ub(_pipe(24), RING, 4, 2, 4, 4)),
    ("userbuffers_fp8_h100_h12288_tp4_mbs1_seqlen2048", _ub(_pipe(24), RING, 4, 2, 4, 4)),
    ("userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192", _H100_H8192),
    ("userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192", _H100_H8192),
    ("userbuffers_bf16_h100_h16384_tp8_cp2_mbs1_seqlen8192", _H100_H16384),
    ("userbuffers_fp8_h100_h16384_tp8_cp2_mbs1_seqlen8192", _H100_H16384),
    ("userbuffers_bf16_b200_h16384_tp4_cp2_mbs1_seqlen8192", _ub(_pipe(32), _pipe(8), 8, 2, 24, 2)),
    ("userbuffers_fp8_b200_h16384_tp4_cp2_mbs1_seqlen8192", _ub(RING, RING, 8, 2, 32, 8)),
    ("userbuffers_bf16_b200_h18432_tp8_mbs1_seqlen4096", _B200_H18432),
)
# Megatron-Bridge's src/megatron/bridge/training/comm_overlap.py (the 25.09-26.02 performance scripts'
# Llama 3 70B / 3.1 405B fp8 configs): the forward reduce-scatters moved to ring exchange
BRIDGE_UB_CONFIGS: tuple[tuple[str, TpOverlapSms], ...] = (
    ("userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192", _ub(RING, RING, 4, 2, 24, 4)),
    ("userbuffers_fp8_h100_h16384_tp8_cp2_mbs1_seqlen8192", _ub(RING, RING, 2, 2, 24, 2)),
    ("userbuffers_fp8_b200_h8192_tp2_mbs1_seqlen8192", _ub(RING, RING, 4, 2, 24, 4)),
    ("userbuffers_fp8_b200_h16384_tp4_cp2_mbs1_seqlen8192", _ub(RING, RING, 8, 2, 32, 8)),
)

# Megatron-LM of April 2021 (Narayanan et al., SC'21): its own softmax attention over materialized
# scores, --DDP-impl local all-reducing after forward_backward_func, the TP all-reduce in line
_BASE = Engine(
    "megatron", "", "", data_parallel=MEGATRON_LOCAL_DDP, tensor_parallel=MEGATRON_TP_2021, loss=Loss("megatron"),
    pipeline=MEGATRON_PIPELINE, context_parallel=TE_P2P_RING, model_code=MEGATRON_MODEL, experts=GROUPED_EXPERTS,
    attention="eager", recompute_kinds=("none", "full"), zero_stages=(0,), pp_schedules=("1f1b", "interleaved-1f1b"),
    sequence_parallel=False, cp_needs_fused=True, context_parallel_runs=False)

RELEASES: dict[str, Engine] = build_releases(_BASE, (
    Release("2021", "Megatron-LM of April 2021 (Narayanan et al., SC'21)"),
    Release("2022", "Megatron-LM of May 2022 (Korthikanti et al. 2022; Megatron-DeepSpeed's base)"),
    Release("core-0.7", "Megatron-Core 0.7.0 (NeMo 24.05)"),
    Release("core-0.8", "Megatron-Core 0.8.0 (NeMo 24.07)"),
    Release("core-0.9", "Megatron-Core 0.9.0 (NeMo 24.09)"),
    Release("core-0.10", "Megatron-Core 0.10.0 (NeMo 24.12)"),
    Release("core-0.11", "Megatron-Core 0.11.0 (NeMo 25.02)"),
    Release("core-0.12", "Megatron-Core 0.12.0 (NeMo 25.04)"),
    Release("core-0.13", "Megatron-Core 0.13.0 (NeMo 25.07)"),
    Release("core-0.14", "Megatron-Core 0.14.0 (Megatron-Bridge 25.09)"),
    Release("core-0.15", "Megatron-Core 0.15.0 (Megatron-Bridge 25.11)"),
    Release("core-0.16", "Megatron-Core 0.16.0 (Megatron-Bridge 26.02)"),
), (
    Change("2022", "16c90445e7 of 2021-09-02 (--async-tensor-model-parallel-allreduce)",
           "the input-gradient all-reduce under the weight-gradient GEMM", {"tensor_parallel": MEGATRON_TP}),
    Change("2022", "329fe5820f of 2022-02-10 (--use-distributed-optimizer)", "ZeRO-1", {"zero_stages": (0, 1)}),
    Change("2022", "cfd2e21607 of 2022-04-28 (--sequence-parallel)", "sequence parallelism",
           {"sequence_parallel": True}),
    Change("2022", "bbab79f869 of 2022-05-16 (--recompute-granularity, --recompute-method)",
           "selective (core attention) and partial full recomputation",
           {"recompute_kinds": ("none", "selective", "full"), "partial_recompute": True}),
    Change("core-0.7", "2d5220a424 of 2023-08-16 (--overlap-grad-reduce)",
           "bucketed gradient reduction under the backward", {"data_parallel": MEGATRON_DDP}),
    Change("core-0.7", "1b7a3836bc of 2023-08-24 (Transformer Engine FP8 arguments)", "FP8 GEMMs",
           {"fp8": Fp8Recipe("transformer-engine", weight_copy=True, saves_fp8_inputs=True, fp8_all_gather=False)}),
    Change("core-0.7", "df7f8d5215 of 2023-10-12 (--context-parallel-size)", "context parallelism (TE p2p ring)",
           {"context_parallel_runs": True}),
    Change("core-0.7", "116ffddc58 of 2023-10-23 (--tp-comm-overlap)",
           "TP communication overlap by Transformer Engine's userbuffers",
           {"async_tp_option": "--tp-comm-overlap", "tp_overlap_default": TE_UB_DEFAULT,
            "tp_overlap_configs": NEMO_UB_CONFIGS}),
    Change("core-0.7", "c59ac8b4d3 of 2023-12-14 (CPU offload)", "activation offload to the host",
           {"activation_offload": True}),
    Change("core-0.7", "e7b74a4b7e of 2024-04-02 (--transformer-impl transformer_engine by default)",
           "Transformer Engine's fused attention", {"attention": "fused"}),
    Change("core-0.9", "033d8b0de5 of 2024-09-05 (--fp8-param-gather)", "8-bit parameters", {"fp8": TE_FP8}),
    Change("core-0.12", "d165a8548b of 2025-02-26 (Megatron FSDP, --use-custom-fsdp)", "ZeRO-2/3",
           {"zero_stages": (0, 1, 2, 3)}),
    Change("core-0.12", "60007c93d3 of 2025-02-14 (--use-precision-aware-optimizer)", "16-bit Adam moments",
           {"optimizer_dtypes": ("fp32", "bf16", "fp16")}),
    Change("core-0.12", "megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py (--optimizer-cpu-offload, "
           "with --use-precision-aware-optimizer and the distributed optimizer)", "optimizer state on the host",
           {"offload_kinds": ("none", "optimizer")}),
    Change("core-0.12", "0f60adbd30 of 2025-03-08 (cross_entropy_fusion_impl te)",
           "Transformer Engine's parallel cross entropy", {"loss": Loss("megatron", fused="transformer-engine")}),
    Change("core-0.13", "2659630721 of 2025-04-09 (memory-efficient token permutation, permuted_probs)",
           "the router's probabilities weigh the experts' activation", {"experts": MEGATRON_EXPERTS_PROBS}),
    Change("core-0.12", "3b141a2471 of 2025-04-05 (--recompute-modules), in core 0.12.0 through 8d209ba2aa "
           "(core_r0.12.0 patches for nemo25.04)", "selective recomputation by module", {"recompute_modules": True}),
    Change("core-0.14", "Megatron-Bridge 25.09's comm_overlap.py", "the Bridge's userbuffers configs",
           {"tp_overlap_configs": BRIDGE_UB_CONFIGS}),
))

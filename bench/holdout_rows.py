"""How bench/accuracy_holdout.py builds a plan from each published row: layout, recipe, engine release.

torchtitan rows run as engine "torchtitan": FSDP2 over every GPU (ZeRO-3),
their stated checkpointing ("op" = per-op SAC, "full"; "selective layer",
every 2nd block whole, is not expressible), compile and float8 as stated,
fp32 gradient reduction. Where a row gives the measured memory, the predicted
peak is printed beside it. The A100 rows' recipe as torchtitan ran it (commit
0413364 of 2024-04-24, its train_configs and parallelize_llama.py): FSDP2
per block, bf16 parameters reduced in fp32, resharded after forward (all but
the last block, not modelled), SDPA causal attention (FlashAttention-2 on
A100), per-op SAC saving all mm outputs but every second one, eager, local
batch and sequence length as typed; Llama 3 8B and Llama 2 13B ran a Triton
fused RMSNorm, the rest eager RMSNorm (not told apart: every row prices its
memory-bound work at the engine's eager rate). The A100 profile is fitted on
Megatron-DeepSpeed, so torchtitan runs there with the H100 profile's
PyTorch-native memory-bound factor and no attention factor
(planner.simulate.calibration._TRANSFERRED_FACTORS says why), never fitted on
these rows.

Each NeMo row is planned with its stated layout and recipe, engine "megatron":

* FSDP > 0 is Megatron FSDP, ZeRO-3 over the data-parallel ranks; FSDP 0 is
  the distributed optimizer (ZeRO-1); sequence parallel whenever tp > 1;
  interleaved 1F1B when VP is given; fused attention; no recomputation (the
  Llama recipes set none on these rows), GPT-3 175B of 24.07 selective;
* precision: FP8-CS and the 24.07 FP8 as per-tensor fp8, FP8-MX as mxfp8;
  NVFP4 rows cannot be expressed (no 4-bit GEMM precision);
* gradients kept and reduced in bf16 (the Megatron-Bridge performance
  scripts turn grad_reduce_in_fp32 off; NeMo 24.07's launcher examples pass
  optim.grad_sync_dtype=bf16);
* Llama 3.1 405B's 126 layers over pp*vp chunks: Megatron's split with one
  layer fewer in the first and last chunk (bench/dgxc_rows._stage_layers);
  128 chunks would leave one empty, such rows are not expressible. MoE rows
  whose layers do not divide evenly get the balanced split;
* TP communication overlap (TrainingSpec.async_tp, priced by
  planner.simulate.tp_overlap) on the Megatron-Bridge rows whose recipe ran
  it: the Llama 3 70B and 3.1 405B performance scripts
  (Megatron-Bridge scripts/performance/configs/llama/llama3_llm_pretrain.py,
  llama31_llm_pretrain.py) keep the recipes' tp_comm_overlap=True (off for
  NVFP4 on Blackwell; CommOverlapConfig drops it where tp = 1) and pick a
  userbuffers config by GPU and precision, whose SM claims
  (BRIDGE_UB_CONFIGS, from src/megatron/bridge/training/comm_overlap.py)
  ride as the row's tp_overlap_cfg (the userbuffers config by name); every Blackwell part takes the b200
  config. The MoE rows with tp > 1 (Qwen3-235B on H100) ran without it
  (scripts/performance/configs/qwen/qwen3_llm_pretrain.py:
  tp_comm_overlap=False). The files read are the repository's current ones,
  not each release's tag. NeMo 24.07 rows are left as they were;
* activation offloading to the host as the recipe sets it (the FSDP Llama
  rows' cpu_offloading_num_layers: Layout.activation_offload_layers);
  recipe details the planner has no term for are listed per row (CUDA
  graphs of the dense rows are not modelled);
* MoE rows run their Megatron-Bridge preset's MoE options
  (bench/bridge_moe_recipes.py): router fusion, the CUDA graph scope
  (attention + router, or router + dispatch preprocessing only), the expert
  all-to-all overlap, DeepSeek-V3's own pipeline split, the selectively
  recomputed modules (Layout.recompute_modules); the flex dispatcher
  (HybridEP/DeepEP) is listed per row, not modelled.

A row is INCONSISTENT, and left out of the MAPE, when its Model TFLOP/s per
token differs by more than 3% from the median of the same model and
sequence length in the same source (a misprinted throughput or layout), or
when the table's GA (kept as `ga` where it matters) disagrees with
GBS / (dp * MBS).
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bridge_moe_recipes import deepseek_v3_chunk_layers  # noqa: E402
from bridge_moe_recipes import recipe as moe_recipe  # noqa: E402
from bridge_moe_recipes import unmodelled as moe_unmodelled  # noqa: E402
from dgxc_rows import _stage_layers  # noqa: E402

from planner.engines import get_engine  # noqa: E402
from planner.layout import Layout, balanced_layers  # noqa: E402
from planner.model.presets import PRESETS  # noqa: E402
from planner.model.spec import ModelSpec  # noqa: E402
from planner.plan import validate  # noqa: E402
from planner.training import TrainingSpec  # noqa: E402
from topologies.cluster import Cluster  # noqa: E402
from topologies.cluster_load import load_cluster  # noqa: E402
from topologies.errors import MeshplanError  # noqa: E402

DATA = (REPO / "bench" / "data" / "nemo_perf_summary.json", REPO / "bench" / "data" / "torchtitan_perf.json")
CLUSTERS = {"a100": "dgx-a100-80g", "h100": "dgx-h100", "h200": "dgx-h200", "b200": "dgx-b200", "b300": "dgx-b300",
            "gb200": "gb200-nvl72", "gb300": "gb300-nvl72"}
FLOPS_TOLERANCE = 0.03  # per-token Model TFLOP/s spread allowed within one model and sequence length
# Megatron-Bridge userbuffers configs (planner.engines.megatron.BRIDGE_UB_CONFIGS) the Llama performance
# scripts pick for fp8/mxfp8, keyed by (H100 or Blackwell, hidden)
BRIDGE_UB_CONFIGS: dict[tuple[bool, int], str] = {
    (False, 8192): "userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192",
    (False, 16384): "userbuffers_fp8_h100_h16384_tp8_cp2_mbs1_seqlen8192",
    (True, 8192): "userbuffers_fp8_b200_h8192_tp2_mbs1_seqlen8192",
    (True, 16384): "userbuffers_fp8_b200_h16384_tp4_cp2_mbs1_seqlen8192",
}
# The engine release each source ran: Megatron-Core of each NeMo container (24.07: core 0.8; Megatron-Bridge
# 25.09/25.11/26.02: core 0.14/0.15/0.16), torchtitan's commits (planner.engines.torchtitan)
ENGINE_RELEASE = {("nemo-24.07", "24.07"): "megatron@core-0.8", ("megatron-bridge", "25.09"): "megatron@core-0.14",
                  ("megatron-bridge", "25.11"): "megatron@core-0.15", ("megatron-bridge", "26.02"): "megatron@core-0.16",
                  ("torchtitan", "2024 (docs/performance.md)"): "torchtitan@2024-04",
                  ("torchtitan", "2025-06"): "torchtitan@2025-06"}
BRIDGE_TP_OVERLAP_MODELS = ("llama3-70b", "llama3-405b")  # dense recipes with tp_comm_overlap=True


@dataclass(frozen=True)
class PerfRow:
    id: str
    source: str
    release: str
    gpu: str  # the system's GPU: a100 | h100 | h200 | b200 | b300 | gb200 | gb300
    precision: str
    model: str
    moe: bool
    model_spec: ModelSpec | None
    training: TrainingSpec | None
    layout: Layout | None  # None: not expressible (reason)
    gpus: int
    measured_s: float
    tflops_per_token: float | None  # the source's Model TFLOP/s per GPU over its tokens/s per GPU
    engine: str = "megatron"
    memory_gib: float | None = None  # measured, where the source gives it
    unmodelled: str = ""  # recipe features the planner has no term for
    reason: str = ""
    ga_mismatch: bool = False  # the table's GA disagrees with GBS / (dp * MBS)
    moe_recipe: str = ""  # MoE recipe options of the row's Megatron-Bridge preset not modelled (bench/bridge_moe_recipes)

    @property
    def expressible(self) -> bool:
        return self.layout is not None

    def cluster(self) -> Cluster:
        return load_cluster(CLUSTERS[self.gpu], self.gpus)


def _model(name: str, models: dict, seq: int, no_mtp: bool) -> ModelSpec:
    entry = models[name]
    if entry == "preset":
        spec = PRESETS[name]
        spec = replace(spec, max_seq_len=max(spec.max_seq_len, seq))
        return replace(spec, mtp_layers=0) if no_mtp else spec
    shape = dict(n_layers=entry["n_layers"], hidden=entry["hidden"], n_heads=entry["n_heads"],
                 n_kv_heads=entry["n_kv_heads"], head_dim=entry["hidden"] // entry["n_heads"],
                 ffn_hidden=entry["ffn_hidden"], vocab=entry["vocab"], max_seq_len=seq)
    if entry["arch"] == "gpt":
        return ModelSpec(name=name, mlp="gelu", norm="layernorm", position="learned", tie_embeddings=True,
                         bias=True, **shape)
    # Nemotron: squared-ReLU MLP without gate as the 2-matrix MLP, LayerNorm, RoPE, untied (bench/dgxc_rows.py)
    return ModelSpec(name=name, mlp="gelu", norm="layernorm", position="rope", **shape)


def _row(rec: dict, models: dict, tp_overlap: bool = True) -> PerfRow:
    tp, pp, cp, vp, ep = rec["tp"], rec["pp"], rec["cp"], rec["vp"] or 1, rec["ep"] or 1
    gpus, mb, gbs, seq = rec["gpus"], rec["micro_batch"], rec["global_batch"], rec["seq"]
    tps = rec["tokens_per_s_per_gpu"]
    moe = bool(rec.get("moe"))
    unmodelled: list[str] = []
    label = rec["model"] + (" (no MTP)" if rec.get("no_mtp") else "")  # fewer model FLOPs per token
    common = dict(id=rec["id"], source=rec["source"], release=rec["release"], gpu=rec["system"],
                  precision=rec["precision"], model=label, moe=moe, gpus=gpus,
                  measured_s=gbs * seq / (tps * gpus), engine=ENGINE_RELEASE[(rec["source"], rec["release"])],
                  tflops_per_token=rec["model_tflops_per_gpu"] / tps if rec["model_tflops_per_gpu"] else None,
                  memory_gib=rec.get("memory_gib"), unmodelled=", ".join(unmodelled),
                  ga_mismatch=bool(rec.get("ga")) and rec["ga"] * (gpus // (tp * pp * cp)) * mb != gbs)
    modules: tuple[str, ...] = ()  # Megatron-Core's selectively recomputed modules, where the recipe names them
    if rec["precision"] == "nvfp4":
        return PerfRow(model_spec=None, training=None, layout=None, reason="NVFP4: no 4-bit GEMM precision", **common)
    model = _model(rec["model"], models, seq, bool(rec.get("no_mtp")))
    nemo1 = rec["source"] == "nemo-24.07"
    # bf16 gradient buffers and reduction: the Megatron-Bridge performance scripts turn grad_reduce_in_fp32
    # off; NeMo 24.07's launcher examples (NeMo-Framework-Launcher examples/training/*/h100/*_fp8*.sh) pass
    # optim.grad_sync_dtype=bf16; torchtitan reduces in fp32 (its mixed_precision_reduce default)
    bf16_grads = rec.get("engine", "megatron") == "megatron"
    bridge = rec["source"] == "megatron-bridge"
    overlapped = bridge and rec["model"] in BRIDGE_TP_OVERLAP_MODELS and tp > 1 and tp_overlap
    # Megatron-Bridge's performance scripts: fp8 and mxfp8 recipes with fp8_param_gather=True (8-bit parameters,
    # src/megatron/bridge/training/mixed_precision.py), Transformer Engine's cross entropy for every model
    # (scripts/performance/utils/overrides.py: cross_entropy_fusion_impl="te", the provider's
    # cross_entropy_loss_fusion=True)
    # (torchtitan compiles its loss with --training.compile from its 2025-06 release: the engine's rule)
    training = TrainingSpec(seq_len=seq, global_batch_size=gbs, dtype="bf16", precision=rec["precision"],
                            attention="fused", grad_dtype="bf16" if bf16_grads else "fp32",
                            compile=bool(rec.get("compile")), async_tp=overlapped,
                            fp8_params=bridge and rec["precision"] in ("fp8", "mxfp8"),
                            fused_cross_entropy=bridge,
                            # the script's fp8 userbuffers config (every overlapped row here is fp8 or mxfp8)
                            tp_overlap_cfg=BRIDGE_UB_CONFIGS[(rec["system"] != "h100", model.hidden)] if overlapped
                            else "")
    if moe and bridge:  # the preset's MoE options (bench/bridge_moe_recipes.py)
        preset = moe_recipe(rec["release"], rec["system"], rec["model"])
        training = training.replace(moe_router_fusion=True, cuda_graphs=preset.cuda_graphs,
                                    moe_router_graphs=preset.router_only_graphs, moe_a2a_overlap=preset.a2a_overlap)
        common["moe_recipe"] = ", ".join(moe_unmodelled(preset))
        modules = preset.recompute_modules
    if rec.get("recompute") == "selective-layer":
        return PerfRow(model_spec=model, training=training, layout=None,
                       reason="checkpointing every 2nd block: a partial full recompute torchtitan's engine lacks",
                       **common)
    lps = _stage_layers(model.n_layers, pp * vp)
    if bridge and rec["model"] == "deepseek-v3" and deepseek_v3_chunk_layers(pp * vp):
        lps = deepseek_v3_chunk_layers(pp * vp)  # the recipe's own split (bench/bridge_moe_recipes.py)
    if lps is None and moe and model.n_layers >= pp * vp:
        lps = balanced_layers(model.n_layers, pp * vp)
    if lps is None:
        return PerfRow(model_spec=model, training=training, layout=None,
                       reason=f"{model.n_layers} layers over pp*vp = {pp * vp} chunks leaves an empty chunk", **common)
    dp = gpus // (tp * pp * cp)
    recompute = rec.get("recompute") or ("selective" if nemo1 and rec["model"] == "gpt3-175b" else "none")
    if modules:  # the Bridge preset's selective recomputation (bench/bridge_moe_recipes.py)
        recompute = "selective"
    try:
        layout = Layout(tp=tp, pp=pp, cp=cp, dp_shard=dp, ep=ep, zero_stage=3 if rec["fsdp"] else (1 if dp > 1 else 0),
                        micro_batch_size=mb, grad_accum_steps=gbs // (dp * mb), recompute=recompute,
                        sequence_parallel=tp > 1, pp_schedule="interleaved-1f1b" if vp > 1 else "1f1b",
                        virtual_stages=vp, layers_per_stage=lps,
                        activation_offload_layers=rec.get("activation_offload_layers") or 0,
                        recompute_modules=modules)
        cluster = load_cluster(CLUSTERS[rec["system"]], gpus)
        validate(model, cluster, training, layout)
        refusal = get_engine(common["engine"]).refusal(model, layout, "bf16", True, training)
        if refusal:
            raise MeshplanError(refusal)
    except MeshplanError as exc:
        return PerfRow(model_spec=model, training=training, layout=None, reason=str(exc).split("\n")[0][:120], **common)
    return PerfRow(model_spec=model, training=training, layout=layout, **common)


def load_rows(paths: tuple[Path, ...] = DATA, tp_overlap: bool = True) -> list[PerfRow]:
    """Every row; tp_overlap False prices the Megatron-Bridge rows' TP collectives without the overlap their
    scripts ran (--no-tp-overlap, and the GB200 fit's inputs: bench/accuracy_dgxc.bridge_gb200_rows)."""
    out = []
    for path in paths:
        doc = json.loads(path.read_text())
        out += [_row(rec, doc["models"], tp_overlap) for rec in doc["rows"]]
    return out


def inconsistent(rows: list[PerfRow]) -> set[str]:
    """Rows whose Model TFLOP/s per token is off the median of their model, sequence length and source."""
    groups: dict[tuple[str, str, float], list[PerfRow]] = {}
    for r in rows:
        if r.tflops_per_token is not None:
            groups.setdefault((r.source, r.model, r.training.seq_len if r.training else 0), []).append(r)
    out = set()
    for rs in groups.values():
        mid = statistics.median(r.tflops_per_token for r in rs)
        out |= {r.id for r in rs if abs(r.tflops_per_token / mid - 1.0) > FLOPS_TOLERANCE}
    return out | {r.id for r in rows if r.ga_mismatch}


def fitted(row: PerfRow) -> bool:
    """Rows a shipped profile was fitted on: the GB200 profile's fit (bench/accuracy_dgxc.py --fit --blackwell
    both) includes this source's dense GB200 rows, its Blackwell Ultra factor (part_sm_rate, bench/blackwell_parts.py)
    the 25.11 dense GB300 rows; every other row is held out."""
    dense_bridge = row.source == "megatron-bridge" and not row.moe
    return dense_bridge and (row.gpu == "gb200" or (row.gpu == "gb300" and row.release == "25.11"))

"""NVIDIA DGX Cloud Benchmarking's dense runs (shared/data/published/dgxc.json) as simulator inputs.

216 measured pre-training runs transcribed from the dgxc-benchmarking READMEs
(releases v24.11.1-v25.05.04); the dense rows (bf16 and fp8, H100 SXM and
GB200 NVL72) are read here, the MoE rows are left to the MoE bench. Each row
becomes (model, training, layout, cluster, engine) with nothing per row but
what the source states:

* stacks: NeMo/Megatron-Core + Transformer Engine rows run as engine
  "megatron" (distributed optimizer = ZeRO-1 over dp, sequence parallel
  whenever tp > 1, interleaved 1F1B when vp is given); the JAX stacks
  (MaxText Llama 2/3 70B, PaxML GPT-3) train with FSDP under XLA and are run
  as engine "meshplan", the PyTorch-native stack (FSDP = ZeRO-3 over
  fsdp_degree, else over dp); their "selective" rematerialization saves
  the matmul outputs, 8-bit ones included, as meshplan's per-op SAC list
  does (torchtitan's names aten.mm only, so under fp8 it would recompute
  every projection: Engine.op_sac_saves_mm); XLA fuses the elementwise
  work, as compile does;
* gradients: the v25 releases run NeMo 2.0's performance scripts, which
  turn off fp32 gradient reduction (grad_reduce_in_fp32 False: bf16
  gradient buffers); v24.11.1 ran NeMo 1.0's launcher with Megatron's fp32
  main gradients;
* TP communication overlap (DgxcRow.tp_comm_overlap, what the recipe ran;
  priced as TrainingSpec.async_tp unless tp_overlap=False, see
  bench/accuracy_dgxc.py --no-tp-overlap): every NeMo row with tp > 1 ran
  Transformer Engine's userbuffers (Megatron's --tp-comm-overlap):
  NeMo 1 yamls of v24.11.1/v25.02 (dgxc-benchmarking@35a9aec, @8f5cbb3:
  gpt3_175b_hydra.yaml and llama3.1_{70b,405b}.yaml ub_tp_comm_overlap: true,
  nemotron/configure.sh model.ub_tp_comm_overlap=True; llama3.1_8b.yaml has
  false, with tp 1), and NeMo 2's performance recipes of v25.04/v25.05 (NeMo
  v2.2.1/v2.3.0 recipes gpt3_175b, llama3_70b, llama31_405b, nemotron4_15b,
  nemotron4_340b: MegatronCommOverlapCallback(tp_comm_overlap=True); the
  dgxc pretrain_llama31.py asserts the callback and sets its ub config).
  What each overlap's communication kernels take from the GEMMs
  (TrainingSpec.tp_overlap_cfg, `--recipe tp_overlap_cfg=NAME`; priced by
  planner.simulate.tp_overlap.sm_share_s) is
  the recipe's userbuffers config (UB_CONFIGS: NeMo's
  tp_overlap_configs/userbuffers.py, by GPU, hidden size and precision);
  where NeMo ships none for the shape (Nemotron-4 15B and 340B on H100) the
  recipe passes no config and Transformer Engine's initialize_ub defaults
  run (planner.engines.TE_UB_DEFAULT). The NeMo 1 releases are given the
  NeMo 2 config of the same shape (taken to be the launcher's ub_cfg yaml
  it was ported from: not checked row by row);
* fp8: per-tensor FP8 on H100; on GB200 the v25.05 recipes run MXFP8 (same
  peak: the choice only matters for what is kept in memory);
* models: Llama as SwiGLU/RMSNorm/RoPE; GPT-3 with GELU, LayerNorm,
  learned positions, biases and tied embeddings; Nemotron-4's squared-ReLU
  MLP without gate as the 2-matrix MLP (gelu), LayerNorm, RoPE, untied;
* uneven pipelines: Llama 3.1 405B (126 layers) runs pp*vp = 64 chunks of
  2 with one layer fewer in the first and the last chunk (Megatron's
  account-for-embedding/loss split), which layers_per_stage expresses. The
  30-layer proxies (32 chunks, two of them empty) cannot be expressed: a
  chunk holds at least one layer here. They are counted as not expressible.

Rows the analysis of dgxc.json (notes/dgxc_analysis.md) flags as internally
inconsistent are all MoE rows or the uneven-pipeline ones above; none of the
dense rows fails the token/step-time identity.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from planner.layout import Layout
from planner.model.spec import ModelSpec
from planner.training import TrainingSpec
from topologies.cluster import Cluster
from topologies.cluster_load import load_cluster

# ../shared beside the checkout (a worktree one level deeper sees it two levels up)
_REPO = Path(__file__).resolve().parent.parent
DATA = next((p / "shared" / "data" / "published" / "dgxc.json" for p in (_REPO.parent, _REPO.parent.parent)
             if (p / "shared" / "data" / "published" / "dgxc.json").exists()),
            _REPO.parent / "shared" / "data" / "published" / "dgxc.json")
CLUSTERS = {"h100-sxm": "dgx-h100", "gb200": "gb200-nvl72"}
FAMILY = {"h100-sxm": "h100", "gb200": "gb200"}
# The Megatron-Core release of each DGX Cloud release's NeMo container (the rows' `src`: NeMo 24.05 in
# v24.11.1, 24.12 in v25.02 and v25.02.01, 25.02.01 in v25.04, 25.04 in v25.05 and v25.05.04)
MEGATRON_RELEASE = {"v24.11.1": "megatron@core-0.7", "v25.02": "megatron@core-0.10", "v25.02.01": "megatron@core-0.10",
                    "v25.04": "megatron@core-0.11", "v25.05": "megatron@core-0.12", "v25.05.04": "megatron@core-0.12"}

# The userbuffers config each NeMo performance recipe picks (planner.engines.megatron.NEMO_UB_CONFIGS),
# keyed by (gpu, hidden, fp8); the b200 configs run on GB200, and the GB200 h18432 fp8 rows take the bf16
# config (NeMo has no fp8 one for that shape). A shape missing here ran Transformer Engine's defaults.
UB_CONFIGS: dict[tuple[str, int, bool], str] = {
    ("h100-sxm", 12288, False): "userbuffers_bf16_h100_h12288_tp4_mbs1_seqlen2048",
    ("h100-sxm", 12288, True): "userbuffers_fp8_h100_h12288_tp4_mbs1_seqlen2048",
    ("h100-sxm", 8192, False): "userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192",
    ("h100-sxm", 8192, True): "userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192",
    ("h100-sxm", 16384, False): "userbuffers_bf16_h100_h16384_tp8_cp2_mbs1_seqlen8192",
    ("h100-sxm", 16384, True): "userbuffers_fp8_h100_h16384_tp8_cp2_mbs1_seqlen8192",
    ("gb200", 16384, False): "userbuffers_bf16_b200_h16384_tp4_cp2_mbs1_seqlen8192",
    ("gb200", 16384, True): "userbuffers_fp8_b200_h16384_tp4_cp2_mbs1_seqlen8192",
    ("gb200", 18432, False): "userbuffers_bf16_b200_h18432_tp8_mbs1_seqlen4096",
    ("gb200", 18432, True): "userbuffers_bf16_b200_h18432_tp8_mbs1_seqlen4096",
}


@dataclass(frozen=True)
class DgxcRow:
    id: str
    source: str  # nemo | maxtext | paxml
    model: str  # the source's model name (the hold-out unit)
    gpu: str  # h100-sxm | gb200
    precision: str
    model_spec: ModelSpec
    training: TrainingSpec
    layout: Layout | None  # None: not expressible (reason)
    engine: str
    gpus: int
    measured_s: float
    reason: str = ""
    tp_comm_overlap: bool = False  # the recipe overlapped TP communication with its GEMMs (module docstring)

    @property
    def expressible(self) -> bool:
        return self.layout is not None

    def cluster(self) -> Cluster:
        return load_cluster(CLUSTERS[self.gpu], self.gpus)


def _source(name: str) -> str:
    if "PaxML" in name:
        return "paxml"
    if name.startswith(("Llama 2 70B", "Llama 3 70B")):
        return "maxtext"
    return "nemo"


def _model(rec: dict) -> ModelSpec:
    hf, arch = rec["hf_like"], rec["arch"]
    name = rec["model"].lower().replace(" ", "-").replace("(", "").replace(")", "")
    shape = dict(n_layers=hf["layers"], hidden=hf["hidden"], n_heads=hf["heads"], n_kv_heads=hf["kv_heads"],
                 head_dim=hf["hidden"] // hf["heads"], ffn_hidden=hf["ffn"], vocab=hf["vocab"], max_seq_len=rec["seq"])
    if arch == "gpt":
        return ModelSpec(name=name, mlp="gelu", norm="layernorm", position="learned", tie_embeddings=True,
                         bias=True, **shape)
    if arch == "nemotron":
        return ModelSpec(name=name, mlp="gelu", norm="layernorm", position="rope", **shape)
    return ModelSpec(name=name, **shape)


def _stage_layers(n_layers: int, chunks: int) -> tuple[int, ...] | None:
    """Even split, Megatron's split with one layer fewer at both ends, or None (an empty chunk)."""
    if n_layers % chunks == 0:
        return ()
    per = -(-n_layers // chunks)
    if n_layers == chunks * per - 2 and per >= 2:
        return (per - 1,) + (per,) * (chunks - 2) + (per - 1,)
    return None


def _row(rec: dict, tp_overlap: bool = False) -> DgxcRow:
    gpu = rec["gpu"].split()[0]
    source = _source(rec["model"])
    model = _model(rec)
    tp, pp, cp, vp = rec["tp"], rec["pp"], rec["cp"] or 1, rec["vp"] or 1
    dp, mb, gbs = rec["gpus"] // (tp * pp * cp), rec["micro_batch"], rec["global_batch"]
    precision = rec["precision"] if gpu != "gb200" or rec["precision"] != "fp8" else "mxfp8"
    jax = source != "nemo"
    nemo2 = not jax and not rec["id"].startswith("dgxc-v24")
    overlapped = not jax and tp > 1  # the NeMo recipes' tp_comm_overlap (module docstring)
    # NeMo 2's performance recipes (v25.04, v25.05) build their fp8 and mxfp8 precision from
    # nemo.collections.llm.recipes.precision.mixed_precision (bf16_with_fp8_mixed, bf16_with_mxfp8_mixed:
    # fp8_param_gather=True): 8-bit parameters, no bf16 weights (planner.engines.TE_FP8)
    nemo2_recipes = not jax and rec["id"].startswith(("dgxc-v25.04", "dgxc-v25.05"))
    async_tp = tp_overlap and overlapped
    training = TrainingSpec(seq_len=rec["seq"], global_batch_size=gbs, dtype="bf16", precision=precision,
                            attention="fused", compile=jax, grad_dtype="bf16" if nemo2 else "fp32",
                            async_tp=async_tp, fp8_params=nemo2_recipes and precision in ("fp8", "mxfp8"),
                            tp_overlap_cfg=UB_CONFIGS.get((gpu, model.hidden, precision != "bf16"), "") if async_tp
                            else "")
    common = dict(id=rec["id"], source=source, model=rec["model"], gpu=gpu, precision=precision, model_spec=model,
                  training=training, engine="meshplan" if jax else MEGATRON_RELEASE[rec["id"].split("-")[1]],
                  gpus=rec["gpus"], measured_s=rec["step_time_s"], tp_comm_overlap=overlapped)
    lps = _stage_layers(model.n_layers, pp * vp)
    if lps is None:
        return DgxcRow(layout=None, reason=f"{model.n_layers} layers over pp*vp = {pp * vp} chunks leaves "
                                           "an empty chunk", **common)
    if jax:
        shard = rec.get("fsdp_degree") or dp
        recompute = "op" if rec["recompute"] == "selective" else "none"
        layout = Layout(tp=tp, pp=pp, cp=cp, dp_replicate=dp // shard, dp_shard=shard, zero_stage=3,
                        micro_batch_size=mb, grad_accum_steps=gbs // (dp * mb), recompute=recompute,
                        sequence_parallel=tp > 1)
    else:
        layout = Layout(tp=tp, pp=pp, cp=cp, dp_shard=dp, zero_stage=1 if dp > 1 else 0, micro_batch_size=mb,
                        grad_accum_steps=gbs // (dp * mb), recompute=rec["recompute"] or "none",
                        sequence_parallel=tp > 1, pp_schedule="interleaved-1f1b" if vp > 1 else "1f1b",
                        virtual_stages=vp, layers_per_stage=lps)
    return DgxcRow(layout=layout, **common)


def load_dense_rows(path: Path = DATA, tp_overlap: bool = True) -> list[DgxcRow]:
    """Every dense row of dgxc.json, expressible or not; tp_overlap prices the TP communication overlap
    the NeMo recipes ran (row.tp_comm_overlap) as async TP, else as plain TP collectives."""
    doc = json.loads(path.read_text())
    return [_row(rec, tp_overlap) for rec in doc["rows"] if rec["category"].startswith("dense")]

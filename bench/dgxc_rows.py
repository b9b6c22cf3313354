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
  as engine "torchtitan" (FSDP = ZeRO-3 over fsdp_degree, else over dp;
  their "selective" rematerialization saves the matmul outputs, as per-op
  SAC does; XLA fuses the elementwise work, as compile does);
* gradients: the v25 releases run NeMo 2.0's performance scripts, which
  turn off fp32 gradient reduction (grad_reduce_in_fp32 False: bf16
  gradient buffers); v24.11.1 ran NeMo 1.0's launcher with Megatron's fp32
  main gradients;
* TP communication overlap (DgxcRow.tp_comm_overlap, what the recipe ran;
  priced as TrainingSpec.async_tp only with tp_overlap=True, see
  bench/accuracy_dgxc.py --tp-overlap): every NeMo row with tp > 1 ran
  Transformer Engine's userbuffers (Megatron's --tp-comm-overlap):
  NeMo 1 yamls of v24.11.1/v25.02 (dgxc-benchmarking@35a9aec, @8f5cbb3:
  gpt3_175b_hydra.yaml and llama3.1_{70b,405b}.yaml ub_tp_comm_overlap: true,
  nemotron/configure.sh model.ub_tp_comm_overlap=True; llama3.1_8b.yaml has
  false, with tp 1), and NeMo 2's performance recipes of v25.04/v25.05 (NeMo
  v2.2.1/v2.3.0 recipes gpt3_175b, llama3_70b, llama31_405b, nemotron4_15b,
  nemotron4_340b: MegatronCommOverlapCallback(tp_comm_overlap=True); the
  dgxc pretrain_llama31.py asserts the callback and sets its ub config);
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
    training = TrainingSpec(seq_len=rec["seq"], global_batch_size=gbs, dtype="bf16", precision=precision,
                            attention="fused", compile=jax, grad_dtype="bf16" if nemo2 else "fp32",
                            async_tp=tp_overlap and overlapped)
    common = dict(id=rec["id"], source=source, model=rec["model"], gpu=gpu, precision=precision, model_spec=model,
                  training=training, engine="torchtitan" if jax else "megatron", gpus=rec["gpus"],
                  measured_s=rec["step_time_s"], tp_comm_overlap=overlapped)
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


def load_dense_rows(path: Path = DATA, tp_overlap: bool = False) -> list[DgxcRow]:
    """Every dense row of dgxc.json, expressible or not; tp_overlap prices the TP communication overlap
    the NeMo recipes ran (row.tp_comm_overlap) as async TP, else as plain TP collectives."""
    doc = json.loads(path.read_text())
    return [_row(rec, tp_overlap) for rec in doc["rows"] if rec["category"].startswith("dense")]

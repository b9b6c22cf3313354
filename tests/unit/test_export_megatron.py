"""Megatron-LM export: bash itself expands the argument array, a parser with Megatron's option
names and types reads it back, and Megatron's own arithmetic recovers the plan's degrees and batch."""

from __future__ import annotations

import argparse
import re
import subprocess

import pytest
from test_export import VARIANTS, make_plan, plan_3d, plan_13b

from planner.export import ExportRefused, export_plan
from planner.export.megatron import pipeline_layout

# Option names and types as megatron/training/arguments.py (Megatron-Core 0.14) declares them.
INT_OPTIONS = (
    "tensor-model-parallel-size", "pipeline-model-parallel-size", "context-parallel-size",
    "expert-model-parallel-size", "num-layers-per-virtual-pipeline-stage", "num-distributed-optimizer-instances",
    "micro-batch-size", "global-batch-size", "seq-length", "recompute-num-layers", "num-layers", "hidden-size",
    "ffn-hidden-size", "num-attention-heads", "kv-channels", "num-query-groups", "max-position-embeddings",
    "vocab-size", "num-experts", "moe-router-topk", "moe-ffn-hidden-size", "moe-shared-expert-intermediate-size",
    "cpu-offloading-num-layers", "rotary-base", "rotary-seq-len-interpolation-factor", "moe-router-num-groups",
    "moe-router-group-topk",
)
FLOAT_OPTIONS = ("attention-dropout", "hidden-dropout", "optimizer-offload-fraction", "norm-epsilon",
                 "rope-scaling-factor", "rotary-scaling-factor", "mscale", "mscale-all-dim",
                 "moe-router-topk-scaling-factor")
CHOICE_OPTIONS = {
    "exp-avg-dtype": ["fp32", "fp16", "bf16", "fp8"],
    "exp-avg-sq-dtype": ["fp32", "fp16", "bf16", "fp8"],
    "recompute-granularity": ["full", "selective"],
    "recompute-method": ["uniform", "block"],
    "data-parallel-sharding-strategy": ["no_shard", "optim", "optim_grads", "optim_grads_params"],
    "position-embedding-type": ["learned_absolute", "rope", "mrope", "relative", "none"],
    "normalization": ["LayerNorm", "RMSNorm"],
    "optimizer": ["adam", "sgd", "muon", "dist_muon"],
    "ckpt-format": ["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"],
    "moe-router-score-function": ["softmax", "sigmoid"],
    "rope-type": ["rope", "yarn"],
}
FLAGS = ("sequence-parallel", "use-distributed-optimizer", "use-megatron-fsdp", "no-gradient-accumulation-fusion",
         "bf16", "fp16", "grad-reduce-in-bf16", "group-query-attention", "swiglu",
         "untie-embeddings-and-output-weights", "disable-bias-linear", "optimizer-cpu-offload",
         "use-precision-aware-optimizer", "cpu-offloading", "add-qkv-bias", "qk-layernorm", "use-rope-scaling",
         "openai-gelu", "moe-router-pre-softmax", "moe-router-enable-expert-bias")
# Megatron-Core 0.15+: --window-size takes "LEFT,RIGHT" (tuple_type), --window-attn-skip-freq a list expression
STRING_OPTIONS = ("pipeline-model-parallel-layout", "window-size", "window-attn-skip-freq")


def megatron_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False)
    for name in INT_OPTIONS:
        p.add_argument(f"--{name}", type=int)
    for name in FLOAT_OPTIONS:
        p.add_argument(f"--{name}", type=float)
    for name, choices in CHOICE_OPTIONS.items():
        p.add_argument(f"--{name}", choices=choices)
    for name in FLAGS:
        p.add_argument(f"--{name}", action="store_true")
    for name in STRING_OPTIONS:
        p.add_argument(f"--{name}")
    p.add_argument("--recompute-modules", nargs="*", type=str)  # space-separated module names
    return p


def parse_layout(layout: str) -> list[str]:
    """Megatron's PipelineParallelLayerLayout.parse_str_to_list, re-stated: drop commas, unroll
    '(...)*n' and 'x*n', split stages on '|'."""
    layout = layout.replace(",", "")
    layout = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), layout)
    layout = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), layout)
    return layout.split("|")


def exported(plan, tmp_path) -> tuple[argparse.Namespace, str]:
    """Source the exported script in bash and read back MEGATRON_ARGS and CUDA_DEVICE_MAX_CONNECTIONS."""
    script = tmp_path / "megatron_args.sh"
    script.write_text(export_plan(plan, "megatron").text)
    proc = subprocess.run(
        ["bash", "-c", 'source "$1"; printf "%s\\0" "${MEGATRON_ARGS[@]}"; '
         'printf "%s" "${CUDA_DEVICE_MAX_CONNECTIONS:-unset}" >&2', "_", str(script)],
        capture_output=True, text=True, check=True,
    )
    argv = proc.stdout.split("\0")[:-1]
    args, unknown = megatron_parser().parse_known_args(argv)
    assert unknown == [], f"options Megatron does not declare: {unknown}"
    return args, proc.stderr


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_megatron_round_trip(name, tmp_path):
    plan = VARIANTS[name]()
    lay, tr, m = plan.layout, plan.training, plan.model
    a, max_connections = exported(plan, tmp_path)
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size) == (
        lay.tp, lay.pp, lay.cp)
    # Megatron: data_parallel_size = world // (tp * pp * cp); accumulation = global // (micro * dp)
    model_size = a.tensor_model_parallel_size * a.pipeline_model_parallel_size * a.context_parallel_size
    assert plan.world_size % model_size == 0 and plan.world_size // model_size == lay.dp
    assert a.global_batch_size == tr.global_batch_size and a.micro_batch_size == lay.micro_batch_size
    assert a.global_batch_size // (a.micro_batch_size * lay.dp) == lay.grad_accum_steps
    assert a.global_batch_size % (a.micro_batch_size * lay.dp) == 0
    assert a.seq_length == tr.seq_len and a.sequence_parallel == lay.sequence_parallel
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads, a.kv_channels) == (
        m.n_layers, m.hidden, m.ffn_hidden, m.n_heads, m.head_dim)
    assert a.bf16 and a.attention_dropout == a.hidden_dropout == m.dropout
    assert a.recompute_granularity == {"none": None, "selective": "selective", "full": "full"}[lay.recompute]
    fsdp = a.use_megatron_fsdp
    assert max_connections == ("1" if max(lay.tp, lay.cp) > 1 and not fsdp else "unset")
    _check_pipeline(plan, a)
    _check_zero(plan, a)


def _check_pipeline(plan, a) -> None:
    lay = plan.layout
    if a.pipeline_model_parallel_layout is not None:
        stages = parse_layout(a.pipeline_model_parallel_layout)
        assert stages[0].startswith("E") and stages[-1].endswith("L")
        assert [s.count("t") for s in stages] == list(lay.layers_per_stage)
        assert len(stages) // a.pipeline_model_parallel_size == lay.virtual_stages
    elif a.num_layers_per_virtual_pipeline_stage is not None:
        # validate_args: vpp = (num_layers // pp) // num_layers_per_virtual_pipeline_stage
        per_rank = a.num_layers // a.pipeline_model_parallel_size
        assert per_rank // a.num_layers_per_virtual_pipeline_stage == lay.virtual_stages > 1
    else:
        assert lay.virtual_stages == 1 and a.num_layers % a.pipeline_model_parallel_size == 0


def _check_zero(plan, a) -> None:
    lay = plan.layout
    assert a.use_distributed_optimizer == (lay.zero_stage > 0)
    if lay.zero_stage >= 2 and lay.pp == 1:
        assert a.use_megatron_fsdp and a.ckpt_format == "fsdp_dtensor"
        assert a.data_parallel_sharding_strategy == {2: "optim_grads", 3: "optim_grads_params"}[lay.zero_stage]
    else:
        assert not a.use_megatron_fsdp
    if lay.zero_stage > 0 and not a.use_megatron_fsdp and lay.dp_replicate > 1:
        assert a.num_distributed_optimizer_instances == lay.dp_replicate


def test_megatron_13b_is_fsdp_with_tp8(tmp_path):
    a, _ = exported(plan_13b(), tmp_path)
    assert a.tensor_model_parallel_size == 8 and a.data_parallel_sharding_strategy == "optim_grads_params"


def test_megatron_3d_interleaved_uses_layers_per_virtual_stage(tmp_path):
    a, max_connections = exported(plan_3d(), tmp_path)
    assert a.num_layers_per_virtual_pipeline_stage == 5 and a.pipeline_model_parallel_layout is None
    assert a.recompute_method == "uniform" and a.recompute_num_layers == 1 and max_connections == "1"


def test_megatron_gqa_and_hsdp_zero1(tmp_path):
    plan = make_plan(32, model="llama3-8b", tp=8, dp_replicate=2, dp_shard=2, zero_stage=1, micro_batch_size=1,
                     grad_accum_steps=64)
    a, _ = exported(plan, tmp_path)
    assert a.group_query_attention and a.num_query_groups == plan.model.n_kv_heads == 8
    assert a.num_distributed_optimizer_instances == 2 and a.use_distributed_optimizer


def test_megatron_offloads_the_planned_layers_activations(tmp_path):
    plan = make_plan(16, tp=8, dp_shard=2, zero_stage=3, micro_batch_size=1, grad_accum_steps=128,
                     activation_offload_layers=10)
    a, _ = exported(plan, tmp_path)
    assert a.cpu_offloading and a.cpu_offloading_num_layers == 10
    b, _ = exported(plan_13b(), tmp_path)
    assert not b.cpu_offloading and b.cpu_offloading_num_layers is None


def test_megatron_notes_name_what_it_cannot_run():
    notes = export_plan(VARIANTS["zbv_uneven"](), "megatron").notes
    assert any(note.startswith("pp_schedule zb-v") for note in notes)
    assert any(note.startswith("ZeRO-2 with pp 2") for note in notes)
    assert any(note.startswith("pp_schedule gpipe") for note in export_plan(VARIANTS["ddp_gpipe"](), "megatron").notes)
    assert any(note.startswith("HSDP") for note in export_plan(VARIANTS["hsdp_offload"](), "megatron").notes)


def test_pipeline_layout_string_parses_to_the_counts():
    assert parse_layout(pipeline_layout((3, 2, 4))) == ["Ettt", "tt", "ttttL"]


def test_megatron_target_versions_use_the_option_names_of_that_release():
    plan = make_plan(16, tp=4, dp_shard=4, zero_stage=3, micro_batch_size=1, grad_accum_steps=64)
    new = export_plan(plan, "megatron").text
    assert "--use-megatron-fsdp" in new and "fsdp_dtensor" in new
    old = export_plan(plan, "megatron", version="0.13").text
    assert "--use-custom-fsdp" in old and "--use-megatron-fsdp" not in old and "fsdp_dtensor" not in old
    uneven = make_plan(24, tp=8, pp=3, micro_batch_size=1, grad_accum_steps=256)  # 40 layers: 13, 14, 13
    assert "--pipeline-model-parallel-layout" in export_plan(uneven, "megatron", version="0.13").text
    first_last = export_plan(uneven, "megatron", version="0.12").text
    assert "--decoder-first-pipeline-num-layers 13" in first_last and "--decoder-last-pipeline-num-layers 13" in first_last
    odd = make_plan(16, tp=8, pp=2, micro_batch_size=1, grad_accum_steps=256, pp_schedule="interleaved-1f1b",
                    virtual_stages=2, layers_per_stage=(9, 11, 11, 9))
    with pytest.raises(ExportRefused, match="before 0.13"):
        export_plan(odd, "megatron", version="0.12")


def test_megatron_exports_the_host_recipe_options_the_prediction_assumed():
    """Grouped GEMMs for routed experts unless the plan turned them off; CUDA graphs by each release's option."""
    import dataclasses

    moe = make_plan(16, model="mixtral-8x7b", tp=2, dp_shard=8, zero_stage=1, ep=8, micro_batch_size=1,
                    grad_accum_steps=32)
    assert "--moe-grouped-gemm" in export_plan(moe, "megatron").text
    assert "--cuda-graph" not in export_plan(moe, "megatron").text
    off = dataclasses.replace(moe, training=moe.training.replace(moe_grouped_gemm=False, cuda_graphs=True))
    assert "--moe-grouped-gemm" not in export_plan(off, "megatron").text
    assert "--cuda-graph-impl local" in export_plan(off, "megatron").text
    assert "--enable-cuda-graph" in export_plan(off, "megatron", version="0.13").text
    assert "--moe-grouped-gemm" not in export_plan(plan_13b(), "megatron").text  # dense: no experts
    assert "--moe-router-fusion" not in export_plan(moe, "megatron").text
    fused = dataclasses.replace(moe, training=moe.training.replace(moe_router_fusion=True, moe_a2a_overlap=True))
    assert "--moe-router-fusion" in export_plan(fused, "megatron").text
    assert "--overlap-moe-expert-parallel-comm" in export_plan(fused, "megatron").text
    router = dataclasses.replace(moe, training=moe.training.replace(moe_router_graphs=True))
    assert "--cuda-graph-scope moe_router moe_preprocess" in export_plan(router, "megatron").text


def test_megatron_exports_the_memory_recipe_options_the_prediction_assumed():
    """8-bit parameters and Transformer Engine's cross entropy (planner.memory counts them) become their flags."""
    import dataclasses

    base = plan_13b()
    assert "--fp8-param-gather" not in export_plan(base, "megatron").text
    fp8 = dataclasses.replace(base, training=base.training.replace(precision="fp8", fp8_params=True,
                                                                   fused_cross_entropy=True))
    text = export_plan(fp8, "megatron").text
    assert "--fp8-param-gather" in text and "--cross-entropy-fusion-impl te" in text

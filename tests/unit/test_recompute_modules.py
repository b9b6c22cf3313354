"""Megatron-Core's selective recomputation of named modules (Layout.recompute_modules, --recompute-modules):
what each module drops from a layer's saved activations, what its recomputation costs in the backward, the
plan.json key, the search, the export and the CLI's usage errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_export import make_plan
from test_export_megatron import exported

from planner.engines import get_engine
from planner.layout import RECOMPUTE_MODULES, Layout
from planner.memory.activations import RECOMPUTED_TERMS, layer_activation_bytes, layer_activation_terms
from planner.model.blocks import MLASpec, MoESpec
from planner.model.spec import ModelSpec
from planner.plan import Plan, load_plan, with_stage_layers
from planner.search.bound import StepBound
from planner.simulate.calibration import load_calibration
from planner.simulate.compute import gemm_time_s, layer_times, memory_time_s
from planner.simulate.step import simulate_step
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster
from topologies.errors import PlanError

# A small DeepSeek-like model: MLA attention, one dense first layer, then MoE layers with a shared expert.
H, A, F, FE, E, K = 256, 4, 512, 128, 8, 2
QR, KVR, NOPE, ROPE, V = 96, 64, 32, 16, 32
SMALL = ModelSpec(name="small-mla-moe", n_layers=4, hidden=H, n_heads=A, n_kv_heads=A, head_dim=NOPE + ROPE,
                  ffn_hidden=F, vocab=1024, max_seq_len=2048,
                  moe=MoESpec(n_experts=E, top_k=K, expert_ffn_hidden=FE, n_shared_experts=1, first_dense_layers=1),
                  mla=MLASpec(q_lora_rank=QR, kv_lora_rank=KVR, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                              v_head_dim=V))
S, B, D = 1024, 2, 2
TOKENS = S * B
MOE_SHARE = 3 / 4  # three of the four layers are MoE


def _terms(**kw) -> dict[str, float]:
    """Megatron-Core's saved tensors: fused SwiGLU, router probabilities applied in the experts' activation."""
    return layer_activation_terms(SMALL, S, B, dtype_bytes=D, fused_swiglu=True, moe_probs_in_experts=True, **kw)


def _dropped(modules: tuple[str, ...], **kw) -> float:
    """Bytes a layer no longer keeps per micro-batch under selective recomputation of `modules`."""
    terms = _terms(**kw)
    kept, transient = layer_activation_bytes(terms, "selective", modules=modules)
    assert kept + transient == pytest.approx(sum(terms.values()))
    return transient


# ---- memory: what each module drops, against bytes counted by hand (megatron: fused SwiGLU) ----------------

@pytest.mark.parametrize("module, per_token", [
    # the fused attention kernel's fp32 log-sum-exp per head
    ("core_attn", 4 * A),
    # Q and K (a heads of nope + rope) and V (a heads of v) that the core attention keeps
    ("mla_up_proj", D * (2 * A * (NOPE + ROPE) + A * V)),
    # MLA's input norm output (h) in every layer, the MoE layers' pre-MLP norm output (h)
    ("layernorm", D * H + MOE_SHARE * D * H),
    # per routed copy, what the fused SwiGLU keeps beyond fc1's 2f output: the product fc2 saves (f)
    ("moe_act", MOE_SHARE * K * D * FE),
    # the dense layer's fused-norm output (h) and MLP inner tensors (fused SwiGLU: 3f)
    ("mlp", (1 - MOE_SHARE) * D * (H + 3 * F)),
    # the shared expert's inner tensors (3f)
    ("shared_experts", MOE_SHARE * D * 3 * FE),
    # router probabilities and map, permuted tokens, routed experts (fc1 2f, product f; the probabilities weigh
    # the activation, so no expert output is kept for the combine), shared expert
    ("moe", MOE_SHARE * ((4 + 1) * E + D * K * H + D * K * 3 * FE + D * 3 * FE)),
])
def test_each_module_drops_what_megatron_frees(module, per_token):
    assert _dropped((module,)) == pytest.approx(per_token * TOKENS)


def test_modules_drop_the_union_of_their_tensors_and_default_to_core_attention():
    terms = _terms()
    assert layer_activation_bytes(terms, "selective") == layer_activation_bytes(terms, "selective",
                                                                                modules=("core_attn",))
    # moe covers moe_act and shared_experts: naming them too drops nothing more
    assert _dropped(("moe", "moe_act", "shared_experts")) == pytest.approx(_dropped(("moe",)))
    both = _dropped(("mla_up_proj", "moe_act"))
    assert both == pytest.approx(_dropped(("mla_up_proj",)) + _dropped(("moe_act",)))
    assert set(RECOMPUTED_TERMS) == set(RECOMPUTE_MODULES)


def test_a_weighted_combine_keeps_the_expert_outputs():
    """Where the combine weighs the experts' outputs by the probabilities (meshplan's executor, Megatron-Core
    before 0.13) each routed copy's output (h) stays saved; Megatron-Core now weighs the activation instead."""
    weighted = layer_activation_terms(SMALL, S, B, dtype_bytes=D, fused_swiglu=True)
    assert sum(weighted.values()) - sum(_terms().values()) == pytest.approx(MOE_SHARE * D * K * H * TOKENS)


def test_layernorm_drops_nothing_where_te_fuses_the_norms():
    """A dense GQA model: Megatron-Core's TE spec fuses both norms into the QKV and fc1 linears."""
    dense = dataclasses.replace(SMALL, moe=None, mla=None, n_kv_heads=2)
    terms = layer_activation_terms(dense, S, B, dtype_bytes=D, fused_swiglu=True)
    assert layer_activation_bytes(terms, "selective", modules=("layernorm",))[1] == 0.0
    assert layer_activation_bytes(terms, "selective", modules=("mlp",))[1] == pytest.approx(
        D * (H + 3 * F) * TOKENS)


def test_moe_act_saves_memory_on_a_real_plan():
    """The peak of a DeepSeek-like plan under engine megatron falls with each module added."""
    plan = _plan(recompute="selective", recompute_modules=("core_attn",))
    peaks = [simulate_step(plan.model, plan.training, plan.layout.replace(recompute_modules=mods), plan.cluster,
                           engine="megatron").memory.peak_bytes
             for mods in (("core_attn",), ("core_attn", "moe_act"), ("core_attn", "moe_act", "mla_up_proj"))]
    assert peaks[0] > peaks[1] > peaks[2]


# ---- time: a recomputed module's forward is added to the backward ----------------------------------------

def _times(modules: tuple[str, ...], tp: int = 1):
    cluster = load_cluster("dgx-h100", 8)
    cal = load_calibration(None, cluster.gpu)
    layout = Layout(tp=tp, dp_shard=8 // tp, zero_stage=1, ep=2, micro_batch_size=B, sequence_parallel=tp > 1,
                    recompute="selective", recompute_modules=modules)
    peak = cluster.gpu.peak_flops("bf16")
    return layer_times(SMALL, S, D, layout, cluster.gpu, peak, cal), cluster.gpu, cal, peak


def test_recomputed_time_is_the_modules_forward():
    core, gpu, cal, peak = _times(("core_attn",))
    m = TOKENS
    # mla_up_proj: the kv and q up projections, priced as the forward prices them
    up, *_ = _times(("mla_up_proj",))
    expected = (gemm_time_s(m, A * (NOPE + V), KVR, peak, cal) + gemm_time_s(m, A * (NOPE + ROPE), QR, peak, cal))
    assert up.recompute_s == pytest.approx(expected)
    # moe_act: the routed experts' SwiGLU, three passes per element of its f-wide output per routed copy
    act, *_ = _times(("moe_act",))
    assert act.recompute_s == pytest.approx(memory_time_s(D * m * 3 * MOE_SHARE * K * FE, gpu, cal))
    # layernorm: a read and a write of h per separate norm (MLA's input norm, the MoE layers' pre-MLP norm)
    norm, *_ = _times(("layernorm",))
    assert norm.recompute_s == pytest.approx(memory_time_s((1 + MOE_SHARE) * 2 * D * m * H, gpu, cal))
    # the rest of the pass is the same whatever is recomputed; backward_s carries the recomputation
    for t in (up, act, norm):
        assert (t.forward_s, t.backward_input_s, t.backward_weight_s) == (
            core.forward_s, core.backward_input_s, core.backward_weight_s)
        assert t.backward_s - core.backward_s == pytest.approx(t.recompute_s - core.recompute_s)
    both, *_ = _times(("mla_up_proj", "moe_act"))
    assert both.recompute_s == pytest.approx(up.recompute_s + act.recompute_s)


def test_recomputing_a_dense_mlp_costs_its_gemms_activation_and_fused_norm():
    dense = dataclasses.replace(SMALL, moe=None, mla=None)
    cluster = load_cluster("dgx-h100", 8)
    cal = load_calibration(None, cluster.gpu)
    layout = Layout(dp_shard=8, zero_stage=1, micro_batch_size=B, recompute="selective", recompute_modules=("mlp",))
    peak = cluster.gpu.peak_flops("bf16")
    got = layer_times(dense, S, D, layout, cluster.gpu, peak, cal).recompute_s
    m = TOKENS
    gemms = gemm_time_s(m, 2 * F, H, peak, cal) + gemm_time_s(m, H, F, peak, cal)  # SwiGLU fc1 (2f), fc2
    elementwise = memory_time_s(D * m * (3 * F + 2 * H), cluster.gpu, cal)  # SwiGLU's 3 passes, the norm's 2
    assert got == pytest.approx(gemms + elementwise)


def test_recomputing_the_moe_layer_costs_its_forward():
    moe, *_ = _times(("moe",))
    none = _times(("core_attn",))[0]
    shared_act = _times(("shared_experts",))[0].recompute_s
    assert moe.recompute_s > shared_act > 0
    assert moe.recompute_s < none.forward_s  # a part of the layer, never more than all of it


def test_a_recomputed_mlp_repeats_its_tp_collectives():
    plan = _plan(recompute="selective", recompute_modules=("mla_up_proj",), tp=2)
    with_mlp = plan.layout.replace(recompute_modules=("mla_up_proj", "mlp"))
    a = simulate_step(plan.model, plan.training, plan.layout, plan.cluster, engine="megatron")
    b = simulate_step(plan.model, plan.training, with_mlp, plan.cluster, engine="megatron")
    assert b.step_time_s > a.step_time_s
    assert b.time_breakdown_s["tp_comm"] > a.time_breakdown_s["tp_comm"]


def test_search_bound_stays_below_the_simulated_step():
    cluster = load_cluster("dgx-h100", 8)
    cal = load_calibration(None, cluster.gpu)
    for modules in (("moe_act",), ("layernorm", "moe_act"), ("mla_up_proj", "mlp"), ("moe",)):
        plan = _plan(recompute="selective", recompute_modules=modules, tp=2)
        bound = StepBound(plan.model, cluster, cal, "megatron", recompute_modules=modules)
        simulated = simulate_step(plan.model, plan.training, plan.layout, cluster, cal, engine="megatron")
        assert bound.seconds(plan.layout, plan.training) <= simulated.step_time_s


# ---- the layout key, plan.json, the engine's rules -----------------------------------------------------------

def _plan(tp: int = 1, **layout) -> Plan:
    lay = Layout(tp=tp, dp_shard=8 // tp, zero_stage=1, ep=2, micro_batch_size=1, grad_accum_steps=4,
                 sequence_parallel=tp > 1, **layout)
    return Plan(model=SMALL, cluster=load_cluster("dgx-h100", 8),
                training=TrainingSpec(seq_len=S, global_batch_size=4 * 8 // tp), layout=with_stage_layers(SMALL, lay),
                engine="megatron")


def test_plan_json_round_trip_and_old_plans(tmp_path):
    plan = _plan(recompute="selective", recompute_modules=("layernorm", "moe_act"))
    path = tmp_path / "plan.json"
    plan.save(path)
    doc = json.loads(path.read_text())
    assert doc["parallel"]["recompute_modules"] == ["layernorm", "moe_act"]
    assert load_plan(path).layout.recompute_modules == ("layernorm", "moe_act")
    del doc["parallel"]["recompute_modules"]  # a plan written before the key: Megatron's default
    path.write_text(json.dumps(doc))
    old = load_plan(path).layout
    assert old.recompute_modules == () and old.recompute == "selective"


@pytest.mark.parametrize("changes, message", [
    (dict(recompute="selective", recompute_modules=("attention",)), "unknown recompute_modules ['attention']"),
    (dict(recompute="full", recompute_modules=("mlp",)), "apply to recompute 'selective', got 'full'"),
    (dict(recompute="selective", recompute_modules=("mlp", "mlp")), "names a module twice"),
    (dict(recompute="selective", recompute_modules=["mlp"]), "must be a tuple"),
])
def test_layout_refuses_bad_modules_naming_them(changes, message):
    with pytest.raises(PlanError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Layout(**changes)


def test_only_megatron_runs_modules_and_only_where_the_model_has_them():
    layout = Layout(recompute="selective", recompute_modules=("moe_act",))
    assert get_engine("megatron").refusal(SMALL, layout, "bf16", True) is None
    assert "--engine megatron" in get_engine("deepspeed").refusal(SMALL, layout, "bf16", True)
    assert get_engine("torchtitan").refusal(SMALL, layout, "bf16", True)  # it has no selective kind at all
    dense = dataclasses.replace(SMALL, moe=None, mla=None)
    assert "no MLA attention" in get_engine("megatron").refusal(
        dense, Layout(recompute="selective", recompute_modules=("mla_up_proj",)), "bf16", True)
    assert "no MoE layers" in get_engine("megatron").refusal(dense, layout, "bf16", True)
    sequential = TrainingSpec(seq_len=S, global_batch_size=8, moe_grouped_gemm=False)
    assert "grouped GEMM" in get_engine("megatron").refusal(SMALL, layout, "bf16", True, sequential)


# ---- export ----------------------------------------------------------------------------------------------------

def test_megatron_export_names_the_modules(tmp_path):
    plan = make_plan(16, tp=8, dp_shard=2, zero_stage=1, grad_accum_steps=128, recompute="selective",
                     recompute_modules=("core_attn", "mlp"))
    args, _ = exported(dataclasses.replace(plan, engine="megatron"), tmp_path)
    assert args.recompute_granularity == "selective" and args.recompute_modules == ["core_attn", "mlp"]
    default = make_plan(16, tp=8, dp_shard=2, zero_stage=1, grad_accum_steps=128, recompute="selective")
    args, _ = exported(default, tmp_path)
    assert args.recompute_granularity == "selective" and args.recompute_modules is None  # Megatron's default

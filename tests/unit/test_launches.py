"""Host operations per layer (planner.simulate.launches) and how they reach the step time."""

from __future__ import annotations

import dataclasses
import json

import pytest

from planner.layout import Layout
from planner.model.load import load_model
from planner.plan import Plan
from planner.simulate import launches
from planner.simulate.calibration import load_calibration
from planner.simulate.host import layer_host_scale
from planner.simulate.step import simulate_step
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster


def _moe(model, **changes):
    return dataclasses.replace(model, moe=dataclasses.replace(model.moe, **changes))


def test_a_dense_layer_with_fused_attention_is_the_reference():
    """layer_overhead_s keeps its meaning: dense GQA and MHA layers of any MLP dispatch the reference count."""
    for name in ("llama3-8b", "llama3-70b", "gpt3-175b"):
        model = load_model(name)
        forward, backward = launches.layer_ops(model, Layout(), fused_attention=True)
        assert (forward, backward) == (launches.DENSE_REFERENCE_OPS, 2 * launches.DENSE_REFERENCE_OPS), name


def test_mla_launches_more_than_gqa_and_unfused_attention_more_than_fused():
    dsv3, llama = load_model("deepseek-v3"), load_model("llama3-70b")
    assert launches.attention_ops(dsv3, True) > launches.attention_ops(llama, True)
    for model in (dsv3, llama):
        assert launches.attention_ops(model, False) > launches.attention_ops(model, True)


def test_deepseek_router_and_moe_layers_launch_more_than_a_dense_layer():
    dsv3, mixtral = load_model("deepseek-v3"), load_model("mixtral-8x7b")
    assert launches.router_ops(dsv3)[0] > launches.router_ops(mixtral)[0]  # sigmoid, bias, group-limited top-k
    for model in (dsv3, mixtral):
        forward, backward = launches.layer_ops(model, Layout(dp_shard=8, zero_stage=1, ep=8), fused_attention=True)
        assert forward > 2 * launches.DENSE_REFERENCE_OPS
        # the router's selection and the dispatcher's counts have no backward
        assert backward < 2 * forward
    # a capacity factor adds the token-drop pass
    assert launches.router_ops(_moe(mixtral, capacity_factor=1.0))[0] > launches.router_ops(mixtral)[0]


def test_grouped_gemm_off_scales_with_the_local_experts():
    model = load_model("mixtral-8x7b")  # 8 experts
    grouped = {ep: launches.expert_ops(model, Layout(dp_shard=8, zero_stage=1, ep=ep), grouped_gemm=True) for ep in (1, 2, 8)}
    assert len(set(grouped.values())) == 1
    seq = {ep: launches.expert_ops(model, Layout(dp_shard=8, zero_stage=1, ep=ep), grouped_gemm=False) for ep in (1, 2, 8)}
    assert seq[1] - seq[2] == 4 * launches.SEQUENTIAL_EXPERT_OPS  # 8 local experts vs 4
    assert seq[1] > seq[2] > seq[8] and seq[1] > grouped[1]


def test_cuda_graphs_replay_a_static_layer_as_one_launch():
    dense, moe = load_model("llama3-8b"), load_model("mixtral-8x7b")
    assert launches.layer_ops(dense, Layout(), True, cuda_graphs=True) == (1.0, 1.0)
    dropping = _moe(moe, capacity_factor=1.0)
    assert launches.layer_ops(dropping, Layout(dp_shard=8, zero_stage=1, ep=8), True, cuda_graphs=True) == (1.0, 1.0)
    # dropless routing: the experts' shapes follow the routing, so dispatch and experts stay eager
    eager_f, _ = launches.layer_ops(moe, Layout(dp_shard=8, zero_stage=1, ep=8), True)
    graphed_f, graphed_b = launches.layer_ops(moe, Layout(dp_shard=8, zero_stage=1, ep=8), True, cuda_graphs=True)
    assert 2.0 < graphed_f < eager_f and graphed_b > 2.0


def test_cuda_graphs_remove_host_time_from_a_host_bound_step():
    """A layer small enough to be host-bound on GB200 runs faster with CUDA graphs; the search bound follows."""
    from planner.search.bound import StepBound

    model = _moe(load_model("deepseek-v3"), capacity_factor=1.0)
    cluster = load_cluster("gb200-nvl72", 64)
    cal = load_calibration(None, cluster.gpu)
    layout = Layout(tp=1, pp=8, dp_shard=8, zero_stage=1, ep=8, grad_accum_steps=8, recompute="full")
    eager = TrainingSpec(seq_len=1024, global_batch_size=64, precision="bf16", attention="eager")
    graphed = eager.replace(cuda_graphs=True)
    assert layer_host_scale(model, graphed, layout, False) == (pytest.approx(1 / 16), pytest.approx(1 / 16))
    t_eager = simulate_step(model, eager, layout, cluster, cal, engine="megatron").step_time_s
    t_graphed = simulate_step(model, graphed, layout, cluster, cal, engine="megatron").step_time_s
    assert t_graphed < 0.9 * t_eager
    bound = StepBound(model, cluster, cal, "megatron")
    assert bound.for_shape(layout, graphed).seconds(1, "full") <= t_graphed * (1 + 1e-9)


def test_plan_json_keeps_the_recipe_options_optional():
    training = TrainingSpec(seq_len=128, global_batch_size=8)
    assert "cuda_graphs" not in training.to_json() and "moe_grouped_gemm" not in training.to_json()
    changed = training.replace(cuda_graphs=True, moe_grouped_gemm=False)
    data = json.loads(json.dumps(changed.to_json()))
    assert data["cuda_graphs"] is True and data["moe_grouped_gemm"] is False
    assert TrainingSpec.from_json(data) == changed
    plan = Plan(model=load_model("debug"), cluster=load_cluster("cpu", 1), training=changed,
                layout=Layout(grad_accum_steps=8), engine="deepspeed")
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))).training == changed


def test_selective_recompute_redoes_the_attention_core_in_the_backward():
    model = load_model("llama3-8b")
    for fused in (True, False):
        plain = launches.layer_ops(model, Layout(), fused)
        redo = launches.layer_ops(model, Layout(recompute="selective"), fused)
        core = launches.FUSED_CORE_OPS if fused else launches.UNFUSED_CORE_OPS
        assert redo == (plain[0], plain[1] + core)


def test_router_fusion_runs_either_router_as_the_same_few_kernels():
    """Fused score/top-k and aux-loss kernels: DeepSeek's grouped sigmoid router stops costing more."""
    dsv3, qwen = load_model("deepseek-v3"), load_model("qwen3-30b-a3b")
    fused = {launches.router_ops(m, fused=True) for m in (dsv3, qwen)}
    assert fused == {(launches.FUSED_ROUTER_OPS, launches.FUSED_ROUTER_GRAD_OPS)}
    layout = Layout(dp_shard=8, zero_stage=1, ep=8)
    for model in (dsv3, qwen):
        assert launches.router_ops(model)[0] > launches.FUSED_ROUTER_OPS
        eager = launches.layer_ops(model, layout, True)
        assert all(f < e for f, e in zip(launches.layer_ops(model, layout, True, router_fusion=True), eager, strict=True))
    training = TrainingSpec(seq_len=4096, global_batch_size=64)
    assert layer_host_scale(qwen, training.replace(moe_router_fusion=True), layout, True)[0] < \
        layer_host_scale(qwen, training, layout, True)[0]


def test_plan_json_keeps_the_moe_recipe_options_optional():
    training = TrainingSpec(seq_len=128, global_batch_size=8)
    assert not {"moe_router_fusion", "moe_router_graphs", "moe_a2a_overlap"} & set(training.to_json())
    changed = training.replace(moe_router_fusion=True, moe_router_graphs=True, moe_a2a_overlap=True)
    assert TrainingSpec.from_json(json.loads(json.dumps(changed.to_json()))) == changed
    with pytest.raises(Exception, match="moe_a2a_overlap"):
        training.replace(moe_a2a_overlap="yes")


def test_router_graphs_replay_the_router_and_leave_the_rest_eager():
    """--cuda-graph-scope moe_router moe_preprocess: fewer operations than eager, more than attention graphs too."""
    qwen, layout = load_model("qwen3-30b-a3b"), Layout(dp_shard=8, zero_stage=1, ep=8)
    eager = launches.layer_ops(qwen, layout, True, router_fusion=True)
    router = launches.layer_ops(qwen, layout, True, router_fusion=True, router_graphs=True)
    wider = launches.layer_ops(qwen, layout, True, cuda_graphs=True, router_fusion=True)
    fused_f, fused_b = launches.router_ops(qwen, fused=True)
    assert eager[0] - router[0] == fused_f - 1 + launches.DISPATCH_PREPROCESS_OPS
    assert eager[1] - router[1] == 2 * fused_b - 1
    assert all(w < r < e for w, r, e in zip(wider, router, eager, strict=True))
    # cuda_graphs' wider scope takes precedence
    assert launches.layer_ops(qwen, layout, True, cuda_graphs=True, router_graphs=True) == \
        launches.layer_ops(qwen, layout, True, cuda_graphs=True)


def test_a_clamped_glu_dispatches_its_clamp_and_offset_operations():
    """GPT-OSS's clamp: chunk, two clamps, concatenation and the offset's scalar tensor forward (5); all but
    the scalar carry gradients (2 backward operations each); recomputing moe_act runs the 5 again."""
    clamped = load_model("gpt-oss-20b")
    plain = dataclasses.replace(clamped, glu_clamp=0.0)
    layout = Layout(dp_shard=8, zero_stage=1, ep=8)
    (f1, b1), (f0, b0) = (launches.layer_ops(m, layout, fused_attention=True) for m in (clamped, plain))
    assert (f1 - f0, b1 - b0) == (launches.GLU_CLAMP_OPS, 2 * launches.GLU_CLAMP_GRAD_OPS)
    redo = Layout(dp_shard=8, zero_stage=1, ep=8, recompute="selective", recompute_modules=("moe_act",))
    assert launches.recompute_ops(clamped, redo, True) - launches.recompute_ops(plain, redo, True) == \
        launches.GLU_CLAMP_OPS


def test_expert_output_biases_dispatch_per_local_expert():
    """Megatron-Core's _apply_bias: 2 operations per local expert plus 5 around them forward; on the gradient
    path the per-expert 2 and 3 of the 5; 8 local experts at ep 4 for GPT-OSS 20B's 32."""
    biased = load_model("gpt-oss-20b")
    plain = _moe(biased, expert_bias=False)
    layout = Layout(dp_shard=8, zero_stage=1, ep=4)
    # router fusion: the same router either way (unfused, a router bias without expert biases reads as DeepSeek's)
    (f1, b1), (f0, b0) = (launches.layer_ops(m, layout, fused_attention=True, router_fusion=True)
                          for m in (biased, plain))
    assert (f1 - f0, b1 - b0) == (2 * 8 + 5, 2 * (2 * 8 + 3))


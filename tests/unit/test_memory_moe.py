"""Per-rank MoE memory: expert weights, gradients and optimizer states follow ep x etp and the
expert data-parallel group, never TP; MoE activations follow top_k; the expert grid's groups."""

from __future__ import annotations

import pytest

from planner.layout import Layout, expert_groups
from planner.memory.activations import layer_activation_terms
from planner.memory.params import ceil_div, pipeline_params
from planner.memory.states import stage_states
from planner.model.load import load_model
from planner.training import TrainingSpec
from topologies.errors import PlanError

BF16 = TrainingSpec(seq_len=4096, global_batch_size=64, dtype="bf16")


def _deepseek_recipe(etp: int) -> Layout:
    """DeepSeek-V3-like: TP 2, EP 8, distributed optimizer (ZeRO-1) over 32 data-parallel ranks."""
    return Layout(tp=2, dp_shard=32, zero_stage=1, ep=8, etp=etp, micro_batch_size=1, grad_accum_steps=2)


def test_expert_states_follow_ep_etp_and_edp_not_tp():
    m = load_model("deepseek-v3")
    layout = _deepseek_recipe(etp=1)
    assert layout.expert_dp_shard == 8 and layout.edp == 8  # 64 ranks / (ep 8 * etp 1)
    sp = pipeline_params(m, layout, "megatron")[0]
    # every routed expert of the 58 MoE layers and the MTP module's layer, split over ep * etp = 8 ranks;
    # tp 2 plays no part
    assert sp.experts == (m.n_moe_layers + m.mtp_layers) * m.expert_params_per_layer // 8
    assert sp.expert_shard == 8
    states = stage_states(m, BF16, layout, sp, "megatron")
    # Megatron-Core: bf16 weights, fp32 gradient buffer (unsharded under ZeRO-1), fp32 master + 2 moments
    # sharded over dp (dense) and over the expert data-parallel group (experts)
    assert states.params == 2 * sp.total
    assert states.grads == 4 * sp.total
    assert states.optimizer == ceil_div(12 * sp.dense, 32) + ceil_div(12 * sp.experts, 8)
    # what dividing experts by tp and sharding them over dp would report instead: 16x less optimizer
    wrong = ceil_div(12 * sp.dense, 32) + ceil_div(12 * sp.experts // 2, 32)
    assert states.optimizer > 3 * wrong


def test_expert_tensor_parallel_splits_experts_and_shrinks_edp():
    m = load_model("deepseek-v3")
    one = pipeline_params(m, _deepseek_recipe(etp=1), "megatron")[0]
    two = pipeline_params(m, _deepseek_recipe(etp=2), "megatron")[0]
    assert two.experts * 2 == pytest.approx(one.experts, abs=m.n_moe_layers)
    assert two.dense == one.dense and two.expert_shard == 4
    opt_one = stage_states(m, BF16, _deepseek_recipe(1), one, "megatron").optimizer
    opt_two = stage_states(m, BF16, _deepseek_recipe(2), two, "megatron").optimizer
    # experts per rank halve, their optimizer shard group halves too: expert optimizer bytes equal
    assert opt_two == pytest.approx(opt_one, rel=1e-6)


def test_dense_first_layers_sit_on_the_first_stage():
    m = load_model("deepseek-v3")  # layers 0-2 dense
    layout = Layout(tp=2, pp=4, dp_shard=8, zero_stage=1, ep=8, micro_batch_size=1, grad_accum_steps=4)
    stages = pipeline_params(m, layout, "megatron")
    per_moe_layer = m.expert_params_per_layer // 8
    layers = [s.layers for s in stages]
    moe = [s.experts // per_moe_layer for s in stages]
    assert moe[0] == layers[0] - 3 and moe[1:3] == layers[1:3]
    assert moe[3] == layers[3] + m.mtp_layers  # the MTP module's experts on the last stage


def test_moe_activations_grow_with_top_k():
    m = load_model("mixtral-8x7b")
    terms = layer_activation_terms(m, 4096, 1, tp=1)
    top1 = layer_activation_terms(m.__class__.from_json({**m.to_json(), "moe": {**m.to_json()["moe"], "top_k": 1}}),
                                  4096, 1, tp=1)
    assert terms["experts"] == pytest.approx(2 * top1["experts"])
    assert top1["moe_permuted"] > 0 and terms["moe_permuted"] == pytest.approx(2 * top1["moe_permuted"])
    assert terms["router_probs"] > 0


def test_expert_groups_fold_tp_when_etp_is_one():
    shape = Layout(tp=2, dp_shard=4, zero_stage=1, ep=8).mesh_shape
    assert expert_groups(shape, 8, 1) == (tuple(range(8)),)  # ep spans both TP ranks
    assert expert_groups(shape, 4, 2) == ((0, 2, 4, 6), (1, 3, 5, 7))  # etp = tp: ep across dp_shard
    assert expert_groups(shape, 4, 2, "etp") == ((0, 1), (2, 3), (4, 5), (6, 7))
    with pytest.raises(PlanError, match="ep .* etp"):
        Layout(tp=2, dp_shard=4, zero_stage=1, ep=8, etp=2)


def test_old_plan_layouts_without_etp_still_load():
    old = {"tp": 2, "dp_shard": 8, "zero_stage": 1, "ep": 8, "micro_batch_size": 1, "grad_accum_steps": 4}
    layout = Layout.from_json(old)
    assert layout.etp == 1 and layout.expert_dp_shard == 2
    assert Layout.from_json(layout.to_json()) == layout and layout.to_json()["etp"] == 1

"""LoRA in the planner: adapter counts and splits, model states, activations, step time, the search, plan.json
and the CLI flags (planner.memory.lora, planner.simulate.lora, planner.cli.finetune)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from planner.layout import Layout
from planner.memory.estimate import estimate_memory
from planner.memory.lora import adapter_params_per_layer, lora_refusal, target_shapes
from planner.memory.params import stage_params
from planner.memory.states import model_states
from planner.model.load import load_model
from planner.search.bound import StepBound
from planner.simulate.calibration import load_calibration
from planner.simulate.compute import layer_times
from planner.simulate.lora import adapter_pass_s, lora_layer_times, model_flops_per_token
from planner.simulate.step import simulate_step
from planner.training import LORA_TARGETS, TrainingSpec, parse_lora_targets
from tests.conftest import run_cli
from topologies.cluster_load import load_cluster
from topologies.errors import PlanError, UsageError
from topologies.hardware import GIB

LLAMA8 = load_model("llama3-8b")
LLAMA7 = load_model("llama2-7b")
H100_8 = load_cluster("dgx-h100", 8)


def _lora(rank: int = 16, targets: tuple[str, ...] = LORA_TARGETS, **kw) -> TrainingSpec:
    return TrainingSpec(seq_len=2048, global_batch_size=64, finetune="lora", lora_rank=rank, lora_targets=targets,
                        **kw)


def test_adapter_counts_by_hand_and_tp_split_consistent_with_the_base():
    m, r = LLAMA8, 16
    h, q, kv, f = m.hidden, m.q_dim, m.kv_dim, m.ffn_hidden
    attention, whole = adapter_params_per_layer(m, LORA_TARGETS, r, 1)
    assert attention == r * (h + q) + 2 * r * (h + kv) + r * (q + h)
    assert whole == attention + 2 * r * (h + f) + r * (f + h)
    # TP 4: column targets split lora_A on r and lora_B on out, row targets split lora_A on in (B whole)
    q_only, _ = adapter_params_per_layer(m, ("q",), r, 4)
    assert q_only == r // 4 * h + q // 4 * r
    o_only, _ = adapter_params_per_layer(m, ("o",), r, 4)
    assert o_only == r * q // 4 + h * r
    assert set(target_shapes(m)) == set(LORA_TARGETS)


def test_lora_states_are_a_frozen_compute_dtype_base_and_fp32_adapters_with_adam():
    layout = Layout()
    training = _lora()
    states = model_states(LLAMA8, training, layout)
    sp = stage_params(LLAMA8, layout, 0)
    adapters = adapter_params_per_layer(LLAMA8, LORA_TARGETS, 16, 1)[1] * LLAMA8.n_layers
    rope = 2 * LLAMA8.max_seq_len * LLAMA8.head_dim * 4
    assert states.params == 2 * sp.total + 4 * adapters + rope
    assert states.grads == 4 * adapters
    assert states.optimizer == 8 * adapters
    full = model_states(LLAMA8, training.replace(finetune="full"), layout)
    assert states.total < full.total / 6  # 2 bytes + small vs 16 bytes per parameter


def test_zero3_shards_the_frozen_base():
    training = _lora()
    one = model_states(LLAMA8, training, Layout(dp_shard=1, zero_stage=0))
    eight = model_states(LLAMA8, training, Layout(dp_shard=8, zero_stage=3))
    assert eight.params == pytest.approx(one.params / 8, rel=0.02)


def test_qlora_keeps_the_block_linears_in_nf4():
    layout = Layout()
    lora = model_states(LLAMA8, _lora(), layout).params
    qlora = model_states(LLAMA8, _lora().replace(finetune="qlora"), layout).params
    assert qlora < 0.4 * lora


def test_untargeted_frozen_linears_keep_no_input():
    layout = Layout(dp_shard=8, zero_stage=3, micro_batch_size=1, recompute="none")  # no autocast either way
    gpu = H100_8.gpu

    def kept(training):  # what the backward starts with
        return estimate_memory(LLAMA8, training, layout, gpu).phases["backward_start"]["activations"]

    every, attention_only, qv = kept(_lora()), kept(_lora(targets=("q", "k", "v", "o"))), kept(_lora(targets=("q", "v")))
    full = kept(_lora().replace(finetune="full"))
    # gate/up/down untargeted: their inputs (h, and the f-wide product) are not kept
    tokens, d, h, f, n = 2048, 2, LLAMA8.hidden, LLAMA8.ffn_hidden, LLAMA8.n_layers
    assert every - attention_only == pytest.approx(tokens * d * (h + f + 3 * 16) * n, rel=0.01)
    assert qv < attention_only
    # all targets: the full model's saved tensors plus lora_A's outputs (r wide per adapter and token)
    assert every - full == pytest.approx(tokens * d * 16 * 7 * n, rel=0.01)


LAYOUTS = st.builds(
    lambda tp, pp, dp, zero, mb, recompute: Layout(tp=tp, pp=pp, dp_shard=dp if zero else 1,
                                                   dp_replicate=1 if zero else dp, zero_stage=zero if dp > 1 else 0,
                                                   micro_batch_size=mb, recompute=recompute,
                                                   sequence_parallel=tp > 1, grad_accum_steps=4),
    st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2, 4]), st.sampled_from([0, 1, 2, 3]),
    st.sampled_from([1, 2]), st.sampled_from(["none", "selective", "full"]))


@settings(max_examples=40, deadline=None)
@given(layout=LAYOUTS, rank=st.sampled_from([1, 8, 64, 256]), model=st.sampled_from([LLAMA8, LLAMA7]),
       targets=st.sampled_from([LORA_TARGETS, ("q", "v"), ("q", "k", "v", "o"), ("down",)]))
def test_lora_never_needs_more_memory_or_time_than_full_fine_tuning(layout, rank, model, targets):
    assume(layout.tp * layout.pp * layout.dp <= 8)
    training = _lora(rank, targets)
    full = training.replace(finetune="full")
    gpu = H100_8.gpu
    lora_mem = estimate_memory(model, training, layout, gpu)
    full_mem = estimate_memory(model, full, layout, gpu)
    assert lora_mem.peak_bytes <= full_mem.peak_bytes
    cluster = load_cluster("dgx-h100", layout.tp * layout.pp * layout.dp)
    lora_step, full_step = simulate_step(model, training, layout, cluster), simulate_step(model, full, layout, cluster)
    assert lora_step.model_tflops_per_gpu / lora_step.tokens_per_s < full_step.model_tflops_per_gpu / full_step.tokens_per_s
    # Time: the adapters' memory-bound passes (eager, at the engine's calibrated HBM efficiency) can cost more
    # than the frozen weight gradients save when every linear is adapted; with PEFT's default for Llama (q, v)
    # and no TP (whose backward collectives lose the weight-gradient GEMMs that hid them) LoRA is faster
    if layout.tp == 1 and set(targets) <= {"q", "v"}:
        assert lora_step.step_time_s <= full_step.step_time_s


@settings(max_examples=25, deadline=None)
@given(layout=LAYOUTS, ranks=st.tuples(st.integers(1, 512), st.integers(1, 512)))
def test_memory_and_time_grow_with_the_rank(layout, ranks):
    assume(layout.tp * layout.pp * layout.dp <= 8)
    low, high = sorted(ranks)
    gpu = H100_8.gpu
    a, b = _lora(low), _lora(high)
    assert estimate_memory(LLAMA8, a, layout, gpu).peak_bytes <= estimate_memory(LLAMA8, b, layout, gpu).peak_bytes
    cluster = load_cluster("dgx-h100", layout.tp * layout.pp * layout.dp)
    assert simulate_step(LLAMA8, a, layout, cluster).step_time_s <= \
        simulate_step(LLAMA8, b, layout, cluster).step_time_s * (1 + 1e-12)


def test_backward_drops_the_frozen_weight_gradients():
    layout = Layout(tp=1, dp_shard=8, zero_stage=3, micro_batch_size=1)
    cal = load_calibration(None, H100_8.gpu)
    peak = H100_8.gpu.peak_flops("bf16")
    qv = _lora(16, ("q", "v"))
    lt = layer_times(LLAMA8, 2048, 2, layout, H100_8.gpu, peak, cal)
    adapted = lora_layer_times(LLAMA8, qv, layout, H100_8.gpu, peak, cal, lt)
    adapters = adapter_pass_s(LLAMA8, qv, layout, H100_8.gpu, peak, cal)
    assert adapted.backward_weight_s == adapters  # the zero-bubble W is the adapters' alone
    assert adapted.forward_s == pytest.approx(lt.forward_s + adapters)
    assert adapted.backward_input_s == pytest.approx(lt.backward_input_s + adapters)
    full = simulate_step(LLAMA8, qv.replace(finetune="full"), layout, H100_8)
    lora = simulate_step(LLAMA8, qv, layout, H100_8)
    # compute: forward + input gradient (2 of 3 GEMM passes) plus the adapters
    assert 0.6 < lora.time_breakdown_s["compute"] / full.time_breakdown_s["compute"] < 0.8
    assert lora.time_breakdown_s["optimizer"] < full.time_breakdown_s["optimizer"] / 100
    assert model_flops_per_token(LLAMA8, _lora()) < model_flops_per_token(LLAMA8, _lora().replace(finetune="full"))


@pytest.mark.parametrize("layout", [Layout(dp_shard=8, zero_stage=3), Layout(tp=2, dp_shard=4, zero_stage=2,
                                                                             sequence_parallel=True),
                                    Layout(pp=2, dp_shard=4, zero_stage=1, pp_schedule="1f1b"),
                                    Layout(dp_replicate=8)])
def test_search_bound_stays_below_lora_steps(layout):
    bound = StepBound(LLAMA8, H100_8, load_calibration(None, H100_8.gpu), "meshplan")
    for training in (_lora(), _lora(4, ("q", "v")), _lora().replace(finetune="qlora")):
        for recompute in ("none", "full"):  # the step's global batch: 64 sequences
            lay = layout.replace(recompute=recompute, grad_accum_steps=64 // layout.dp)
            step = simulate_step(LLAMA8, training, lay, H100_8).step_time_s
            assert bound.seconds(lay, training) <= step * (1 + 1e-9)


def test_training_keys_round_trip_and_full_plans_keep_their_keys():
    full = TrainingSpec(seq_len=2048, global_batch_size=8)
    assert not {"finetune", "lora_rank", "lora_alpha", "lora_targets"} & set(full.to_json())
    lora = _lora(8, ("v", "q"), lora_alpha=16)
    data = lora.to_json()
    assert data["finetune"] == "lora" and data["lora_rank"] == 8 and data["lora_alpha"] == 16.0
    assert data["lora_targets"] == ["q", "v"]  # canonical order
    assert TrainingSpec.from_json(data) == lora
    assert TrainingSpec.from_json(full.to_json()).finetune == "full"


@pytest.mark.parametrize("bad", [{"finetune": "adapters"}, {"lora_rank": 0}, {"lora_rank": 2.5},
                                 {"lora_alpha": -1}, {"lora_targets": ("q", "q")}, {"lora_targets": ()},
                                 {"lora_targets": ("qkv",)}, {"finetune": "qlora", "dtype": "fp32", "precision": ""}])
def test_bad_lora_training_is_a_plan_error(bad):
    with pytest.raises(PlanError):
        TrainingSpec(seq_len=16, global_batch_size=1, **{"finetune": "lora", **bad})


def test_parse_lora_targets():
    assert parse_lora_targets("v_proj,q") == ("q", "v")
    assert parse_lora_targets("all") == LORA_TARGETS
    for bad in ("", "q,q", "w1"):
        with pytest.raises(UsageError):
            parse_lora_targets(bad)


def test_models_lora_cannot_adapt_are_refused():
    assert lora_refusal(load_model("deepseek-v3"), _lora()) is not None
    assert lora_refusal(LLAMA8, _lora()) is None


def test_plan_answers_lora_on_one_rtx4090_where_full_fine_tuning_does_not_fit():
    args = ("plan", "--model", "llama3-8b", "--cluster", "rtx4090-pcie", "--gpus", "1", "--seq-len", "2048", "--json")
    full = run_cli(*args)
    assert full.code == 3, full.stderr
    lora = run_cli(*args, "--finetune", "lora")
    assert lora.code == 0, lora.stderr
    plan = lora.json()
    assert plan["training"]["finetune"] == "lora" and plan["training"]["lora_targets"] == list(LORA_TARGETS)
    assert plan["prediction"]["peak_memory_bytes"] <= 24e9 and plan["prediction"]["step_time_s"] > 0


def test_plan_answers_lora_on_two_t4s_in_fp16():
    args = ("plan", "--model", "llama2-7b", "--cluster", "t4-pcie", "--gpus", "2", "--precision", "fp16", "--json")
    assert run_cli(*args).code == 3
    lora = run_cli(*args, "--finetune", "lora", "--lora-rank", "8", "--lora-targets", "q,k,v,o")
    assert lora.code == 0, lora.stderr
    plan = lora.json()
    assert plan["training"]["lora_rank"] == 8 and plan["training"]["lora_targets"] == ["q", "k", "v", "o"]
    assert plan["prediction"]["peak_memory_bytes"] <= 16 * GIB


@pytest.mark.parametrize("flags,needle", [
    (("--lora-rank", "8"), "add --finetune lora"),
    (("--finetune", "lora", "--lora-rank", "0"), "--lora-rank"),
    (("--finetune", "lora", "--lora-alpha", "0"), "--lora-alpha"),
    (("--finetune", "lora", "--lora-targets", "q,w9"), "unknown: w9"),
    (("--finetune", "lora", "--engine", "torchtitan"), "trains every parameter"),
    (("--finetune", "adapters"), "--finetune"),
])
def test_bad_lora_flags_exit_2(flags, needle):
    out = run_cli("plan", "--model", "8B", "--gpus", "8", *flags)
    assert out.code == 2 and needle in out.stderr and "Traceback" not in out.stderr


def test_compare_takes_the_lora_flags():
    out = run_cli("compare", "--model", "llama3-8b", "--gpus", "1", "--cluster", "rtx4090-pcie,rtx5090-pcie",
                  "--seq-len", "2048", "--finetune", "lora", "--json")
    assert out.code == 0, out.stderr
    variants = out.json()["variants"]
    assert len(variants) == 2 and all(v["feasible"] and v["prediction"]["step_time_s"] > 0 for v in variants)
    full = run_cli("compare", "--model", "llama3-8b", "--gpus", "1", "--cluster", "rtx4090-pcie", "--seq-len", "2048",
                   "--json")
    assert full.code == 3  # full fine-tuning fits no variant


def test_exports_state_lora_honestly(tmp_path):
    from planner.export import export_plan
    from planner.plan import load_plan

    path = tmp_path / "lora.json"
    assert run_cli("plan", "--model", "llama3-8b", "--cluster", "rtx4090-pcie", "--gpus", "1", "--seq-len", "2048",
                   "--finetune", "lora", "--lora-targets", "q,v", "-o", str(path)).code == 0
    plan = load_plan(path)
    assert plan.training.finetune == "lora" and plan.training.lora_targets == ("q", "v")
    for target in ("deepspeed", "accelerate"):
        notes = " ".join(export_plan(plan, target).notes)
        assert "get_peft_model" in notes and "target_modules=['q_proj', 'v_proj']" in notes, target
    for target in ("torchtitan", "megatron"):
        assert any("trains every parameter" in n for n in export_plan(plan, target).notes), target
    full = load_plan(path).to_json()
    full["training"] = {k: v for k, v in full["training"].items() if not k.startswith(("finetune", "lora"))}
    assert not any("LoRA" in n or "finetune" in n for n in export_plan(plan.__class__.from_json(full),
                                                                        "deepspeed").notes)


def test_the_search_prunes_no_lora_layout_that_fits():
    """The search's model-state floor must not rule out LoRA layouts (it prices full fine-tuning's states):
    its first pass finds the same best layout as the exact re-run that measures every miss, so `--offload auto`
    never ranks an offloading layout above a faster one without offload."""
    from planner.search import search as search_module
    from planner.search.candidates import Pins

    model, cluster = load_model("llama3-8b"), load_cluster("rtx4090-pcie", 4)
    training = {"finetune": "lora", "lora_rank": 16, "lora_alpha": 32}
    none = search_module.search(model, cluster, 4096, None, Pins(offload="none"), "meshplan", recipe=training, top_k=1)
    auto = search_module.search(model, cluster, 4096, None, Pins(offload="auto"), "meshplan", recipe=training, top_k=1)
    assert none.ranked and none.stats.shapes and auto.ranked
    assert auto.ranked[0].result.step_time_s <= none.ranked[0].result.step_time_s * (1 + 1e-9)
    assert auto.ranked[0].layout.offload == "none"

"""The torchtitan engine's memory terms that follow torch's own code of late 2024 (torchtitan 9dec370's runs).

Each test moves one input and checks that the estimate moves by exactly the
term the source implies, so a trait switched off or a wrong byte count fails.
"""

from __future__ import annotations

import pytest

from planner.layout import Layout
from planner.memory.estimate import estimate_memory
from planner.model.load import load_model
from planner.plan import with_stage_layers
from planner.training import TrainingSpec
from topologies.hardware import get_gpu

H100 = get_gpu("h100-sxm")
MODEL = load_model("llama3-8b")
SEQ = 4096


def _estimate(layout: Layout, engine: str = "torchtitan"):
    training = TrainingSpec(seq_len=SEQ, global_batch_size=layout.dp * layout.micro_batch_size
                            * layout.grad_accum_steps, dtype="bf16")
    return estimate_memory(MODEL, training, with_stage_layers(MODEL, layout), H100, engine)


def test_pipeline_receive_buffers_grow_with_the_micro_batches_not_the_in_flight_ones():
    # torch.distributed.pipelining allocates one output-gradient receive buffer per micro-batch on the first
    # rank (and keeps them): going from 4 to 8 micro-batches adds 4 stage outputs there, while 1F1B keeps
    # min(pp, m) = 2 micro-batches' activations in flight either way
    base = dict(pp=2, dp_shard=4, zero_stage=3, micro_batch_size=1, pp_schedule="1f1b")
    short, long = (_estimate(Layout(grad_accum_steps=m, **base)) for m in (4, 8))
    stage_output = SEQ * MODEL.hidden * 2  # one micro-batch's bf16 residual stream
    assert short.activations.stage_output == pytest.approx(stage_output)
    grown = long.per_stage[0]["activations"] - short.per_stage[0]["activations"]
    assert grown == pytest.approx(4 * stage_output, rel=1e-6)


def test_loss_parallel_backward_holds_16_bytes_per_local_logit():
    # DTensor's loss_parallel: 4 B of log-probabilities saved and 12 B more in its fused backward
    layout = Layout(tp=2, dp_shard=4, zero_stage=3, sequence_parallel=True)
    acts = _estimate(layout).activations
    local_logits = SEQ * MODEL.vocab / 2
    assert acts.logits_saved == pytest.approx(4 * local_logits)
    assert acts.loss_transient == pytest.approx(12 * local_logits)
    # without TP the logits are a plain tensor: aten's log_softmax + nll_loss backward, 8 B
    assert _estimate(Layout(dp_shard=8, zero_stage=3)).activations.loss_transient == pytest.approx(8 * SEQ * MODEL.vocab)


def test_compiled_loss_keeps_the_compute_dtype_logits_and_their_gradient():
    # torchtitan from its 2025-06 release (bbb1b616e, 2025-04) compiles its loss with the blocks under
    # --compile: D saved, D more in the backward, no fp32 tensors and no allocator hole; without TP only
    # (loss_parallel stays as it is); the 2024-12 release compiled the blocks alone
    training = TrainingSpec(seq_len=SEQ, global_batch_size=8, dtype="bf16", compile=True)
    layout = with_stage_layers(MODEL, Layout(dp_shard=8, zero_stage=3))
    plain = estimate_memory(MODEL, training, layout, H100, "torchtitan@2024-12")
    compiled = estimate_memory(MODEL, training, layout, H100, "torchtitan@2025-06")
    logits = SEQ * MODEL.vocab
    acts = compiled.activations
    assert (acts.logits_saved, acts.loss_transient, acts.logits_grad, acts.loss_hole) == \
        (pytest.approx(2 * logits), pytest.approx(2 * logits), pytest.approx(2 * logits), 0.0)
    # the peak at the loss backward drops by the eager loss's 12 B - 4 B per logit and its 2 B hole
    assert plain.peak_phase == "backward_start"
    assert plain.peak_bytes - compiled.peak_bytes >= 8 * logits
    # without --compile the 2025-06 release runs the eager loss
    eager = estimate_memory(MODEL, training.replace(compile=False), layout, H100, "torchtitan@2025-06").activations
    assert eager.logits_saved == plain.activations.logits_saved == pytest.approx(4 * logits)
    tp = with_stage_layers(MODEL, Layout(tp=2, dp_shard=4, zero_stage=3, sequence_parallel=True))
    assert estimate_memory(MODEL, training, tp, H100, "torchtitan@2025-06").activations.loss_transient == \
        pytest.approx(12 * logits / 2)


def test_torchtitan_has_no_transformer_engine_loss():
    from planner.engines import get_engine

    training = TrainingSpec(seq_len=SEQ, global_batch_size=8, dtype="bf16", fused_cross_entropy=True, compile=True)
    reason = get_engine("torchtitan").refusal(MODEL, Layout(dp_shard=8, zero_stage=3), "bf16", True, training)
    assert reason is not None and "compiled with the blocks under --compile" in reason
    assert get_engine("megatron").refusal(MODEL, Layout(dp_shard=8, zero_stage=1), "bf16", True, training) is None


def test_eager_final_norm_keeps_its_fp32_copy_and_normalized_output():
    # torchtitan compiles the blocks only: the final RMSNorm saves 4 + 2 B per element, the fused norm 2 B
    layout = Layout(dp_shard=8, zero_stage=3)
    titan = _estimate(layout).activations.output
    meshplan = _estimate(layout, "meshplan").activations.output  # FSDP2 in bf16: the norm saves its bf16 input
    elements = SEQ * MODEL.hidden
    # final norm (torchtitan 6 B, a fused kernel's input 2 B) + the output layer's bf16 input (2 B)
    assert titan == pytest.approx((6 + 2) * elements)
    assert titan - meshplan == pytest.approx(4 * elements)


def test_pipeline_keeps_the_float8_gathered_blocks_in_one_byte():
    # under PP FSDP2 keeps each stage's gathered blocks between micro-batches; with torchao's float8 all-gather
    # the linear weights are Float8Tensors over the 1-byte gathered data, the norms stay bf16
    from planner.memory.params import pipeline_params
    from planner.memory.states import stage_states

    layout = with_stage_layers(MODEL, Layout(pp=2, dp_shard=4, zero_stage=3, micro_batch_size=1, grad_accum_steps=4))
    bf16 = TrainingSpec(seq_len=SEQ, global_batch_size=16, dtype="bf16")
    fp8 = bf16.replace(precision="fp8")
    sp = pipeline_params(MODEL, layout, "torchtitan")[0]
    kept16 = stage_states(MODEL, bf16, layout, sp, "torchtitan").compute_copy
    kept8 = stage_states(MODEL, fp8, layout, sp, "torchtitan").compute_copy
    assert kept16 == 2 * sp.total
    linears = sp.layers * (sp.block - MODEL.norms_per_layer * MODEL.hidden)
    assert kept16 - kept8 == linears

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

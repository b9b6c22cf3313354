"""The closed-loop case both the host-pricing and the calibration-loop tests price: the small Llama
of bench/data/llama_small_cpu.json on 2 CPU ranks, in the four layouts bench/closed_loop.py runs."""

from __future__ import annotations

from planner.layout import Layout
from planner.model.spec import ModelSpec
from planner.training import TrainingSpec

SMALL = ModelSpec(name="small", n_layers=4, hidden=384, n_heads=6, n_kv_heads=2, head_dim=64, ffn_hidden=1024,
                  vocab=8192, max_seq_len=256)
TRAINING = TrainingSpec(seq_len=256, global_batch_size=8, dtype="fp32")
LAYOUTS = {
    "ddp": Layout(dp_replicate=2, micro_batch_size=2, grad_accum_steps=2),
    "zero3": Layout(dp_shard=2, zero_stage=3, micro_batch_size=2, grad_accum_steps=2),
    "tp2": Layout(tp=2, micro_batch_size=2, grad_accum_steps=4),
    "pp2": Layout(pp=2, micro_batch_size=2, grad_accum_steps=4),
}

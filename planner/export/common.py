"""Pieces every exporter shares: the plan summary, comment blocks, the stage split.

Each export starts with the same few comment lines, so a reader of any
engine's file sees which plan it came from and what did not survive the
translation.
"""

from __future__ import annotations

from collections.abc import Iterable

from planner.layout import Layout
from planner.plan import Plan, with_stage_layers
from planner.training import TrainingSpec
from topologies.errors import MeshplanError, UsageError
from topologies.hardware import GIB


def summary_lines(plan: Plan) -> list[str]:
    """What the plan is, in a few lines: model, cluster, degrees, batch arithmetic."""
    lay, cl, tr = plan.layout, plan.cluster, plan.training
    lines = [
        f"meshplan plan: {plan.model.name} ({plan.model.n_layers} layers) on {cl.name}, "
        f"{cl.n_nodes} node(s) x {cl.gpus_per_node} = {plan.world_size} ranks",
        f"degrees: tp {lay.tp} x cp {lay.cp} x dp {lay.dp} (replicate {lay.dp_replicate} x shard "
        f"{lay.dp_shard}, ZeRO-{lay.zero_stage}) x pp {lay.pp}" + (f", ep {lay.ep}" if lay.ep > 1 else ""),
        f"batch: micro {lay.micro_batch_size} x accumulation {lay.grad_accum_steps} x dp {lay.dp} = "
        f"{tr.global_batch_size} sequences of {tr.seq_len} tokens, {tr.dtype}",
    ]
    if lay.pp > 1:
        lines.append(f"pipeline: {lay.pp_schedule}, {lay.virtual_stages} chunk(s) per rank, "
                     f"layers per chunk {list(stage_layers(plan))}")
    if plan.prediction is not None:
        p = plan.prediction
        lines.append(f"predicted: {p.step_time_s:.3g} s per step, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}")
    return lines


def comment_block(lines: Iterable[str], prefix: str = "# ") -> str:
    """Lines as comments, one per line, ending with a newline (empty input gives '')."""
    return "".join(f"{prefix}{line}".rstrip() + "\n" for line in lines)


def notes_lines(notes: Iterable[str]) -> list[str]:
    """The 'could not express' list as comment lines (a clear 'nothing' when empty)."""
    notes = list(notes)
    if not notes:
        return ["could not express: nothing, every part of the plan is expressed above"]
    return ["could not express:"] + [f"  - {note}" for note in notes]


def stage_layers(plan: Plan) -> tuple[int, ...]:
    """Transformer layers per (virtual) pipeline stage, in model order (balanced when the plan leaves it empty)."""
    return with_stage_layers(plan.model, plan.layout).layers_per_stage


def predicted_change(plan: Plan, layout: Layout, engine: str | None = None,
                     training: TrainingSpec | None = None) -> str:
    """What running `layout` instead of the plan's costs, as simulate_step predicts it (one clause).

    Used by every exporter that maps a layout its target cannot run to the
    nearest one it can: the note then says what changes in time and memory.
    `engine` is the engine that runs the changed layout (default: the plan's);
    `training` replaces the plan's where the change also moves the batch.
    """
    from planner.simulate.step import simulate_step

    engine = engine or plan.engine
    layout = with_stage_layers(plan.model, layout)
    try:
        before = simulate_step(plan.model, plan.training, plan.layout, plan.cluster, engine=engine)
        after = simulate_step(plan.model, training or plan.training, layout, plan.cluster, engine=engine)
    except MeshplanError as exc:  # a layout the simulator cannot price: say so rather than guess
        return f"predicted cost unknown ({exc})"
    gib, cap = GIB, plan.cluster.gpu.memory_bytes
    change = after.step_time_s / before.step_time_s - 1
    fits = "fits" if after.memory.peak_bytes <= cap else "does NOT fit"
    return (f"predicted step {before.step_time_s:.3g} s -> {after.step_time_s:.3g} s ({change:+.1%}), peak memory "
            f"{before.memory.peak_bytes / gib:.1f} -> {after.memory.peak_bytes / gib:.1f} GiB per GPU "
            f"({fits} in {cap / gib:.0f} GiB; {engine} engine)")


def parse_version(text: str) -> tuple[int, ...]:
    """'0.19.8' -> (0, 19, 8); a UsageError naming the value otherwise."""
    parts = text.strip().lstrip("v").split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise UsageError(f"--target-version must look like 0.19 or 0.19.8, got {text!r}")
    return tuple(int(p) for p in parts)


def lora_notes(plan, target: str) -> list[str]:
    """What a LoRA plan (TrainingSpec.finetune) needs beyond the exported config, per target: DeepSpeed and
    accelerate have no adapters of their own (Hugging Face PEFT's get_peft_model puts them on the model before
    deepspeed.initialize / accelerator.prepare); torchtitan's and Megatron-Core's training loops train every
    parameter."""
    tr = plan.training
    if not tr.lora:
        return []
    what = (f"finetune {tr.finetune} (rank {tr.lora_rank}, alpha {tr.lora_alpha:g}, targets "
            f"{','.join(tr.lora_targets)})")
    if tr.finetune == "qlora":
        what += " with a 4-bit NF4 base"
    if target in ("deepspeed", "accelerate"):
        name = "DeepSpeed's config" if target == "deepspeed" else "accelerate's config"
        modules = [f"{t}_proj" for t in tr.lora_targets]  # the Llama/Qwen/Mistral module names PEFT matches
        return [f"{what}: {name} has no LoRA; wrap the model with peft.get_peft_model(model, LoraConfig(r="
                f"{tr.lora_rank}, lora_alpha={tr.lora_alpha:g}, target_modules={modules})) before "
                f"{'deepspeed.initialize' if target == 'deepspeed' else 'accelerator.prepare'}, or the run trains "
                "every parameter and will not fit the plan's memory"]
    return [f"{what}: {target} trains every parameter (no LoRA adapters in its training loop); the exported run "
            "is full fine-tuning, which needs far more memory than the plan; run LoRA with `meshplan execute`"]

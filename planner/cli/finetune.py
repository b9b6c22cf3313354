"""`--finetune full|lora|qlora`, `--lora-rank`, `--lora-alpha`, `--lora-targets`: which weights train.

Shared by `plan` and `compare`; the values reach the search as TrainingSpec
fields (planner.training: finetune, lora_rank, lora_alpha, lora_targets),
beside the --recipe options, and plan.json's training keeps them.
"""

from __future__ import annotations

import click

from planner.training import (
    DEFAULT_LORA_ALPHA,
    DEFAULT_LORA_RANK,
    FINETUNE_KINDS,
    LORA_TARGETS,
    MAX_LORA_RANK,
    parse_lora_targets,
)
from topologies.errors import UsageError


def finetune_options(f):
    """The four flags, in this order on --help."""
    for decorator in reversed([
        click.option("--finetune", type=click.Choice(FINETUNE_KINDS), default="full", show_default=True,
                     help="Which weights train: full (every parameter), lora (frozen base in the compute dtype, "
                          "trained low-rank adapters on --lora-targets), qlora (LoRA over a 4-bit NF4 base)."),
        click.option("--lora-rank", "lora_rank", type=click.IntRange(1, MAX_LORA_RANK), default=None,
                     help=f"LoRA's rank r (lora/qlora). [default: {DEFAULT_LORA_RANK}]"),
        click.option("--lora-alpha", "lora_alpha", type=click.FloatRange(0, min_open=True), default=None,
                     help=f"LoRA's alpha: adapters' output scaled by alpha / r. [default: {DEFAULT_LORA_ALPHA:g}]"),
        click.option("--lora-targets", "lora_targets", default=None, metavar="NAME,...",
                     help=f"Adapted linears of every block, from {','.join(LORA_TARGETS)} (or all). "
                          "[default: all: adapters on every linear, as QLoRA found needed to match full "
                          "fine-tuning]"),
    ]):
        f = decorator(f)
    return f


def finetune_fields(params: dict) -> dict[str, object]:
    """TrainingSpec fields of the parsed flags ({} for full fine-tuning); LoRA flags without --finetune lora are a
    UsageError."""
    kind = params.get("finetune") or "full"
    given = [flag for flag, key in (("--lora-rank", "lora_rank"), ("--lora-alpha", "lora_alpha"),
                                    ("--lora-targets", "lora_targets")) if params.get(key) is not None]
    if kind == "full":
        if given:
            raise UsageError(f"{', '.join(given)} {'configure' if len(given) > 1 else 'configures'} LoRA adapters: add --finetune lora (or qlora), or drop "
                             f"{'them' if len(given) > 1 else 'it'}")
        return {}
    fields: dict[str, object] = {"finetune": kind}
    if params.get("lora_rank") is not None:
        fields["lora_rank"] = params["lora_rank"]
    if params.get("lora_alpha") is not None:
        fields["lora_alpha"] = float(params["lora_alpha"])
    if params.get("lora_targets") is not None:
        fields["lora_targets"] = parse_lora_targets(params["lora_targets"])
    return fields


def check_finetune(model, engine: str, precision: str, fields: dict[str, object]) -> None:
    """UsageErrors, before any search, for a LoRA the model or the engine cannot take (the model's
    planner.memory.lora.lora_refusal, the engine's refusal of finetune)."""
    if not fields:
        return
    from planner.engines import get_engine
    from planner.layout import Layout
    from planner.memory.lora import lora_refusal
    from planner.training import training_for
    from topologies.errors import PlanError

    try:
        training = training_for(1, 1, precision, **fields)
    except PlanError as exc:
        raise UsageError(f"--finetune {fields['finetune']}: {str(exc).removeprefix('training: ')}") from None
    refusal = lora_refusal(model, training) or get_engine(engine).refusal(model, Layout(), training.dtype, True,
                                                                          training)
    if refusal:
        raise UsageError(f"--finetune {training.finetune}: {refusal}")

"""`meshplan models list|show`: the model catalog."""

from __future__ import annotations

import click

from planner.model.presets import PRESETS, SIZE_ALIASES
from planner.model.spec import ModelSpec
from topologies.terminal import console, emit_json


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f}B"


def model_summary(m: ModelSpec) -> dict:
    """The spec plus its derived counts, for `models show --json`."""
    return {
        **m.to_json(),
        "total_params": m.total_params,
        "active_params": m.active_params,
        "embedding_params": m.embedding_params,
        "params_per_layer": m.params_per_layer,
        "model_flops_per_token": m.model_flops_per_token(min(m.max_seq_len, 4096)),
    }


@click.group(epilog="\b\nExamples:\n  meshplan models list\n  meshplan models show 70B\n  meshplan models show ./Llama-3.1-8B/config.json\n")
def models() -> None:
    """The model catalog: presets, size aliases and config files."""


@models.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def list_models(as_json: bool) -> None:
    """List the presets and the size aliases that point at them."""
    aliases = {v: k for k, v in SIZE_ALIASES.items()}
    rows = [
        {"name": m.name, "alias": aliases.get(m.name), "params": m.total_params, "layers": m.n_layers,
         "hidden": m.hidden, "heads": m.n_heads, "kv_heads": m.n_kv_heads, "moe": m.moe is not None}
        for m in PRESETS.values()
    ]
    if as_json:
        emit_json(rows)
        return
    from rich.table import Table

    table = Table(title="meshplan models")
    for col in ("name", "alias", "params", "layers", "hidden", "heads", "kv heads"):
        table.add_column(col, justify="right" if col not in ("name", "alias") else "left")
    for r in rows:
        table.add_row(r["name"], r["alias"] or "", _billions(r["params"]), str(r["layers"]), str(r["hidden"]),
                      str(r["heads"]), str(r["kv_heads"]))
    console().print(table)


@models.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def show_model(name: str, as_json: bool) -> None:
    """Show one model's architecture and parameter count (NAME: preset, size alias or config.json)."""
    from planner.cli.inputs import load_model_arg

    m = load_model_arg(name)
    summary = model_summary(m)
    if as_json:
        emit_json(summary)
        return
    from rich.table import Table

    table = Table(title=f"{m.name}: {_billions(m.total_params)} parameters", show_header=False)
    table.add_column("field")
    table.add_column("value", justify="right")
    for key in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden", "vocab", "max_seq_len",
                "mlp", "norm", "position", "tie_embeddings", "bias"):
        table.add_row(key, str(getattr(m, key)))
    if m.moe:
        table.add_row("experts", f"{m.moe.n_experts} (top {m.moe.top_k}, ffn {m.moe.expert_ffn_hidden})")
        table.add_row("active params", _billions(m.active_params))
    table.add_row("total params", f"{m.total_params:,} ({_billions(m.total_params)})")
    table.add_row("embedding params", f"{m.embedding_params:,}")
    table.add_row("params per layer", f"{m.params_per_layer:,}")
    seq = min(m.max_seq_len, 4096)
    table.add_row(f"train FLOPs/token (s={seq})", f"{m.model_flops_per_token(seq):.3e}")
    console().print(table)

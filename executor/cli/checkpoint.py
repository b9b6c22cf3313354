"""`meshplan checkpoint export | verify`: a sharded DCP checkpoint as a Hugging Face model or one torch state
dict; its checksums.

--format hf (a directory): what transformers' save_pretrained writes, loadable
with AutoModelForCausalLM.from_pretrained (executor/hf/export.py), written
shard by shard. --format torch (a file, the default): the single-process
model's parameter names and full tensors, so
`model.load_state_dict(torch.load("model.pt", weights_only=True))` works on
`executor.model.build_model(spec)` whatever layout wrote the checkpoint.
torch is imported inside the verb, never at `meshplan --help`.
"""

from __future__ import annotations

from pathlib import Path

import click

from topologies.errors import UsageError
from topologies.terminal import emit_json


@click.group(epilog="\b\nExamples:\n  meshplan checkpoint export runs/p --to model.pt\n  meshplan checkpoint export runs/p --to out/model --format hf --dtype bf16\n  meshplan checkpoint export runs/p/checkpoints/step-100 --to model.pt\n  meshplan checkpoint verify runs/p\n")
def checkpoint() -> None:
    """Work with the checkpoints `execute --checkpoint-every K` writes under OUT/checkpoints/."""


@checkpoint.command("export")
@click.argument("path", type=click.Path())
@click.option("--to", "to", type=click.Path(), required=True,
              help="--format torch: the file to write; --format hf: a new (or empty) directory.")
@click.option("--format", "fmt", type=click.Choice(["torch", "hf", "peft"]), default="torch", show_default=True,
              help="torch: one state dict (FQN -> full tensor); hf: a Hugging Face model directory; peft: a LoRA "
                   "run's adapters as PEFT's adapter directory (PeftModel.from_pretrained).")
@click.option("--merge-lora", "merge_lora", is_flag=True,
              help="--format hf of a LoRA run: fold the adapters into the weights (W + alpha/r * B A).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default=None,
              help="--format hf: the weights' dtype. Default: the --init-from weights' dtype, else the checkpoint's.")
@click.option("--max-shard-size", default="5GB", show_default=True, metavar="SIZE",
              help="--format hf: the largest safetensors file (one tensor larger than it gets a file of its own).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only: source, file, tensors, elements, bytes, dtypes.")
def export(path: str, to: str, fmt: str, merge_lora: bool, dtype: str | None, max_shard_size: str,
           as_json: bool) -> None:
    """Consolidate checkpoint PATH into one state dict for the single-process model, or a Hugging Face model.

    PATH is OUT/checkpoints/step-K, or a run directory OUT (or OUT/checkpoints),
    which means the checkpoint its `latest` pointer names.
    """
    from topologies.files import check_output

    if merge_lora and fmt != "hf":
        raise UsageError(f"--merge-lora applies to --format hf (got --format {fmt}); --format peft writes the "
                         "adapters alone")
    if fmt == "hf":
        export_hf(Path(path), Path(to), dtype, max_shard_size, as_json, merge_lora)
        return
    if fmt == "peft":
        export_peft_dir(Path(path), Path(to), dtype, as_json)
        return
    if dtype is not None:
        raise UsageError("--dtype applies to --format hf; --format torch keeps the checkpoint's dtype")
    from executor.components.checkpoint import consolidate

    check_output(to, "--to", stdout_ok=False)
    step_dir = resolve_checkpoint(Path(path))
    state = consolidate(step_dir)
    n_bytes = write_state_dict(state, Path(to))
    summary = {
        "source": str(step_dir),
        "file": str(to),
        "tensors": len(state),
        "elements": sum(t.numel() for t in state.values()),  # tied weights count under each name
        "bytes": n_bytes,
        "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in state.values()}),
    }
    if as_json:
        emit_json(summary)
        return
    click.echo(
        f"exported {step_dir} -> {to}: {summary['tensors']} tensors, {summary['elements']:,} elements "
        f"({', '.join(summary['dtypes'])}), {n_bytes / 2**20:.1f} MiB\n"
        f"load it with: model.load_state_dict(torch.load({str(to)!r}, weights_only=True))"
    )


def export_peft_dir(path: Path, to: Path, dtype: str | None, as_json: bool) -> None:
    """--format peft: the run's plan gives the adapters' rank, alpha and targets (executor.hf.peft)."""
    from executor.hf.export import SOURCE
    from executor.hf.peft import export_peft

    step_dir = resolve_checkpoint(path)
    plan = _run_plan(step_dir, "peft")
    source = run_of(step_dir) / SOURCE
    base = None
    if (source / "source.json").is_file():
        import json

        base = json.loads((source / "source.json").read_text()).get("path")
    result = export_peft(step_dir, to, plan.model, plan.training, base, dtype)
    summary = {"source": str(step_dir), "directory": str(to), "format": "peft", **result,
               "files": sorted(p.name for p in to.iterdir())}
    if as_json:
        emit_json(summary)
        return
    click.echo(f"exported {step_dir} -> {to}/: {result['tensors']} adapter tensors on "
               f"{', '.join(result['target_modules'])} ({result['dtype']})\n"
               f"load it with: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), {str(to)!r})")


def _run_plan(step_dir: Path, fmt: str):
    from planner.plan import load_plan

    run_dir = run_of(step_dir)
    if not (run_dir / "plan.json").is_file():
        raise UsageError(f"{str(step_dir)!r} is not inside a run directory with plan.json (OUT/checkpoints/"
                         f"step-K): --format {fmt} needs the plan to name the model")
    return load_plan(run_dir / "plan.json")


def export_hf(path: Path, to: Path, dtype: str | None, max_shard_size: str, as_json: bool,
              merge_lora: bool = False) -> None:
    """--format hf: the run's plan names the model; its hf_source/ the config and tokenizer to carry."""
    from executor.hf.export import SOURCE, check_destination, export_checkpoint
    from planner.plan import load_plan
    from topologies.cli.topo import parse_size

    check_destination(to)
    try:
        shard_bytes = parse_size(max_shard_size)
    except UsageError:
        raise UsageError(f"--max-shard-size {max_shard_size!r} is not a size; use e.g. 5GB, 500MB") from None
    if shard_bytes < 1:
        raise UsageError(f"--max-shard-size must be at least 1 byte, got {max_shard_size!r}")
    step_dir = resolve_checkpoint(path)
    run_dir = run_of(step_dir)
    if not (run_dir / "plan.json").is_file():
        raise UsageError(f"{str(step_dir)!r} is not inside a run directory with plan.json (OUT/checkpoints/"
                         "step-K): --format hf needs the plan to name the model")
    plan = load_plan(run_dir / "plan.json")
    source = run_dir / SOURCE if (run_dir / SOURCE).is_dir() else None
    if merge_lora and not plan.training.lora:
        raise UsageError("--merge-lora: this run trained every parameter (finetune full); drop --merge-lora")
    scale = plan.training.lora_alpha / plan.training.lora_rank if merge_lora else None
    result = export_checkpoint(step_dir, to, plan.model, source, dtype, shard_bytes, scale)
    files = sorted(p.name for p in to.iterdir())
    summary = {"source": str(step_dir), "directory": str(to), "format": "hf", "dtype": result.dtype,
               "shards": len(result.shards), "files": files,
               "bytes": sum((to / f).stat().st_size for f in files)}
    if as_json:
        emit_json(summary)
        return
    click.echo(f"exported {step_dir} -> {to}/: {len(result.shards)} safetensors file"
               f"{'s' if len(result.shards) > 1 else ''} ({result.dtype}), {summary['bytes'] / 2**20:.1f} MiB, "
               f"{', '.join(f for f in files if not f.endswith('.safetensors'))}\n"
               f"load it with: AutoModelForCausalLM.from_pretrained({str(to)!r})")


def run_of(step_dir: Path) -> Path:
    """The run directory holding OUT/checkpoints/step-K."""
    return step_dir.resolve().parent.parent


def resolve_checkpoint(path: Path) -> Path:
    """A step directory as given, or the one `latest` names under a run or checkpoints directory."""
    from executor.components.checkpoint import CHECKPOINTS, latest_step

    if (path / ".metadata").is_file():
        return path
    if not path.exists():
        raise UsageError(f"checkpoint {str(path)!r} does not exist: pass OUT/checkpoints/step-K or a run directory")
    run_dir = path.parent if path.name == CHECKPOINTS else path
    if not (run_dir / CHECKPOINTS).is_dir():
        raise UsageError(
            f"{str(path)!r} is neither a checkpoint (no .metadata) nor a run directory with {CHECKPOINTS}/"
        )
    root = run_dir / CHECKPOINTS
    step = latest_step(root)
    if step is None:
        raise UsageError(f"{str(root)!r} holds no complete checkpoint")
    return root / f"step-{step}"


def write_state_dict(state: dict, to: Path) -> int:
    """torch.save through topologies.files (atomic for a regular file, in place for a device); bytes written."""
    import torch

    from topologies.files import write_with

    written = 0

    def save(f) -> None:
        nonlocal written
        torch.save(state, f)
        written = f.tell() if f.seekable() else 0

    write_with(to, save, what="state dict")
    return written


@checkpoint.command("verify")
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True,
              help="Print JSON only: root, latest, and per checkpoint step, path, ok, unverified, files, bytes, problems.")
def verify(path: str, as_json: bool) -> None:
    """Check every checkpoint of run PATH (or one step-K directory) against the sha256 of each file written with
    it (executor.resilience.integrity). Exit 0 when all verify, 1 naming each damaged file otherwise.

    Checkpoints written before meshplan recorded checksums are listed as unverified.
    """
    from executor.resilience.checkpoints import CHECKPOINTS, STEP_RE, pointer_step
    from executor.resilience.integrity import verify_run
    from topologies.errors import ExecutionError

    given = Path(path)
    if not given.exists():
        raise UsageError(f"{path!r} does not exist: pass a run directory (--out of `meshplan execute`) or "
                         f"OUT/{CHECKPOINTS}/step-K")
    step_dir = given if STEP_RE.match(given.name) else None
    root = given.parent if step_dir else given if given.name == CHECKPOINTS else given / CHECKPOINTS
    if not root.is_dir():
        raise UsageError(f"{path!r} holds no {CHECKPOINTS}/ directory: is it a run directory?")
    rows = [r for r in verify_run(root) if step_dir is None or r["path"] == str(step_dir)]
    latest = pointer_step(root)
    checked = [r for r in rows if not r.get("set_aside")]
    bad = [r for r in checked if not r["ok"]]
    if as_json:
        emit_json({"root": str(root), "latest": f"step-{latest}" if latest is not None else None,
                   "ok": not bad, "checkpoints": rows})
    else:
        _print_verify(rows, latest)
    if not checked:
        raise UsageError(f"{str(root)!r} holds no checkpoint to verify")
    if bad:
        raise ExecutionError(f"{len(bad)} of {len(checked)} checkpoint(s) fail verification: "
                             + "; ".join(f"step-{r['step']}: {r['problems'][0]}" for r in bad))


def _print_verify(rows: list[dict], latest: int | None) -> None:
    for r in rows:
        name = f"step-{r['step']}"
        mark = "   <- latest" if r["step"] == latest and not r.get("set_aside") else ""
        if r.get("set_aside"):
            click.echo(f"{Path(r['path']).name:<14} set aside earlier (failed verification on load)")
        elif r["problems"]:
            click.echo(f"{name:<14} DAMAGED   {'; '.join(r['problems'])}{mark}")
        elif r["unverified"]:
            click.echo(f"{name:<14} unverified: no checksums (written before meshplan recorded them){mark}")
        else:
            click.echo(f"{name:<14} ok        {r['files']} files, {r['bytes'] / 2**20:.1f} MiB{mark}")


"""`meshplan export`: a plan in another engine's language (thin layer over planner.export).

The exported file goes to stdout (or -o FILE); what the engine cannot
express goes to stderr, one line each, so `meshplan export p.json --to
deepspeed > ds_config.json` leaves a clean file. Files that accompany the
main one (DeepSpeed's hostfile) are written next to -o FILE.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from topologies.errors import UsageError

EXECUTABLE_SUFFIXES = (".sh", ".sbatch")


def _write(path: Path, text: str) -> None:
    from topologies.files import write_text

    write_text(path, text, what="export", mode=0o755 if path.suffix in EXECUTABLE_SUFFIXES else None)


def _hosts(value: str | None) -> list[str] | None:
    return value.split(",") if value else None


@click.command("export", epilog="\b\nExamples:\n  meshplan plan --model 8B --gpus 16 -o plan.json\n  meshplan export plan.json --to torchtitan -o train.toml\n  meshplan export plan.json --to deepspeed > ds_config.json\n")
@click.argument("plan_file", metavar="PLAN.json")
@click.option("--to", "target", required=True, metavar="TARGET",
              help="torchtitan | megatron | deepspeed | accelerate | torchrun | slurm")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="write the file here instead of stdout")
@click.option("--hosts", help="node names in order, comma separated (hostfile, rendezvous address)")
@click.option("--json", "as_json", is_flag=True, help="print the export (text, notes, extra files) as JSON")
@click.option("--target-version", "version", metavar="X.Y[.Z]",
              help="release of the target to write for (torchtitan 0.2 TOML | 0.3 Python module; deepspeed, "
                   "megatron-core); default: the newest meshplan checks")
def export(plan_file: str, target: str, output: str | None, hosts: str | None, as_json: bool,
           version: str | None) -> None:
    """Export PLAN.json to another engine's config, stating what it could not express."""
    from planner.export import TARGETS, export_plan
    from planner.plan import load_plan
    from topologies.errors import nearest
    from topologies.files import check_output, is_regular_destination
    from topologies.terminal import emit_json, log

    check_output(output, "-o")
    if target not in TARGETS:
        raise UsageError(f"unknown export target {target!r}{nearest(target, TARGETS)}; use one of {', '.join(TARGETS)}")
    plan = load_plan(plan_file)
    result = export_plan(plan, target, hosts=_hosts(hosts), plan_path=plan_file, version=version)
    if output:
        main = Path(output)
        _write(main, result.text)
        log(f"wrote {main}")
        for name, text in result.extra_files:
            if is_regular_destination(main):
                _write(main.with_name(name), text)
                log(f"wrote {main.with_name(name)}")
            else:  # a device, pipe or stdout has no directory to put companions in
                log(f"--- {name} (written next to a regular -o file) ---\n{text.rstrip()}")
    if as_json:
        emit_json(result.to_json())
    elif not output:
        sys.stdout.write(result.text)
        for name, text in result.extra_files:
            log(f"--- {name} (written next to the file with -o) ---\n{text.rstrip()}")
    for note in result.notes:
        log(f"could not express: {note}")

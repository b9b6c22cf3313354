"""`meshplan execute plan.json`: run a plan for real under torchrun (or dry-run / print the launch).

torch is imported only inside the verb, after the flags are checked.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click

from planner.run_flags import DEFAULT_RUN, RunFlags
from topologies.errors import UsageError

PRINT_LAUNCH = ("torchrun", "slurm")


def _positive_float(ctx, param, value):
    if value is not None and not 0 < value < float("inf"):  # NaN fails both comparisons
        raise click.BadParameter(f"must be a finite number > 0, got {value}")
    return value


@click.command("execute", context_settings={"help_option_names": ["-h", "--help"]},
               epilog="\b\nExamples:\n  meshplan execute plan.json --steps 100 --out runs/p --checkpoint-every 20\n  meshplan execute plan.json --steps 200 --out runs/p --resume\n  meshplan execute plan.json --data chat.jsonl --tokenizer ./Qwen2.5-0.5B-Instruct --out runs/sft\n  meshplan execute plan.json --dry-run\n  meshplan execute plan.json --print-launch slurm > job.sbatch\n")
@click.argument("plan_path", metavar="PLAN.json")
@click.option("--steps", type=click.IntRange(min=1), default=DEFAULT_RUN.steps, show_default=True,
              help="Optimizer steps to run.")
@click.option("--out", "out", type=click.Path(file_okay=False), default=None,
              help="Run directory: metrics.jsonl, plan.json, summary.json, checkpoints/. Default runs/<plan name>.")
@click.option("--seed", type=int, default=DEFAULT_RUN.seed, show_default=True,
              help="Seeds initialization and data: same seed, same model and data on every layout.")
@click.option("--data", type=click.Path(dir_okay=False), default=None,
              help="Text: .jsonl ({\"text\"}, {\"prompt\", \"completion\"} or {\"messages\"} per line), .txt "
                   "(a document per line), .parquet (same fields as columns), tokenized with --tokenizer and cached "
                   "next to the file; or token ids: .npy, .bin (uint16/uint32). Default: synthetic Markov tokens.")
@click.option("--tokenizer", type=click.Path(), default=None,
              help="Tokenizer for text --data: a tokenizer.json or a Hugging Face model directory holding one "
                   "(its tokenizer_config.json gives EOS and the chat template). Default: the --init-from directory.")
@click.option("--lr", type=float, default=None, callback=_positive_float,
              help="Peak learning rate. Default min(3e-3, 0.02/sqrt(hidden)).")
@click.option("--log-every", type=click.IntRange(min=1), default=DEFAULT_RUN.log_every, show_default=True,
              help="Print a progress line every K steps.")
@click.option("--dry-run", is_flag=True, help="Print the launch (nodes, rendezvous, torchrun command), the "
              "preflight's verdict on this machine, the micro-batching, and rank 0 built under a fake process group "
              "(mesh, modules, parameter shards, its memory next to the memory model's); train nothing.")
@click.option("--nnodes", type=click.IntRange(min=1), default=None, help="Nodes in the job. Default: the plan's.")
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True, help="This node's rank.")
@click.option("--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous (node 0), for --nnodes > 1.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="Restart the worker group this many times when a worker dies (resumes from the latest checkpoint).")
@click.option("--print-launch", type=click.Choice(PRINT_LAUNCH), default=None,
              help="Print the per-node torchrun commands or an sbatch script, and run nothing.")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=DEFAULT_RUN.checkpoint_every, show_default=True,
              help="Save a checkpoint every K steps (0: never).")
@click.option("--keep-checkpoints", type=click.IntRange(min=1), default=None, help="Keep only the newest N checkpoints.")
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in --out; metrics.jsonl is appended.")
@click.option("--overwrite", is_flag=True,
              help="Start over in an existing --out: delete its metrics, summary and checkpoints first.")
@click.option("--compile", "compile_", is_flag=True,
              help="torch.compile each transformer block (after recomputation, before FSDP; torchtitan's order).")
def execute(plan_path: str, steps: int, out: str | None, seed: int, data: str | None, tokenizer: str | None,
            lr: float | None,
            log_every: int, dry_run: bool, nnodes: int | None, node_rank: int, rdzv_endpoint: str | None,
            max_restarts: int, print_launch: str | None, checkpoint_every: int, keep_checkpoints: int | None,
            resume: bool, overwrite: bool, compile_: bool) -> None:
    """Train with the layout of PLAN.json on this machine's GPUs (or CPU ranks for a cpu-cluster plan).

    One node: runs torchrun itself with one worker per rank. Several nodes:
    run the same command on every node with --nnodes/--node-rank/--rdzv-endpoint
    (see --print-launch).
    """
    from planner.plan import load_plan

    plan = load_plan(plan_path)
    nnodes = plan.cluster.n_nodes if nnodes is None else nnodes
    if node_rank >= nnodes:
        raise UsageError(f"--node-rank {node_rank} must be below --nnodes {nnodes}")
    if nnodes > 1 and rdzv_endpoint is None and not (print_launch or dry_run):
        from executor.preflight import Found, check_hardware

        check_hardware(plan, Found.detect(), nnodes)  # no GPU here says more than a missing endpoint
        raise UsageError(
            f"the plan runs on {nnodes} nodes: give every node --nnodes {nnodes} --node-rank R "
            "--rdzv-endpoint HOST:PORT (node 0's address); --print-launch torchrun prints the commands"
        )
    if resume and overwrite:
        raise UsageError("--resume continues the run in --out and --overwrite deletes it: pass one of them")
    run_dir = Path(out) if out else Path("runs") / Path(plan_path).stem
    flags = RunFlags(steps=steps, out=out, seed=seed, data=data, tokenizer=tokenizer, lr=lr, log_every=log_every,
                     checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints, resume=resume,
                     compile=compile_)
    if print_launch:  # every node repeats the run flags (--out only when given)
        click.echo(_launch_text(plan, plan_path, print_launch, nnodes, rdzv_endpoint, flags))
        return
    from executor.parallel.parallelize import check_compile, check_supported

    check_supported(plan)
    if compile_:
        check_compile(plan)
    if dry_run:
        from executor.dryrun import dry_run as run_dry

        run_dry(plan, plan_path=Path(plan_path), flags=flags.replace(out=str(run_dir)), nnodes=nnodes,
                node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, max_restarts=max_restarts)
        return
    if node_rank == 0:  # other nodes may share node 0's directory; node 0 alone decides what it holds
        from executor.preflight import check_run_dir

        check_run_dir(run_dir, resume, overwrite)
    _run(plan, Path(plan_path), run_dir, nnodes, node_rank, rdzv_endpoint, max_restarts, flags.replace(out=str(run_dir)),
         clear=overwrite and node_rank == 0)


def _launch_text(plan, plan_path: str, kind: str, nnodes: int, rdzv_endpoint: str | None, flags: RunFlags) -> str:
    """The launch commands' single implementation (planner/export/launch.py)."""
    from planner.export import launch as export_launch

    if kind == "slurm":
        return export_launch.slurm_script(plan, plan_path, run=flags)
    kwargs = {"rdzv_endpoint": rdzv_endpoint} if rdzv_endpoint else {}
    commands = export_launch.torchrun_commands(plan, plan_path, nnodes=nnodes, run=flags, **kwargs)
    return "\n".join(" ".join(_shell_word(arg) for arg in cmd) for cmd in commands)


def _shell_word(arg: str) -> str:
    """Quote for a POSIX shell, but let $HEAD_NODE (the export module's placeholder) expand."""
    return f'"{arg}"' if arg.startswith("$") and re.fullmatch(r"\$\w+(:\d+)?", arg) else shlex.quote(arg)


def _run(plan, plan_path: Path, run_dir: Path, nnodes: int, node_rank: int, rdzv_endpoint: str | None,
         max_restarts: int, flags: RunFlags, clear: bool = False) -> None:
    from executor.launch import launch, run_id, torchrun_argv
    from executor.parallel.mesh import device_type_for
    from executor.preflight import Found, check_data, check_hardware, clear_run_dir, prepare_out
    from topologies.errors import InterruptedRun
    from topologies.terminal import log

    for note in check_hardware(plan, Found.detect(), nnodes):
        log(f"execute: {note}")
    source = check_data(plan, flags)
    plan_text = plan_path.read_text()
    if clear:
        clear_run_dir(run_dir)
    prepare_out(run_dir, plan_text)
    nproc = plan.cluster.gpus_per_node
    on_cpu = device_type_for(plan) == "cpu"
    worker_args = [str(run_dir / "plan.json"), *flags.to_argv()]
    lay = plan.layout
    log(f"execute: {plan.model.name} on {plan.world_size} {'CPU ranks' if on_cpu else plan.cluster.gpu.name} "
        f"(pp {lay.pp} x dp_replicate {lay.dp_replicate} x dp_shard {lay.dp_shard} x tp {lay.tp}, "
        f"ZeRO-{lay.zero_stage}); data: {source}; run dir: {run_dir}")
    argv = torchrun_argv(nproc, nnodes, node_rank, rdzv_endpoint, max_restarts, run_id(plan_text), worker_args)
    try:
        launch(argv, nproc, on_cpu)
    except (InterruptedRun, KeyboardInterrupt):
        raise InterruptedRun(interrupted_line(run_dir)) from None
    summary = run_dir / "summary.json"
    if summary.exists():
        log(f"execute: done; metrics in {run_dir / 'metrics.jsonl'}, summary in {summary}")


def interrupted_line(run_dir: Path) -> str:
    """'interrupted at step N; last checkpoint step-K; continue with --resume', from what the run left."""
    from executor.components.checkpoint import CHECKPOINTS, latest_step
    from executor.components.measure import read_metrics

    try:
        step = read_metrics(run_dir / "metrics.jsonl")[-1]["step"]
    except UsageError:
        step = 0
    ckpt = latest_step(run_dir / CHECKPOINTS) if (run_dir / CHECKPOINTS).is_dir() else None
    if ckpt is None:
        return (f"interrupted at step {step}; no checkpoint was written (--checkpoint-every K keeps one); "
                f"summary in {run_dir / 'summary.json'}")
    return (f"interrupted at step {step}; last checkpoint step-{ckpt}; continue with --resume "
            f"(--out {run_dir})")

"""`meshplan execute plan.json`: run a plan for real under torchrun (or dry-run / print the launch).

torch is imported only inside the verb, after the flags are checked.
"""

from __future__ import annotations

import contextlib
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
               epilog="\b\nExamples:\n  meshplan execute plan.json --steps 100 --out runs/p --checkpoint-every 20\n  meshplan execute plan.json --init-from ./Qwen3-8B --data chat.jsonl --steps 500 --save-hf-every 250\n  meshplan execute plan.json --data corpus.jsonl --tokenizer ./Qwen2.5-0.5B-Instruct --out runs/cpt\n  meshplan execute plan.json --steps 200 --out runs/p --resume-from step-40\n  meshplan execute plan.json --steps 200 --out runs/p --resume --replan --nproc-per-node 4\n  meshplan execute plan.json --dry-run\n  meshplan execute plan.json --print-launch slurm > job.sbatch\n")
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
@click.option("--max-restarts", type=click.IntRange(min=0), default=DEFAULT_RUN.max_restarts, show_default=True,
              help="Restart the worker group this many times when a worker dies (it resumes from the newest valid "
                   "checkpoint); with --replan and several nodes, also carry on with the nodes left.")
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
@click.option("--init-from", "init_from", default=DEFAULT_RUN.init_from, metavar="DIR|none",
              help="Start from a Hugging Face model directory (config.json + *.safetensors): each rank reads only "
                   "its shards. Default: the directory `plan --model DIR` recorded (plan.json weights_dir); "
                   "`none`: random initialization.")
@click.option("--save-hf-every", type=click.IntRange(min=0), default=DEFAULT_RUN.save_hf_every, show_default=True,
              help="Write a Hugging Face model directory OUT/hf/step-K/ every K steps and at the last step (0: never).")
@click.option("--resume-from", "resume_from", metavar="step-K", default=None,
              help="Continue from checkpoint step-K instead of the newest valid one (implies --resume); `latest` "
                   "then names it.")
@click.option("--allow-plan-change", is_flag=True,
              help="Resume with another sequence length, global batch or --steps than the checkpoint's run (the LR "
                   "schedule is rebuilt for --steps from the step resumed). Another layout needs no flag.")
@click.option("--max-nonfinite-steps", type=click.IntRange(min=1), default=DEFAULT_RUN.max_nonfinite_steps,
              show_default=True, help="Stop (exit 4) after this many steps in a row whose loss or gradient norm is "
              "NaN or infinite; fewer are skipped (no update) and counted.")
@click.option("--preempt-grace-s", type=float, default=DEFAULT_RUN.preempt_grace_s, show_default=True,
              callback=_positive_float, help="On SIGTERM every rank finishes its step, checkpoints and exits (75) "
              "within this many seconds, or is killed.")
@click.option("--async-checkpoint", is_flag=True,
              help="Write checkpoints with DCP's async_save: copied to host memory at the step, written meanwhile.")
@click.option("--replan", is_flag=True,
              help="When the ranks present differ from the plan's (a node lost or back), re-plan for them with the "
                   "plan's pins and resume resharded.")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None,
              help="Ranks per node for --replan: default the GPUs found (the plan's count for CPU ranks).")
def execute(plan_path: str, steps: int, out: str | None, seed: int, data: str | None, tokenizer: str | None,
            lr: float | None, log_every: int, dry_run: bool, nnodes: int | None, node_rank: int,
            rdzv_endpoint: str | None, max_restarts: int, print_launch: str | None, checkpoint_every: int,
            keep_checkpoints: int | None, resume: bool, overwrite: bool, compile_: bool, init_from: str | None,
            save_hf_every: int, resume_from: str | None, allow_plan_change: bool, max_nonfinite_steps: int,
            preempt_grace_s: float, async_checkpoint: bool, replan: bool, nproc_per_node: int | None) -> None:
    """Train with the layout of PLAN.json on this machine's GPUs (or CPU ranks for a cpu-cluster plan).

    One node: runs torchrun itself with one worker per rank. Several nodes:
    run the same command on every node with --nnodes/--node-rank/--rdzv-endpoint
    (see --print-launch). One run per --out at a time (OUT/run.lock).
    """
    from planner.plan import load_plan

    plan = load_plan(plan_path)
    if resume_from is not None:
        from executor.resilience.checkpoints import parse_step

        resume_from = f"step-{parse_step(resume_from)}"
        resume = True
    nnodes = plan.cluster.n_nodes if nnodes is None else nnodes
    if node_rank >= nnodes:
        raise UsageError(f"--node-rank {node_rank} must be below --nnodes {nnodes}")
    if nproc_per_node is not None and not replan and nproc_per_node != plan.cluster.gpus_per_node:
        raise UsageError(f"--nproc-per-node {nproc_per_node}: the plan runs {plan.cluster.gpus_per_node} ranks per "
                         "node; add --replan to re-plan for the ranks present")
    if replan and not (print_launch or dry_run):
        plan = _replanned(plan, nnodes, nproc_per_node)
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
                     compile=compile_, init_from=init_from, save_hf_every=save_hf_every,
                     max_restarts=max_restarts, resume_from=resume_from, allow_plan_change=allow_plan_change,
                     max_nonfinite_steps=max_nonfinite_steps, preempt_grace_s=preempt_grace_s,
                     async_checkpoint=async_checkpoint, replan=replan).with_plan_defaults(plan)
    if print_launch:  # every node repeats the run flags (--out only when given)
        click.echo(_launch_text(plan, plan_path, print_launch, nnodes, rdzv_endpoint, flags))
        return
    from executor.parallel.parallelize import check_compile, check_supported

    check_supported(plan)
    if compile_:
        check_compile(plan)
    if flags.weights_source:  # before any rank starts: the directory holds the plan's model
        from executor.hf.config import check_config
        from executor.hf.load import check_weights

        check_config(plan.model, flags.weights_source)
        check_weights(plan.model, flags.weights_source)
    if flags.save_hf_every:
        from executor.hf.config import config_json

        if not flags.weights_source:  # a config.json to export with must exist for this model
            config_json(plan.model, "fp32")
    if dry_run:
        from topologies.terminal import Progress

        with Progress("dry run: importing torch"):
            from executor.dryrun import dry_run as run_dry
        run_dry(plan, plan_path=Path(plan_path), flags=flags.replace(out=str(run_dir)), nnodes=nnodes,
                node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, max_restarts=flags.max_restarts)
        return
    from executor.resilience import lock

    # Node 0 holds the run directory's lock until the run ends; other nodes may share its directory, and
    # node 0 alone decides what it holds.
    held = lock.acquire(run_dir, log=_log) if node_rank == 0 else contextlib.nullcontext()
    with held:
        if node_rank == 0:
            from executor.preflight import check_run_dir

            check_run_dir(run_dir, resume, overwrite)
            if resume:
                _check_resume(plan, run_dir, flags)
        _run(plan, run_dir, nnodes, node_rank, rdzv_endpoint, flags.replace(out=str(run_dir)),
             clear=overwrite and node_rank == 0)


def _log(line: str) -> None:
    from topologies.terminal import log

    log(line)


def _replanned(plan, nnodes: int, nproc_per_node: int | None):
    """--replan: the plan for nnodes x (--nproc-per-node, the GPUs found, or the plan's CPU ranks), said aloud."""
    from executor.parallel.mesh import device_type_for

    if nproc_per_node is None and device_type_for(plan) == "cuda":
        from executor.preflight import Found

        nproc_per_node = Found.detect().n_devices or plan.cluster.gpus_per_node
    per_node = nproc_per_node or plan.cluster.gpus_per_node
    if (nnodes, per_node) == (plan.cluster.n_nodes, plan.cluster.gpus_per_node):
        _log(f"replan: {plan.world_size} ranks present, as planned: no re-plan")
        return plan
    from planner.search.replan import replan

    result = replan(plan, nnodes, per_node)
    for line in result.lines():
        _log(line)
    return result.new


def _check_resume(plan, run_dir: Path, flags: RunFlags) -> None:
    """Refuse, before any rank starts, a resume that changes what is trained (executor.resilience.contract)."""
    from executor.resilience.checkpoints import CHECKPOINTS, complete_steps, latest_step, parse_step
    from executor.resilience.contract import check_resume, run_info

    root = run_dir / CHECKPOINTS
    step = parse_step(flags.resume_from) if flags.resume_from else latest_step(root)
    if flags.resume_from and step not in complete_steps(root):
        have = ", ".join(f"step-{s}" for s in complete_steps(root)) or "none"
        raise UsageError(f"--resume-from {flags.resume_from}: {root} holds no such complete checkpoint (complete: "
                         f"{have}); `meshplan checkpoint verify {run_dir}` checks them")
    if step is None:
        return  # nothing to resume: the run starts at step 0
    line = check_resume(root / f"step-{step}", run_info(plan, flags.steps), flags.allow_plan_change)
    if line:
        _log(line)


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


def _run(plan, run_dir: Path, nnodes: int, node_rank: int, rdzv_endpoint: str | None, flags: RunFlags,
         clear: bool = False) -> None:
    from executor.launch import launch, run_id, torchrun_argv
    from executor.parallel.mesh import device_type_for
    from executor.preflight import Found, check_data, check_hardware, clear_run_dir, prepare_out
    from topologies.errors import InterruptedRun, PreemptedRun
    from topologies.terminal import dumps_json, log

    for note in check_hardware(plan, Found.detect(), nnodes):
        log(f"execute: {note}")
    source = check_data(plan, flags)
    plan_text = dumps_json(plan.to_json()) + "\n"
    if clear:
        clear_run_dir(run_dir)
    prepare_out(run_dir, plan_text)
    if flags.weights_source:  # config.json, tokenizer files and dtype for the run's Hugging Face exports
        from executor.hf.export import record_source

        record_source(Path(flags.weights_source), run_dir)
    nproc = plan.cluster.gpus_per_node
    on_cpu = device_type_for(plan) == "cpu"
    worker_args = [str(run_dir / "plan.json"), *flags.to_argv()]
    lay = plan.layout
    log(f"execute: {plan.model.name} on {plan.world_size} {'CPU ranks' if on_cpu else plan.cluster.gpu.name} "
        f"(pp {lay.pp} x dp_replicate {lay.dp_replicate} x dp_shard {lay.dp_shard} x tp {lay.tp}, "
        f"ZeRO-{lay.zero_stage}); data: {source}; weights: {flags.weights_source or 'random initialization'}; "
        f"run dir: {run_dir}")
    argv = torchrun_argv(nproc, nnodes, rdzv_endpoint, flags.max_restarts, run_id(plan_text),
                         worker_args, grace_s=flags.preempt_grace_s, elastic=flags.replan and flags.max_restarts > 0)
    try:
        launch(argv, nproc, on_cpu, run_dir)
    except (InterruptedRun, KeyboardInterrupt):
        raise InterruptedRun(interrupted_line(run_dir)) from None
    except PreemptedRun:
        raise PreemptedRun(interrupted_line(run_dir, preempted=True)) from None
    summary = run_dir / "summary.json"
    if summary.exists():
        log(f"execute: done; metrics in {run_dir / 'metrics.jsonl'}, summary in {summary}")


def interrupted_line(run_dir: Path, preempted: bool = False) -> str:
    """'interrupted at step N; last checkpoint step-K; continue with --resume', from what the run left
    ('preempted (SIGTERM) at step N; ...' after a SIGTERM)."""
    from executor.components.measure import read_metrics
    from executor.resilience.checkpoints import CHECKPOINTS, latest_step

    try:
        step = read_metrics(run_dir / "metrics.jsonl")[-1]["step"]
    except UsageError:
        step = 0
    ckpt = latest_step(run_dir / CHECKPOINTS) if (run_dir / CHECKPOINTS).is_dir() else None
    what = "preempted (SIGTERM)" if preempted else "interrupted"
    if ckpt is None:
        return (f"{what} at step {step}; no checkpoint was written (--checkpoint-every K keeps one); "
                f"summary in {run_dir / 'summary.json'}")
    return f"{what} at step {step}; last checkpoint step-{ckpt}; continue with --resume (--out {run_dir})"

"""Launch commands that run `meshplan execute` on every node: the single implementation.

`meshplan export --to torchrun|slurm` and `meshplan execute --print-launch
torchrun|slurm` both print what this module writes; nothing else builds
launch lines. Each node runs one `meshplan execute`, which starts one
torchrun agent there (gpus_per_node workers); the agents meet at a c10d
rendezvous hosted on node 0, so `--node-rank` is informative and the
endpoint is the only address a node needs.

API (signatures others call):

  torchrun_commands(plan, plan_path, nnodes=None, rdzv_endpoint=f"$HEAD_NODE:{RDZV_PORT}",
                    run=None) -> list[list[str]]
      One argv per node, node 0 first:
        meshplan execute PLAN [run flags] --nnodes N --node-rank R --rdzv-endpoint HOST:PORT
      A single-node plan gives one argv without the rendezvous flags.
      nnodes defaults to the plan's node count; any other count is refused.
  torchrun_script(plan, plan_path, hosts=(), port=RDZV_PORT, run=None) -> str
      A bash script to run on every node as `bash SCRIPT NODE_RANK`; node 0
      is hosts[0], or $HEAD_NODE when no hosts are given.
  slurm_script(plan, plan_path, hosts=(), port=RDZV_PORT, run=None, job_name=None) -> str
      An sbatch script: one task per node (srun), each running meshplan
      execute with --node-rank $SLURM_NODEID; the rendezvous host is the
      first node of the allocation (scontrol show hostnames). Preemption:
      SLURM sends SIGTERM to the tasks --preempt-grace-s + 30 s before the
      time limit (--signal=TERM@S); `meshplan execute` then checkpoints and
      exits 75, and the script requeues the job (--requeue, output appended),
      whose next start adds --resume (SLURM_RESTART_COUNT > 0). A preemption
      by SLURM itself sends the same SIGTERM and requeues on its own.

run is the run's flags (planner.run_flags.RunFlags: steps, out, seed, ...),
written with `RunFlags.to_argv` on every node, with the plan's defaults
filled in (`RunFlags.with_plan_defaults`: the weights directory plan.json
records as `--init-from`); None adds only `--init-from` when the plan names
weights.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence

from planner.export import ExportResult, check_hosts
from planner.export.common import comment_block, notes_lines, summary_lines
from planner.plan import Plan
from planner.run_flags import RunFlags
from topologies.errors import PreemptedRun, UsageError

RDZV_PORT = 29500
SIGNAL_MARGIN_S = 30  # SLURM's SIGTERM comes this long before the grace period must end: step time, exit
PREEMPTED_EXIT_CODE = PreemptedRun.exit_code  # `meshplan execute` after SIGTERM and its checkpoint (75)


def _check_nnodes(plan: Plan, nnodes: int | None) -> int:
    n = plan.cluster.n_nodes if nnodes is None else nnodes
    if n != plan.cluster.n_nodes:
        raise UsageError(
            f"--nnodes {n} does not match the plan: it runs {plan.world_size} ranks as {plan.cluster.n_nodes} "
            f"nodes x {plan.cluster.gpus_per_node} GPUs; re-plan for {n} nodes instead"
        )
    return n


def _base(plan: Plan, plan_path: str, run: RunFlags | None) -> list[str]:
    """`meshplan execute PLAN` and the run flags; the plan's weights (`--init-from`) even without run flags."""
    if run is not None:
        flags = run.with_plan_defaults(plan).to_argv()
    else:
        flags = ["--init-from", plan.weights_dir] if plan.weights_dir else []
    return ["meshplan", "execute", str(plan_path), *flags]


def torchrun_commands(plan: Plan, plan_path: str, nnodes: int | None = None,
                      rdzv_endpoint: str = f"$HEAD_NODE:{RDZV_PORT}",
                      run: RunFlags | None = None) -> list[list[str]]:
    """One `meshplan execute` argv per node (see the module docstring)."""
    n = _check_nnodes(plan, nnodes)
    if n == 1:
        return [_base(plan, plan_path, run)]
    return [_base(plan, plan_path, run) + ["--nnodes", str(n), "--node-rank", str(rank),
                                              "--rdzv-endpoint", rdzv_endpoint] for rank in range(n)]


def _node_line(plan: Plan, plan_path: str, run: RunFlags | None, rank_var: str, port: int) -> str:
    """The per-node command with shell variables for node rank and head node, quoted for bash."""
    line = shlex.join(_base(plan, plan_path, run))
    if plan.cluster.n_nodes > 1:
        line += (f' --nnodes {plan.cluster.n_nodes} --node-rank "${rank_var}"'
                 f' --rdzv-endpoint "$HEAD_NODE:{port}"')
    return line


def torchrun_script(plan: Plan, plan_path: str, hosts: Sequence[str] = (), port: int = RDZV_PORT,
                    run: RunFlags | None = None) -> str:
    """Bash script for every node: `bash SCRIPT NODE_RANK` (see the module docstring)."""
    hosts = check_hosts(plan, hosts)
    n, per_node = plan.cluster.n_nodes, plan.cluster.gpus_per_node
    header = [f"launch: {n} node(s), one `meshplan execute` (one torchrun agent, {per_node} workers) per node"]
    if n > 1:
        header.append(f"c10d rendezvous on node 0 at port {port}; run on node i: bash THIS_SCRIPT i")
        header += [f"node {i}: {host}" for i, host in enumerate(hosts)]
    out = "#!/usr/bin/env bash\n" + comment_block(header + summary_lines(plan) + notes_lines(()))
    out += "set -euo pipefail\n"
    if n == 1:
        return out + "exec " + _node_line(plan, plan_path, run, "node_rank", port) + "\n"
    if hosts:
        out += f"HEAD_NODE={shlex.quote(hosts[0])}\n"
    else:
        out += 'HEAD_NODE="${HEAD_NODE:?export HEAD_NODE=<address of node 0>}"\n'
    out += f'node_rank="${{1:?usage: bash $0 NODE_RANK (0..{n - 1})}}"\n'
    out += (f'if ! [[ "$node_rank" =~ ^[0-9]+$ ]] || (( node_rank >= {n} )); then\n'
            f'  echo "node rank must be 0..{n - 1}, got $node_rank" >&2; exit 2\nfi\n')
    return out + "exec " + _node_line(plan, plan_path, run, "node_rank", port) + "\n"


def slurm_script(plan: Plan, plan_path: str, hosts: Sequence[str] = (), port: int = RDZV_PORT,
                 run: RunFlags | None = None, job_name: str | None = None) -> str:
    """sbatch script: one srun task per node running `meshplan execute` (see the module docstring)."""
    hosts = check_hosts(plan, hosts)
    n, cl = plan.cluster.n_nodes, plan.cluster
    name = job_name or f"meshplan-{plan.model.name}"
    grace_s = math.ceil((run or RunFlags()).preempt_grace_s)
    sbatch = [f"--job-name={name}", f"--nodes={n}", "--ntasks-per-node=1", "--exclusive", "--output=%x-%j.out",
              f"--signal=TERM@{grace_s + SIGNAL_MARGIN_S}", "--requeue", "--open-mode=append"]
    if cl.gpu.kind == "gpu":
        sbatch.insert(3, f"--gpus-per-node={cl.gpus_per_node}")
    if hosts:
        sbatch.append(f"--nodelist={','.join(hosts)}")
    out = "#!/bin/bash\n" + "".join(f"#SBATCH {shlex.quote(opt)}\n" for opt in sbatch)
    header = [f"one task per node runs `meshplan execute` (one torchrun agent, {cl.gpus_per_node} workers)"]
    if n > 1:
        header.append(f"c10d rendezvous on the allocation's first node, port {port}")
    out += comment_block(header + summary_lines(plan) + notes_lines(()))
    out += "set -euo pipefail\n"
    # Read the whole host list, no `| head`: under pipefail a closed pipe (SIGPIPE) would end the job.
    out += 'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")\nHEAD_NODE=${NODES[0]}\nexport HEAD_NODE\n'
    cmd = "exec " + _node_line(plan, plan_path, run, "SLURM_NODEID", port)
    if not (run and run.resume):  # a requeued job continues its run
        cmd += " $RESUME"
        out += 'RESUME=""\nif (( ${SLURM_RESTART_COUNT:-0} > 0 )); then RESUME=--resume; fi\nexport RESUME\n'
    out += f"cmd={shlex.quote(cmd)}\n"
    out += f'rc=0\nsrun --nodes={n} --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "$cmd" || rc=$?\n'
    out += (f"# {PREEMPTED_EXIT_CODE}: preempted after writing its checkpoint; requeue, and the next start resumes\n"
            f'if (( rc == {PREEMPTED_EXIT_CODE} )); then scontrol requeue "$SLURM_JOB_ID" || true; fi\n')
    return out + 'exit "$rc"\n'


def execute_refusal(plan: Plan) -> str | None:
    """Why `meshplan execute` would refuse this plan, naming the engine whose launcher to use; None if it runs.

    The scripts only wrap `meshplan execute`, so a plan its executor refuses
    (planner.engines.executor_refusal) must say so instead of promising a run.
    """
    from planner.engines import engine_name, get_engine

    on_gpu = plan.cluster.gpu.kind == "gpu"
    reason = get_engine("meshplan").refusal(plan.model, plan.layout, plan.training.dtype, on_gpu)
    if reason is None:
        return None
    other = engine_name(plan.engine) if engine_name(plan.engine) != "meshplan" else "megatron"
    return (f"`meshplan execute` refuses this plan ({reason}); launch it with {other}'s own launcher instead: "
            f"`meshplan export --to {other}`")


def export_torchrun(plan: Plan, plan_path: str, hosts: tuple[str, ...] = ()) -> ExportResult:
    return _with_refusal(ExportResult("torchrun", torchrun_script(plan, plan_path, hosts), "launch_torchrun.sh"), plan)


def export_slurm(plan: Plan, plan_path: str, hosts: tuple[str, ...] = ()) -> ExportResult:
    return _with_refusal(ExportResult("slurm", slurm_script(plan, plan_path, hosts), "launch.sbatch"), plan)


def _with_refusal(result: ExportResult, plan: Plan) -> ExportResult:
    """The script with the executor's refusal in its notes and in place of its 'could not express: nothing'."""
    reason = execute_refusal(plan)
    if reason is None:
        return result
    nothing = comment_block(notes_lines(()))
    text = result.text.replace(nothing, comment_block(notes_lines([reason])), 1)
    return ExportResult(result.target, text, result.filename, (reason,), result.extra_files)

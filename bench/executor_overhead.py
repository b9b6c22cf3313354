"""`meshplan execute` against a minimal hand-written loop of the same model, layout and data, side by side.

    .venv/bin/python bench/executor_overhead.py                       # every layout, 3 rounds (~10 min)
    .venv/bin/python bench/executor_overhead.py --layouts fsdp,ddp --rounds 2 --steps 10

The model is bench/data/llama_small_cpu.json (hidden 384, 4 layers, 6 heads,
2 KV heads, FFN 1024, vocab 8192), seq 256, global batch 8, micro-batch 2,
no recomputation, on CPU ranks (gloo, OMP_NUM_THREADS = cores / ranks for
both), in these layouts (`meshplan plan` pinned to each):

  ddp      dp 2, ZeRO-0                   DDP, no_sync on all but the last micro-batch
  fsdp     dp 2, ZeRO-3                   fully_shard: embedding, each block, norm + output, root
  tp2      tp 2, no sequence parallel     DTensor TP: q/k/v, w1, w3 by columns, wo, w2 by rows,
                                          vocabulary-parallel embedding and output, loss_parallel
  tp2_dp2  tp 2 x dp 2, ZeRO-3 (4 ranks)  the same TP, then fully_shard over the dp mesh
  pp2      pp 2, 1F1B                     PipelineStage per half + Schedule1F1B

The minimal loop (`--worker`, run under torchrun) shares with the executor
the model (executor.model: build, init_weights from the seed), the data (the
executor's synthetic token source, every step's batch built before the loop
starts, as a loader off the critical path would) and the hyper-parameters
(AdamW, the LR schedule, clipping to 1.0, the loss scaled by dp / counted
targets); the parallelism is written here with torch's own calls, and the
step is the plain sequence: forward/backward per micro-batch, clip (a
foreach norm per mesh, torch.nn.utils.get_total_norm and
clip_grads_with_norm_, as torchtitan clips), AdamW, LR step, and the global
mean loss read once (one all-reduce and
`.item()`, the least a loop logging every step does). Same model, same data,
same updates: the bench checks that both report the same losses.

Clocks: the executor's own `step_time_s` (metrics.jsonl: from the step's
start, data included, to its loss and peak-memory reduction); the minimal
loop's from the step's start to its loss read. The stop check and metrics
line between the executor's steps fall outside its clock.

Interleaving: each round runs every layout once through each, the order of
the pair alternating between rounds; the first WARMUP_STEPS steps of every
run are dropped, the others pooled per layout and variant, and the ratio is
the median executor step over the median minimal step. The load average is
printed: on a shared host every figure moves with it, and separate launches
see different shares of the cores (wall-time ratios of one layout spread by
+-20% at load averages of 6-13 on 2 cores). So each round also runs an A/B
in one launch: the executor's own Trainer (executor.train, its `step()`:
what `step_time_s` clocks) and the minimal loop built side by side in the
same ranks, taking turns step by step, every step timed in process CPU
seconds, which waiting for a core does not inflate, and in wall seconds:
the `A/B CPU` and `A/B wall` columns, median executor step over median
minimal step (--no-ab skips them). The last
line lists each layout's `meshplan execute` ratio, e.g. `ratios: ddp 1.02x,
fsdp 1.03x`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = ROOT / "bench/data/llama_small_cpu.json"
TRAINING = ["--seq-len", "256", "--global-batch", "8", "--micro-batch", "2", "--recompute", "none"]
LAYOUTS: dict[str, tuple[int, list[str]]] = {  # name -> (ranks, pinned `meshplan plan` flags)
    "ddp": (2, ["--dp", "2", "--zero", "0"]),
    "fsdp": (2, ["--dp", "2", "--zero", "3"]),
    "tp2": (2, ["--tp", "2", "--no-sequence-parallel"]),
    "tp2_dp2": (4, ["--tp", "2", "--dp", "2", "--zero", "3", "--no-sequence-parallel"]),
    "pp2": (2, ["--pp", "2", "--pp-schedule", "1f1b"]),
}
WARMUP_STEPS = 2
LOSS_RTOL = 1e-3


# ---- the driver ----------------------------------------------------------------------------


def _env(ranks: int) -> dict:
    threads = str(max(1, (os.cpu_count() or 1) // ranks))
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": threads}


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or "").strip().splitlines()[-8:])
        raise SystemExit(f"{what} failed ({proc.returncode}):\n{tail}")


def make_plan(work: Path, name: str) -> Path:
    ranks, pinned = LAYOUTS[name]
    path = work / f"{name}.plan.json"
    proc = subprocess.run([sys.executable, str(ROOT / "cli.py"), "plan", "--model", str(MODEL), "--cluster", "cpu",
                           "--gpus", str(ranks), *TRAINING, *pinned, "-o", str(path)],
                          capture_output=True, text=True, env=_env(ranks))
    _check(proc, f"meshplan plan ({name})")
    return path


def run_executor(plan: Path, ranks: int, steps: int, out: Path) -> tuple[list[float], list[float]]:
    """(step times, losses) of one `meshplan execute` run."""
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([sys.executable, str(ROOT / "cli.py"), "execute", str(plan), "--steps", str(steps),
                           "--out", str(out), "--log-every", str(steps)], capture_output=True, text=True,
                          env=_env(ranks))
    _check(proc, f"meshplan execute {plan.name}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step_time_s"] for r in rows], [r["loss"] for r in rows]


def run_minimal(plan: Path, ranks: int, steps: int, out: Path, ab: bool = False) -> dict:
    """One run of the minimal loop under torchrun (with the executor's Trainer beside it when `ab`)."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={ranks}", str(Path(__file__).resolve()), "--worker", str(plan),
                           "--steps", str(steps), "--out", str(out), *(["--ab"] if ab else [])],
                          capture_output=True, text=True, env=_env(ranks))
    _check(proc, f"minimal loop {plan.name}")
    return json.loads(out.read_text())


def load_average() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def compare(layouts: list[str], rounds: int, steps: int, work: Path, ab: bool = True) -> dict:
    """Plan every layout, then run the rounds; returns every step time, loss and ratio."""
    plans = {name: make_plan(work, name) for name in layouts}
    rows = {name: {"executor": [], "minimal": [], "round_ratios": [], "loss_rel_diff": 0.0,
                   **{f"ab_{v}_{t}": [] for v in ("executor", "minimal") for t in ("cpu", "wall")}} for name in layouts}
    print(f"load average before: {load_average()}", flush=True)
    for r in range(rounds):
        for name in layouts:
            ranks = LAYOUTS[name][0]
            order = ("executor", "minimal") if r % 2 == 0 else ("minimal", "executor")
            got = {}
            for variant in order:
                if variant == "executor":
                    got[variant] = run_executor(plans[name], ranks, steps, work / f"{name}.executor.{r}")
                else:
                    doc = run_minimal(plans[name], ranks, steps, work / f"{name}.minimal.{r}.json")
                    got[variant] = doc["step_time_s"], doc["loss"]
            row = rows[name]
            if ab:
                doc = run_minimal(plans[name], ranks, steps, work / f"{name}.ab.{r}.json", ab=True)
                for variant, side in (("executor", doc["executor"]), ("minimal", doc)):
                    row[f"ab_{variant}_cpu"].extend(side["cpu_s"][WARMUP_STEPS:])
                    row[f"ab_{variant}_wall"].extend(side["step_time_s"][WARMUP_STEPS:])
                row["loss_rel_diff"] = max(row["loss_rel_diff"], *(
                    abs(a - b) / abs(b) for a, b in zip(doc["executor"]["loss"], doc["loss"], strict=True)))
            for variant, (times, _) in got.items():
                row[variant].extend(times[WARMUP_STEPS:])
            ratio = statistics.median(got["executor"][0][WARMUP_STEPS:]) / \
                statistics.median(got["minimal"][0][WARMUP_STEPS:])
            row["round_ratios"].append(ratio)
            row.setdefault("losses", []).append({v: got[v][1] for v in got})
            diffs = [abs(a - b) / abs(b) for a, b in zip(got["executor"][1], got["minimal"][1], strict=True)]
            row["loss_rel_diff"] = max(row["loss_rel_diff"], max(diffs))
            print(f"round {r + 1} {name:8s} executor {statistics.median(got['executor'][0][WARMUP_STEPS:]):.3f} s, "
                  f"minimal {statistics.median(got['minimal'][0][WARMUP_STEPS:]):.3f} s, ratio {ratio:.3f} "
                  f"(load {load_average()})", flush=True)
    for row in rows.values():
        row["executor_s"] = statistics.median(row["executor"])
        row["minimal_s"] = statistics.median(row["minimal"])
        row["ratio"] = row["executor_s"] / row["minimal_s"]
        if row["ab_minimal_cpu"]:
            for t in ("cpu", "wall"):
                row[f"ab_{t}_ratio"] = statistics.median(row[f"ab_executor_{t}"]) / \
                    statistics.median(row[f"ab_minimal_{t}"])
    return {"rows": rows, "rounds": rounds, "steps": steps, "load_average_after": load_average(),
            "cpu_count": os.cpu_count()}


def report(result: dict) -> str:
    lines = [f"{'layout':8s} {'ranks':>5s} {'meshplan s':>11s} {'minimal s':>10s} {'ratio':>7s}  {'per round':18s} "
             f"{'A/B wall':>8s} {'A/B CPU':>8s}  losses (max rel diff)"]
    for name, row in result["rows"].items():
        rounds = " ".join(f"{x:.2f}" for x in row["round_ratios"])
        same = "same" if row["loss_rel_diff"] <= LOSS_RTOL else "DIFFER"
        ab = " ".join(f"{row[k]:7.2f}x" if k in row else f"{'-':>8s}" for k in ("ab_wall_ratio", "ab_cpu_ratio"))
        lines.append(f"{name:8s} {LAYOUTS[name][0]:5d} {row['executor_s']:11.3f} {row['minimal_s']:10.3f} "
                     f"{row['ratio']:6.2f}x  {rounds:18s} {ab}  {same} ({row['loss_rel_diff']:.1e})")
    lines.append(f"load average after: {result['load_average_after']} ({result['cpu_count']} cores; medians of "
                 f"{result['rounds']} round(s) x {result['steps'] - WARMUP_STEPS} counted steps)")
    lines.append("ratios: " + ", ".join(f"{name} {row['ratio']:.2f}x" for name, row in result["rows"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help=f"steps per run (the first {WARMUP_STEPS} are dropped)")
    p.add_argument("--json", default=None, help="write every step time, loss and ratio here")
    p.add_argument("--no-ab", action="store_true", help="skip the in-process A/B runs (CPU time per step)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ab", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return minimal_loop(Path(a.worker), a.steps, Path(a.out), ab=a.ab)
    layouts = [x for x in a.layouts.split(",") if x]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown or a.steps <= WARMUP_STEPS or a.rounds < 1:
        p.error(f"layouts from {', '.join(LAYOUTS)} (got {unknown}); --steps > {WARMUP_STEPS}; --rounds >= 1")
    with tempfile.TemporaryDirectory(prefix="executor-overhead-") as tmp:
        result = compare(layouts, a.rounds, a.steps, Path(tmp), ab=not a.no_ab)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    print(report(result))


# ---- the minimal loop (one torchrun worker) -------------------------------------------------


def minimal_loop(plan_path: Path, steps: int, out: Path, ab: bool = False) -> None:
    """Train `steps` steps of the plan with torch's own calls; rank 0 writes step times and losses to `out`.

    ab: the executor's own Trainer is built beside the minimal loop in the same ranks, and the two take
    turns, one step each (who goes first alternating), each step timed in wall and process CPU seconds.
    """
    import torch
    import torch.distributed as dist

    from planner.plan import load_plan

    dist.init_process_group("gloo")
    plan = load_plan(plan_path)
    torch.manual_seed(0)
    minimal = minimal_step(plan, steps)
    runners = {"minimal": minimal}
    if ab:
        from executor.parallel.mesh import build_mesh
        from executor.train import Trainer
        from planner.run_flags import RunFlags

        trainer = Trainer(plan, RunFlags(steps=steps, out=str(out.parent)), build_mesh(plan, "cpu"),
                          torch.device("cpu"))
        runners["executor"] = lambda: float(trainer.step()["loss"])  # read back, as the minimal loop does
    got = {name: {"step_time_s": [], "cpu_s": [], "loss": []} for name in runners}
    for k in range(steps):
        for name in (list(runners) if k % 2 == 0 else list(runners)[::-1]):
            dist.barrier()  # every rank starts the step together: a late peer is not this variant's time
            wall, cpu = time.perf_counter(), time.process_time()
            loss = runners[name]()
            got[name]["cpu_s"].append(time.process_time() - cpu)
            got[name]["step_time_s"].append(time.perf_counter() - wall)
            got[name]["loss"].append(loss)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({**got["minimal"], "model": plan.model.name,
                                   **({"executor": got["executor"]} if ab else {})}))
    dist.destroy_process_group()


def minimal_step(plan, steps: int):
    """A function running the next step of the minimal loop (data prebuilt) and returning its global mean loss."""
    import torch.distributed as dist

    lay = plan.layout
    model, mesh = build_minimal(plan)
    batches, weight = prebuilt_batches(plan, mesh, steps)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = optimizer_for(params, plan, steps)
    step_fn = pipeline_step(model, plan, mesh, weight) if lay.pp > 1 else accumulation_step(model, plan, mesh, weight)
    world = dist.get_world_size()
    position = iter(batches)

    def step() -> float:
        inputs, targets = next(position)
        local_loss = step_fn(inputs, targets)
        clip(params, mesh)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        total = local_loss.detach().double() / (world // lay.pp)
        dist.all_reduce(total)
        return total.item()

    return step


def build_minimal(plan):
    """The plan's layout by hand: mesh, pipeline split, TP plan, FSDP/DDP; weights from the executor's init."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from executor.model import build_model, init_weights

    lay, spec = plan.layout, plan.model
    dims = {"pp": lay.pp, "dp": lay.dp, "tp": lay.tp}
    names = tuple(k for k, v in dims.items() if v > 1) or ("dp",)
    mesh = init_device_mesh("cpu", tuple(dims[n] for n in names), mesh_dim_names=names)
    model = build_model(spec)
    if lay.pp > 1:
        model = keep_stage(model, plan, mesh["pp"].get_local_rank())
    if lay.tp > 1:
        tensor_parallel(model, mesh["tp"])
    if lay.dp > 1 and lay.zero_stage >= 2:
        fsdp(model, mesh["dp"], lay.zero_stage == 3)
    init_weights(model, spec, 0, torch.device("cpu"))
    if lay.dp > 1 and lay.zero_stage == 0:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, process_group=mesh["dp"].get_group())
    return model, mesh


def fsdp(model, dp_mesh, reshard: bool) -> None:
    """torchtitan's FSDP2 units: the embedding, each block, final norm + output, then the root. The last
    block and the head are not resharded after forward: their backward comes first."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.tok_embeddings, mesh=dp_mesh, reshard_after_forward=reshard)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard and i < len(blocks) - 1)
    fully_shard([model.norm, model.output], mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)


def keep_stage(model, plan, stage: int):
    """Stage `stage` of a two-or-more stage split at the plan's layers_per_stage: other blocks deleted."""
    counts = plan.layout.layers_per_stage
    first = sum(counts[:stage])
    keep = {str(i) for i in range(first, first + counts[stage])}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage > 0:
        model.tok_embeddings = None
    if stage < len(counts) - 1:
        model.norm = model.output = None
    return model


def tensor_parallel(model, tp_mesh) -> None:
    """Megatron's split as torch's styles: columns for q/k/v/w1/w3, rows for wo/w2, vocabulary for both ends."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    ends = {}
    if model.tok_embeddings is not None:
        ends["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if model.output is not None:
        ends["output"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, ends)
    block_plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                  "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                  "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                  "feed_forward.w2": RowwiseParallel()}
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)


def prebuilt_batches(plan, mesh, steps: int):
    """Every step's local (inputs, targets) from the executor's data source, made before the loop; D / N."""
    from executor.components.data import counted_targets, local_batch, open_source

    lay, training = plan.layout, plan.training
    source = open_source(None, plan.model.vocab, training.seq_len, 0)
    dp_rank = mesh["dp"].get_local_rank() if "dp" in mesh.mesh_dim_names else 0
    batch = training.global_batch_size
    import torch

    batches = [local_batch(source, k * batch, batch, lay.dp, dp_rank, torch.device("cpu")) for k in range(steps)]
    return batches, lay.dp / counted_targets(source, 0, batch)


def optimizer_for(params, plan, steps: int):
    import torch

    from executor.components.optim import BETAS, EPS, WEIGHT_DECAY, WarmupCosine, default_lr

    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=default_lr(plan.model.hidden), betas=BETAS, eps=EPS, foreach=True)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine.for_run(steps))


def _loss_sum(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def accumulation_step(model, plan, mesh, weight: float):
    """Forward/backward of every micro-batch; DDP syncs on the last, FSDP reduce-scatters each."""
    import torch
    from torch.distributed.tensor import DTensor

    lay = plan.layout
    tp = lay.tp > 1

    def step(inputs, targets):
        total = torch.zeros(())
        for i, (x, y) in enumerate(zip(inputs.chunk(lay.grad_accum_steps), targets.chunk(lay.grad_accum_steps),
                                       strict=True)):
            last = i == lay.grad_accum_steps - 1
            sync = model.no_sync() if hasattr(model, "no_sync") and not last else contextlib.nullcontext()
            with sync, _loss_parallel(tp):
                loss = _loss_sum(model(x), y) * weight
                loss.backward()
            value = loss.detach()
            total += value.full_tensor() if isinstance(value, DTensor) else value
        return total

    return step


def _loss_parallel(on: bool):
    if not on:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def pipeline_step(model, plan, mesh, weight: float):
    """torch's PipelineStage and Schedule1F1B over the pp group; the loss lives on the last stage."""
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    lay = plan.layout
    rank = mesh["pp"].get_local_rank()
    stage = PipelineStage(model, rank, lay.pp, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=lay.grad_accum_steps,
                            loss_fn=lambda out, y: _loss_sum(out, y) * weight, scale_grads=False)

    def step(inputs, targets):
        if rank == 0:
            schedule.step(inputs)
            return torch.zeros(())
        losses: list = []
        schedule.step(target=targets, losses=losses, return_outputs=False)
        return torch.stack([v.detach() for v in losses]).sum()

    return step


def clip(params, mesh) -> None:
    """Global L2 norm to 1.0 as torchtitan clips: a foreach norm per mesh (plain tensors apart), one
    full_tensor each, summed over pipeline stages, then a foreach scale per mesh."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    groups: dict = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for group in groups.values():
        norm = get_total_norm([p.grad for p in group], foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    squared = torch.stack(norms).square().sum()
    if "pp" in mesh.mesh_dim_names:
        dist.all_reduce(squared, group=mesh["pp"].get_group())
    total = squared.sqrt()
    with implicit_replication():  # the plain total scales DTensor gradients
        for group in groups.values():
            clip_grads_with_norm_(group, 1.0, total, foreach=True)


if __name__ == "__main__":
    main()

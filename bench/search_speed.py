"""Speed of the layout search. Prints figures for the README; nothing here is asserted in tests.

    python bench/search_speed.py            # every measurement
    python bench/search_speed.py --quick    # skip the 1T / 16,384-GPU searches

Every measurement runs in a fresh process pinned to one CPU core, because a
user's first search starts cold: no rank groups, compiled pipeline orders or
collective prices cached yet.

1. The full search for gpt-1t (Megatron-LM's 1T configuration) on 16,384
   H100 (2,048 DGX nodes): the first search of the process (cold) and a
   second one (warm), each split into time inside `simulate_step` and the
   search's own work (enumeration, bounds, memory). Two engines: megatron
   searches the whole space (every schedule, CP, ZeRO-1 with TP/PP); meshplan
   only what its executor runs (planner.engines: gpt-1t ties its
   embeddings, so pp is 1), a much smaller space.
   The same for Kimi-K2, the 1T mixture of experts (384 experts), where the
   search also chooses ep and etp (megatron only: meshplan's executor runs
   no MoE).
2. `meshplan plan --model gpt-1t --gpus 16384 --engine megatron` and
   `meshplan plan --model 13B --gpus 16`, from process start to output, as a
   user runs them (best and median of a few runs), and the import check:
   torch must never be imported on the planning path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # numpy must not spread over cores either
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PLAN = [sys.executable, str(REPO / "cli.py"), "plan"]
PLAN_13B = [*PLAN, "--model", "13B", "--gpus", "16"]
PLAN_1T = [*PLAN, "--model", "gpt-1t", "--gpus", "16384", "--engine", "megatron"]


def _one_core() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def search_1t(engine: str, name: str = "gpt-1t") -> None:
    """Two searches in this (fresh) process: the first is the cold one a user waits for."""
    from planner.model.load import load_model
    from planner.search.search import search
    from topologies.cluster_load import load_cluster

    model, cluster = load_model(name), load_cluster("dgx-h100", 16384)
    for label in ("cold", "warm"):
        started = time.perf_counter()
        result = search(model, cluster, 2048, engine=engine)
        wall = time.perf_counter() - started
        s = result.stats
        print(f"{name} on 16,384 x H100, engine {engine} ({label}): {wall:.2f} s total, {s.simulate_s:.2f} s in "
              f"simulate_step ({s.simulated} calls), {wall - s.simulate_s:.2f} s search overhead; {s.shapes} shapes, "
              f"{s.candidates} candidates, {s.memory_checks} memory checks, {s.bound_pruned} pruned by the bound")
    best = result.best
    lay = best.layout
    print(f"  best: tp {lay.tp} pp {lay.pp} dp {lay.dp_replicate}x{lay.dp_shard} cp {lay.cp} ep {lay.ep} "
          f"etp {lay.etp} ZeRO-{lay.zero_stage} "
          f"mb {lay.micro_batch_size}x{lay.grad_accum_steps} {lay.pp_schedule} v{lay.virtual_stages}: "
          f"{best.result.step_time_s:.3f} s/step, MFU {best.result.mfu:.1%}")


def _fresh(engine: str, name: str = "gpt-1t") -> None:
    """search_1t in a new process on one core."""
    proc = subprocess.run([sys.executable, __file__, "--child", engine, "--child-model", name],
                          capture_output=True, text=True,
                          preexec_fn=_one_core, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"search failed: {proc.stderr}")
    print(proc.stdout, end="")


def time_cli(argv: list[str], runs: int) -> None:
    walls = []
    for _ in range(runs):
        started = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, preexec_fn=_one_core, cwd=REPO)
        walls.append(time.perf_counter() - started)
        if proc.returncode != 0:
            raise SystemExit(f"meshplan plan failed: {proc.stderr}")
    print(f"meshplan {' '.join(argv[2:])}, process start to output: best {min(walls):.2f} s, "
          f"median {statistics.median(walls):.2f} s over {runs} runs")


def imports_13b() -> None:
    proc = subprocess.run([sys.executable, "-X", "importtime", *PLAN_13B[1:]], capture_output=True, text=True,
                          cwd=REPO)
    rows = [line.split("|") for line in proc.stderr.splitlines()
            if line.startswith("import time:") and line.split("|")[1].strip().isdigit()]
    modules = [row[-1].strip() for row in rows]
    top_level = {row[-1].strip(): int(row[1]) for row in rows if not row[-1].startswith("  ")}
    heavy = sorted(top_level.items(), key=lambda kv: -kv[1])[:3]
    print(f"  imports: {len(modules)} modules, torch imported: {'torch' in modules}; heaviest top-level (us): "
          + ", ".join(f"{name} {us}" for name, us in heavy))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the 1T / 16,384-GPU searches")
    parser.add_argument("--child", metavar="ENGINE", help=argparse.SUPPRESS)  # one fresh search process
    parser.add_argument("--child-model", default="gpt-1t", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        search_1t(args.child, args.child_model)
        return
    time_cli(PLAN_13B, runs=5)
    imports_13b()
    if not args.quick:
        for engine in ("megatron", "meshplan"):
            _fresh(engine)
        _fresh("megatron", "kimi-k2")
        time_cli(PLAN_1T, runs=3)


if __name__ == "__main__":
    main()

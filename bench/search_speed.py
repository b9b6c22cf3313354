"""Speed of the layout search. Prints figures for the README; nothing here is asserted in tests.

    python bench/search_speed.py            # every measurement
    python bench/search_speed.py --quick    # skip the 16,384-GPU searches
    python bench/search_speed.py --runs 5   # fresh processes per figure (default 3)

Every measurement runs in a fresh process pinned to one CPU core, because a
user's first search starts cold: no rank groups, compiled pipeline orders or
collective prices cached yet. Each figure is the best and the median of
`--runs` such processes, as wall time and as the process's CPU time (on a
shared machine the wall time also counts other processes' turns on the core).

1. The 16,384-H100 searches: `plan --model 1T --gpus 16384` (gpt-1t,
   Megatron-LM's 1T configuration, the default engine, every
   precision-independent dimension and recompute mode searched), the same
   model as a Hugging Face GPT-2 config.json at global batch 8192
   (bench/data/gpt_1t_hf_config.json: 74,515 candidates, most of them ruled
   out by memory) and `plan --model kimi-k2 --gpus 16384 --engine megatron`
   (the 1T mixture of experts, 384 experts, ep and etp searched as well),
   each at the sequence length `plan` picks: the search alone (cold: the first
   search of the process; the time inside `simulate_step` split out), then
   the whole command from process start to output.
2. `meshplan plan --model 13B --gpus 16` from process start to output, and
   the import check: torch must never be imported on the planning path.

The processes run with Python's bytecode cache written (as `pip install`
leaves it, or any earlier run from a checkout), even where the environment
sets PYTHONDONTWRITEBYTECODE; `--cold-bytecode` times every process compiling
every module from source instead (about 0.1 s more per command).
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
HF_1T = str(REPO / "bench" / "data" / "gpt_1t_hf_config.json")
SEARCHES = {  # name -> (model, engine, global batch or 0 for plan's default): the 16,384-GPU searches above
    "dense 1T": ("gpt-1t", "meshplan", 0),
    "dense 1T HF config": (HF_1T, "meshplan", 8192),
    "Kimi-K2": ("kimi-k2", "megatron", 0),
}


def _child_env(cold_bytecode: bool) -> dict[str, str]:
    """The runs' environment: Python's bytecode cache in place, as after `pip install` (which compiles it) or
    any earlier run from a checkout; with --cold-bytecode every run compiles every module from source."""
    env = dict(os.environ)
    if cold_bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        return env
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _compile_bytecode() -> None:
    """Write the bytecode of the repository's packages once (__pycache__ is git-ignored)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "planner", "topologies", "cli.py"],
                   cwd=REPO, check=True, env=_child_env(False))


def _one_core() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def search_once(model_name: str, engine: str, global_batch: int = 0) -> None:
    """One cold search in this (fresh) process, at the sequence length `plan` picks; prints one tab-separated line."""
    from planner.model.load import load_model
    from planner.search.search import search
    from planner.training import default_seq_len
    from topologies.cluster_load import load_cluster

    model, cluster = load_model(model_name), load_cluster("dgx-h100", 16384)
    wall, cpu = time.perf_counter(), time.process_time()
    result = search(model, cluster, default_seq_len(model.max_seq_len), global_batch or None, engine=engine)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    s, best = result.stats, result.best
    lay = best.layout
    layout = (f"tp {lay.tp} pp {lay.pp} dp {lay.dp_replicate}x{lay.dp_shard} cp {lay.cp} ep {lay.ep} etp {lay.etp} "
              f"ZeRO-{lay.zero_stage} mb {lay.micro_batch_size}x{lay.grad_accum_steps} {lay.pp_schedule} "
              f"v{lay.virtual_stages} {lay.recompute}: {best.result.step_time_s:.3f} s/step, "
              f"{best.result.memory.peak_bytes / 2**30:.1f} GiB")
    print(f"{wall}\t{cpu}\t{s.simulate_s}\t{s.simulated}\t{s.shapes}\t{s.candidates}\t{layout}")


def _stats(values: list[float]) -> str:
    return f"best {min(values):.2f} s, median {statistics.median(values):.2f} s"


ENV: dict[str, str] = dict(os.environ)  # set by main: _child_env


def time_search(label: str, runs: int) -> None:
    """search_once in `runs` fresh processes on one core."""
    model_name, engine, batch = SEARCHES[label]
    rows = []
    for _ in range(runs):
        proc = subprocess.run([sys.executable, __file__, "--child", model_name, "--child-engine", engine,
                               "--child-batch", str(batch)],
                              capture_output=True, text=True, preexec_fn=_one_core, cwd=REPO, env=ENV)
        if proc.returncode != 0:
            raise SystemExit(f"search failed: {proc.stderr}")
        rows.append(proc.stdout.strip().split("\t"))
    wall, cpu, sim = ([float(r[i]) for r in rows] for i in range(3))
    simulated, shapes, candidates, layout = rows[0][3:]
    print(f"{label} ({Path(model_name).name}, engine {engine}) on 16,384 x H100, search alone, cold, over {runs} "
          "processes: "
          f"wall {_stats(wall)}; CPU {_stats(cpu)}; wall inside simulate_step {_stats(sim)} ({simulated} calls); "
          f"{shapes} shapes, {candidates} candidates")
    print(f"  best: {layout}")


def time_cli(argv: list[str], runs: int) -> None:
    walls, cpus = [], []
    for _ in range(runs):
        before = os.times()
        started = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, preexec_fn=_one_core, cwd=REPO, env=ENV)
        walls.append(time.perf_counter() - started)
        after = os.times()
        cpus.append(after.children_user + after.children_system - before.children_user - before.children_system)
        if proc.returncode != 0:
            raise SystemExit(f"meshplan plan failed: {proc.stderr}")
    print(f"meshplan {' '.join(argv[2:])}, process start to output: wall {_stats(walls)}; CPU {_stats(cpus)} "
          f"over {runs} runs")


def imports_13b() -> None:
    proc = subprocess.run([sys.executable, "-X", "importtime", *PLAN_13B[1:]], capture_output=True, text=True, env=ENV,
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
    parser.add_argument("--quick", action="store_true", help="skip the 16,384-GPU searches")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per figure")
    parser.add_argument("--cold-bytecode", action="store_true",
                        help="no bytecode cache: every process compiles every module from source")
    parser.add_argument("--child", metavar="MODEL", help=argparse.SUPPRESS)  # one fresh search process
    parser.add_argument("--child-engine", default="megatron", help=argparse.SUPPRESS)
    parser.add_argument("--child-batch", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        search_once(args.child, args.child_engine, args.child_batch)
        return
    ENV.clear()
    ENV.update(_child_env(args.cold_bytecode))
    if not args.cold_bytecode:
        _compile_bytecode()
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores; "
          f"bytecode {'compiled by every process' if args.cold_bytecode else 'cached, as after pip install'}")
    if not args.quick:
        for label, (model_name, engine, batch) in SEARCHES.items():
            time_search(label, args.runs)
            time_cli([*PLAN, "--model", model_name, "--gpus", "16384", "--engine", engine,
                      *(("--global-batch", str(batch)) if batch else ())], args.runs)
    time_cli(PLAN_13B, runs=args.runs)
    imports_13b()
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

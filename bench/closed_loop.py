"""Closed loop on this machine's CPU ranks: calibrate, plan, execute, report, update, predict again.

    .venv/bin/python bench/closed_loop.py            # both models, 2 ranks (~9-12 min on a quiet 2-core host)
    .venv/bin/python bench/closed_loop.py --models small --four-ranks   # add dp 2 x tp 2 on 4 ranks

For each model (bench/data/llama_small_cpu.json: hidden 384, 4 layers, 6 heads,
2 KV heads, FFN 1024, vocab 8192; bench/data/llama_medium_cpu.json: hidden 512,
8 heads, 4 KV heads, FFN 1536, vocab 16384), seq 256, global batch 8,
micro-batch 2, no recomputation:

1. `meshplan calibrate --quick --model M --seq-len 256 --micro-batch 2 --max-ranks 2`
   (the profile of ranks sharing this machine, at the model's shapes);
2. `meshplan plan` pinned to each layout (DDP, ZeRO-3, TP 2, PP 2 1f1b) with
   that profile, `meshplan execute --steps N`, `meshplan report --json`
   (median step time after the warm-up): error after calibrate alone;
3. `meshplan report RUN --update-calibration` from ONE run (--update-from,
   default tp2: it exercises compute, DTensor's host work and collectives;
   the run folded is the pass nearest the layout's median), then every OTHER
   layout re-simulated with the updated profile: error after one update from
   a different layout. The source layout itself is predicted from an update
   by the fallback layout (--fallback-from, default ddp), so no row ever
   scores the run it learnt from. Each update prints its per-part factors
   and the profile fields they moved (before -> after).

Calibration and runs of one model follow each other within minutes, so they
see the same machine; still, on a host shared with other jobs every figure
moves by tens of percent between minutes: read the table with the load
average it prints. Prints one table per model and the worst errors; --json
writes everything to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from executor.calibrate.fold import describe  # noqa: E402
from planner.plan import load_plan  # noqa: E402
from planner.simulate.calibration import load_calibration  # noqa: E402
from planner.simulate.step import simulate_step  # noqa: E402

MODELS = {"small": ROOT / "bench/data/llama_small_cpu.json", "medium": ROOT / "bench/data/llama_medium_cpu.json"}
LAYOUTS_2 = {
    "ddp": ["--dp", "2", "--zero", "0"],
    "zero3": ["--dp", "2", "--zero", "3"],
    "tp2": ["--tp", "2", "--no-sequence-parallel"],
    "pp2": ["--pp", "2", "--pp-schedule", "1f1b"],
}
LAYOUT_2D = {"dp2xtp2": ["--dp", "2", "--tp", "2", "--zero", "0", "--no-sequence-parallel"]}
TRAINING = ["--seq-len", "256", "--global-batch", "8", "--micro-batch", "2", "--recompute", "none"]


def meshplan(*args: str, quiet: bool = True) -> subprocess.CompletedProcess:
    """Run one meshplan verb from this checkout; raise with its stderr tail when it fails."""
    proc = subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], cwd=ROOT, capture_output=quiet, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-5:]
        raise SystemExit(f"meshplan {' '.join(args)} failed ({proc.returncode}):\n" + "\n".join(tail))
    return proc


def predict_s(plan_path: Path, profile_path: Path) -> float:
    plan = load_plan(plan_path)
    cal = load_calibration(profile_path, plan.cluster.gpu)
    return simulate_step(plan.model, plan.training, plan.layout, plan.cluster, cal, engine=plan.engine).step_time_s


def load_average() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def run_model(name: str, ranks: int, layouts: dict[str, list[str]], out: Path, steps: int, warmup: int,
              update_from: str, fallback_from: str, repeats: int) -> dict:
    """Calibrate, then plan, execute and report every layout; then fold one run and predict the others."""
    model = str(MODELS[name])
    work = out / f"{name}-{ranks}ranks"
    work.mkdir(parents=True, exist_ok=True)
    profile = work / "profile.json"
    t0 = time.time()
    meshplan("calibrate", "--quick", "--model", model, "--seq-len", "256", "--micro-batch", "2",
             "--max-ranks", str(ranks), "--out", str(profile))
    print(f"[{name}, {ranks} ranks] calibrated in {time.time() - t0:.0f} s (load {load_average()})", flush=True)
    rows: dict[str, dict] = {}
    for layout, flags in layouts.items():
        plan = work / f"{layout}.plan.json"
        meshplan("plan", "--cluster", "cpu", "--gpus", str(ranks), "--model", model, *TRAINING, *flags,
                 "--calibration", str(profile), "--top", "1", "-o", str(plan), "--json")
        rows[layout] = {"calibrated_s": predict_s(plan, profile), "plan": str(plan), "runs": [], "measured": []}
    # passes alternate the order (forward, backward, ...) so a load that drifts over the minutes
    # weighs on every layout alike; a layout's figure is the median over its passes
    order = list(layouts)
    for p in range(repeats):
        for layout in (order if p % 2 == 0 else order[::-1]):
            run = work / f"{layout}.run{p}"
            shutil.rmtree(run, ignore_errors=True)
            t0 = time.time()
            meshplan("execute", rows[layout]["plan"], "--steps", str(steps), "--out", str(run),
                     "--log-every", str(steps))
            doc = json.loads(meshplan("report", str(run), "--json", "--warmup-steps", str(warmup)).stdout)
            rows[layout]["runs"].append(str(run))
            rows[layout]["measured"].append(doc["measured"]["step_time_s"])
            print(f"[{name}] {layout} pass {p + 1}: measured {doc['measured']['step_time_s']:.3f} s, predicted "
                  f"{rows[layout]['calibrated_s']:.3f} s ({time.time() - t0:.0f} s, load {load_average()})",
                  flush=True)
    for row in rows.values():
        row["measured_s"] = statistics.median(row["measured"])
        # the update folds the run nearest the median: with an odd count the median run itself, the figure
        # the table scores (of two, the faster: load only ever slows a run)
        row["run"] = min(zip(row["runs"], row["measured"], strict=True),
                         key=lambda rm: (abs(rm[1] - row["measured_s"]), rm[1]))[0]
    updated: dict[str, Path] = {}
    for source in dict.fromkeys(s for s in (update_from, fallback_from) if s in rows):
        updated[source] = work / f"profile.updated-from-{source}.json"
        shutil.copy(profile, updated[source])
        proc = meshplan("report", rows[source]["run"], "--update-calibration", str(updated[source]),
                        "--warmup-steps", str(warmup), "--json")
        change = json.loads(proc.stdout)["calibration_update"]
        rows[source]["update"] = {k: change[k] for k in ("levers", "elasticities", "reached", "changed")}
        print(f"[{name}] update from {source}: {describe(change)}", flush=True)
    for layout, row in rows.items():
        source = update_from if layout != update_from or update_from not in rows else fallback_from
        if source in updated and source != layout:
            row["updated_from"] = source
            row["updated_s"] = predict_s(Path(row["plan"]), updated[source])
    return {"model": name, "ranks": ranks, "rows": rows, "load_average": load_average()}


def _err(pred: float, meas: float) -> float:
    return pred / meas - 1.0


def render(result: dict) -> str:
    lines = [f"{result['model']} model, {result['ranks']} CPU ranks (load average {result['load_average']})",
             "| layout | measured | after calibrate | error | after one update (from) | error |",
             "|---|---|---|---|---|---|"]
    for layout, r in result["rows"].items():
        upd = (f"{r['updated_s']:.3f} s ({r['updated_from']}) | {100 * _err(r['updated_s'], r['measured_s']):+.0f}%"
               if "updated_s" in r else "- | -")
        lines.append(f"| {layout} | {r['measured_s']:.3f} s | {r['calibrated_s']:.3f} s | "
                     f"{100 * _err(r['calibrated_s'], r['measured_s']):+.0f}% | {upd} |")
    cal = [abs(_err(r["calibrated_s"], r["measured_s"])) for r in result["rows"].values()]
    upd = [abs(_err(r["updated_s"], r["measured_s"])) for r in result["rows"].values() if "updated_s" in r]
    lines.append(f"worst |error|: {100 * max(cal):.0f}% after calibrate"
                 + (f", {100 * max(upd):.0f}% after one update from another layout" if upd else ""))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="small,medium", help="comma-separated: small, medium")
    parser.add_argument("--layouts", default=",".join(LAYOUTS_2), help="comma-separated 2-rank layouts")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="leading steps report skips")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per layout, in alternating order (odd: the update folds the median run itself)")
    parser.add_argument("--update-from", default="tp2", help="the layout whose run updates the profile")
    parser.add_argument("--fallback-from", default="ddp", help="the update source for the --update-from layout")
    parser.add_argument("--four-ranks", action="store_true", help="also dp 2 x tp 2 on 4 ranks (small model)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/meshplan-closed-loop"))
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args()
    start, results = time.time(), []
    layouts = {k: LAYOUTS_2[k] for k in args.layouts.split(",")}
    for name in [m for m in args.models.split(",") if m]:  # --models "" runs only --four-ranks
        results.append(run_model(name, 2, layouts, args.out, args.steps, args.warmup, args.update_from,
                                 args.fallback_from, args.repeats))
        print(render(results[-1]) + "\n", flush=True)
    if args.four_ranks:
        results.append(run_model("small", 4, {**LAYOUT_2D, "ddp": ["--dp", "4", "--zero", "0"]}, args.out,
                                 args.steps, args.warmup, "ddp", "dp2xtp2", args.repeats))
        print(render(results[-1]) + "\n", flush=True)
    print(f"closed loop: {time.time() - start:.0f} s in all")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

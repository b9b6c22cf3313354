"""Every layout the search returns for `--engine meshplan` runs: the debug models' top layouts, executed.

For each request below, `meshplan plan --model M --cluster cpu --gpus 4 --global-batch 8 --seq-len 64
PINS` is asked for its best TOP layouts (planner.cli.plan.search_plan, as the verb asks); every distinct
layout among them becomes a plan.json and runs `meshplan execute` for 4 steps on 4 CPU ranks; its loss and
gradient norm at every step must equal the single-process reference of the determinism test
(tests/multiproc/test_executor_determinism.py: same model, seed, data and hyper-parameters) within 1e-3.
A layout the executor cannot run must be refused by the planner (planner.engines), never reach a crash
here. tests/multiproc/test_planned_layouts.py runs a few of these layouts in CI; this runs them all
(about 80 layouts, 15-25 s each on 2 cores).

    .venv/bin/python bench/planned_layouts.py [--top 5] [--model debug] [--json out.json]

Requests the planner refuses outright (MoE with sequence parallel, MoE with ZeRO-1) are listed with its
reason. The last line says how many layouts ran and matched, e.g. `planned layouts: 80 of 80 ran and matched`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from planner.plan import Plan  # noqa: E402

GPUS, GLOBAL_BATCH, SEQ_LEN, STEPS, SEED = 4, 8, 64, 4, 0
RTOL = 1e-3
# (model, pins): nothing pinned, tp / pp pinned, sequence parallel, every schedule, every ZeRO stage,
# expert parallelism (keys of planner.search.candidates.Pins)
REQUESTS: tuple[tuple[str, dict], ...] = (
    *((model, pins) for model in ("debug", "debug-moe") for pins in (
        {}, {"tp": 2, "pp": 2}, {"pp": 2}, {"tp": 2}, {"tp": 2, "sequence_parallel": True},
        *({"pp": 2, "pp_schedule": s} for s in ("gpipe", "1f1b", "interleaved-1f1b", "zb-v")),
        *({"zero_stage": z} for z in (0, 1, 2, 3)))),
    ("debug-moe", {"ep": 2}), ("debug-moe", {"ep": 4}),
)


def planned(model: str, pins: dict, top: int) -> list[Plan]:
    """The search's best `top` layouts for the request, each as the plan.json `meshplan plan` would write for it."""
    from planner.cli.plan import search_plan
    from planner.search.candidates import Pins
    from planner.search.explain import build_plan

    the_plan, result = search_plan(model, "cpu", GPUS, (), SEQ_LEN, GLOBAL_BATCH, Pins(**pins), "meshplan", None, top)
    return [build_plan(the_plan.model, the_plan.cluster, dataclasses.replace(result, ranked=result.ranked[i:]),
                       "meshplan") for i in range(len(result.ranked))]


def describe(plan: Plan) -> str:
    """One line naming the layout: `tp2sp pp2 dp1x1 ep1 Z0 mb8x1 none gpipe`."""
    lay = plan.layout
    sched = "" if lay.pp == 1 else f" {lay.pp_schedule}" + (f"/v{lay.virtual_stages}" if lay.virtual_stages > 1 else "")
    return (f"{plan.model.name} tp{lay.tp}{'sp' if lay.sequence_parallel else ''} pp{lay.pp} "
            f"dp{lay.dp_replicate}x{lay.dp_shard} ep{lay.ep} Z{lay.zero_stage} "
            f"mb{lay.micro_batch_size}x{lay.grad_accum_steps} {lay.recompute}{sched}")


def distinct_layouts(requests, top: int) -> tuple[list[Plan], list[str]]:
    """Every distinct layout among the requests' top ones, in request order, and the requests the planner
    refused (no layout with those pins runs on meshplan's executor: its typed error, as `meshplan plan` says)."""
    from topologies.errors import MeshplanError

    seen: dict[tuple[str, str], Plan] = {}
    refused = []
    for model, pins in requests:
        try:
            plans = planned(model, pins, top)
        except MeshplanError as err:
            refused.append(f"{model} {pins}: {str(err).split(': ', 1)[-1][:160]}")
            continue
        for plan in plans:
            seen.setdefault((model, json.dumps(plan.layout.to_json(), sort_keys=True)), plan)
    return list(seen.values()), refused


def execute(plan: Plan, where: Path) -> tuple[list[dict] | None, str]:
    """Run `meshplan execute` on the plan: (metrics records, "") or (None, the error's last lines)."""
    where.mkdir(parents=True, exist_ok=True)
    plan.save(where / "plan.json")
    out = where / "run"
    cmd = [sys.executable, str(REPO / "cli.py"), "execute", str(where / "plan.json"), "--steps", str(STEPS),
           "--out", str(out), "--log-every", "100", "--seed", str(SEED)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    if res.returncode != 0:
        return None, f"exit {res.returncode}: " + " | ".join(res.stderr.strip().splitlines()[-3:])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()], ""


def mismatch(records: list[dict], reference: list[dict]) -> str:
    """'' when every step's loss and gradient norm are finite and within RTOL of the reference, else why."""
    for got, want in zip(records, reference, strict=True):
        for key in ("loss", "grad_norm"):
            if not abs(got[key] - want[key]) <= RTOL * abs(want[key]):  # also catches nan
                return f"step {got['step']} {key} {got[key]:.6g} vs single-process {want[key]:.6g}"
    return ""


def references(models) -> dict[str, list[dict]]:
    """The determinism test's single-process reference runs (its module docstring), per model."""
    sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "multiproc")]
    from test_executor_determinism import GLOBAL_BATCH as REF_BATCH
    from test_executor_determinism import SEED as REF_SEED
    from test_executor_determinism import SEQ_LEN as REF_SEQ
    from test_executor_determinism import STEPS as REF_STEPS
    from test_executor_determinism import reference_run

    assert (REF_BATCH, REF_SEQ, REF_STEPS, REF_SEED) == (GLOBAL_BATCH, SEQ_LEN, STEPS, SEED)
    return {model: reference_run(model) for model in models}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=5, help="layouts per request (the plan verb's default is 5)")
    parser.add_argument("--model", action="append", help="only these models (debug, debug-moe)")
    parser.add_argument("--json", type=Path, default=None, help="also write every layout's result here")
    args = parser.parse_args()
    requests = [(m, p) for m, p in REQUESTS if not args.model or m in args.model]
    plans, refused = distinct_layouts(requests, args.top)
    refs = references({p.model.name for p in plans})
    print(f"{len(plans)} distinct layouts from {len(requests)} requests (top {args.top} each); refused by the "
          f"planner: {len(refused)}", flush=True)
    for line in refused:
        print(f"  refused {line}")
    rows, good = [], 0
    with tempfile.TemporaryDirectory(prefix="planned-layouts-") as tmp:
        for i, plan in enumerate(plans):
            start = time.perf_counter()
            records, error = execute(plan, Path(tmp) / f"layout-{i}")
            error = error or mismatch(records, refs[plan.model.name])
            good += not error
            print(f"{'ok ' if not error else 'BAD'} {time.perf_counter() - start:5.1f} s  {describe(plan)}"
                  f"{'  ' + error if error else ''}", flush=True)
            rows.append({"layout": describe(plan), "parallel": plan.layout.to_json(), "error": error,
                         "losses": [r["loss"] for r in records or []]})
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"planned layouts: {good} of {len(plans)} ran and matched")
    sys.exit(0 if good == len(plans) else 1)


if __name__ == "__main__":
    main()

"""One command for a lent GPU: tokens/s, MFU and peak memory of a ~1B and an ~8B Llama against the plan.

    make gpu-check                                    # .venv's python if there is one, else python3
    python3 bench/gpu_check.py --json gpu_check.json  # the same, by hand, from the repository's root
    python3 bench/gpu_check.py --dry-run              # on CPU: everything but the GPU

Runs on one GPU, within --budget-s (default 420 s, so the whole check ends
in under 8 minutes), `meshplan plan` then `meshplan execute` for:

  1b  llama3.2-1b (1.24B), seq 2048, global batch 16, 30 steps
  8b  the Llama 3 8B architecture (hidden 4096, 32 heads, 8 KV heads, FFN
      14336, vocab 128256) with as many of its 32 layers as the memory model
      fits on this GPU (meshplan's recipe keeps fp32 weights, gradients and
      AdamW moments, 16 B per parameter; fused AdamW adds no temporaries:
      all 32 layers need 127.3 GiB, 30 fit an H200's 141 GB), seq 2048, global
      batch 8, 20 steps

each with compile off and on, bf16 and fp8 (torchao's float8 recipe), the
layout, micro-batching and recomputation as the planner picks them for one
GPU (`--cluster` the preset of the GPU found). Cases run most useful first
(bf16 eager, then compiled, then fp8); a case whose estimate (start-up,
compilation, steps x the predicted step time x 1.3) does not fit the time
left runs fewer steps, or is skipped with the reason; a run still going at
the deadline gets SIGINT and is measured on the steps it finished.

For each case the JSON (--json, default OUT/gpu_check.json) holds the
command lines, the plan, the prediction (tokens/s, MFU, allocated and
reserved peak: planner.memory.reserved) and what the run measured
(executor.components.measure over metrics.jsonl, the first WARMUP_STEPS
steps dropped: compilation and the allocator's warm-up), with their ratios,
or why it did not run. The environment block says what this machine has:
Python, torch, CUDA, the GPU and its catalog name, the packages meshplan
imports, and torchao. A lent GPU machine may have no network: then `.venv`
cannot be made and the check runs on the system python3 with the repository
on PYTHONPATH; what is missing is named, with how to carry a wheel
(torchao for the fp8 cases), and those cases are skipped rather than failed.

--dry-run checks everything but the GPU: the environment (without CUDA),
every plan for the GPU named by --gpu (default h200, the lent machine's),
the command lines, `meshplan execute --dry-run` of each model's first plan
(rank 0 built on the meta device), and the JSON, with every case marked
"planned".
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCHEMA = "meshplan-gpu-check/1"
DEFAULT_BUDGET_S = 420  # + at most 60 s for a run stopped at the deadline to write its summary: under 8 minutes
WARMUP_STEPS = 5
MIN_STEPS = WARMUP_STEPS + 5
STARTUP_S = {"1b": 30.0, "8b": 45.0}  # torchrun, imports, model build and init, first allocation (guesses)
COMPILE_S = 60.0  # torch.compile of the blocks (one graph, reused by every block), forward and backward (a guess)
ESTIMATE_MARGIN = 1.3
FULL_LAYERS_8B = 32
MODELS = {  # name -> (preset, seq_len, global batch, steps)
    "1b": ("llama3.2-1b", 2048, 16, 30),
    "8b": ("llama3-8b", 2048, 8, 20),
}
# most useful first: what runs if time is short
CASES = [("1b", "bf16", False), ("8b", "bf16", False), ("1b", "bf16", True), ("8b", "bf16", True),
         ("1b", "fp8", True), ("8b", "fp8", True), ("1b", "fp8", False), ("8b", "fp8", False)]
# what meshplan imports at run time (pyproject's dependencies): import name -> distribution name
PACKAGES = {"torch": "torch", "numpy": "numpy", "networkx": "networkx", "scipy": "scipy", "click": "click",
            "rich": "rich", "matplotlib": "matplotlib", "yaml": "pyyaml", "tokenizers": "tokenizers",
            "jinja2": "jinja2", "pyarrow": "pyarrow"}


@dataclasses.dataclass
class Case:
    model: str
    precision: str
    compile: bool
    status: str = "pending"  # planned (dry run), ok, stopped, failed, skipped
    reason: str | None = None
    commands: dict = dataclasses.field(default_factory=dict)
    plan: dict | None = None
    predicted: dict | None = None
    measured: dict | None = None
    measured_over_predicted: dict | None = None
    wall_s: float | None = None

    @property
    def name(self) -> str:
        return f"{self.model}-{self.precision}-{'compile' if self.compile else 'eager'}"

    def to_json(self) -> dict:
        return {"name": self.name, **dataclasses.asdict(self)}


# ---- the environment ----------------------------------------------------------------------


def environment() -> dict:
    """What this machine has: Python, packages (version or None), torch's CUDA and GPU, torchao."""
    env: dict = {"python": sys.version.split()[0], "executable": sys.executable, "packages": {}}
    for name, dist in PACKAGES.items():
        try:
            importlib.import_module(name)
            env["packages"][name] = _version(dist)
        except Exception as exc:  # noqa: BLE001 - any import failure means "cannot use it here"
            env["packages"][name] = None
            env.setdefault("import_errors", {})[name] = f"{type(exc).__name__}: {exc}"
    env["missing"] = [n for n, v in env["packages"].items() if v is None]
    env["cuda"] = None
    if env["packages"]["torch"]:
        import torch

        env["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            env["cuda"] = {"devices": torch.cuda.device_count(), "name": props.name,
                           "capability": [props.major, props.minor], "memory_bytes": int(props.total_memory),
                           "multiprocessors": props.multi_processor_count}
    env["torchao"] = torchao_status(env["packages"]["torch"])
    return env


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:  # importable but not installed as a distribution (on PYTHONPATH)
        return "present"


def torchao_status(torch_version: str | None) -> dict:
    """torchao's float8 training importable, or why not and how to carry a wheel to a machine without network."""
    try:
        import torchao
        import torchao.float8  # noqa: F401

        return {"available": True, "version": _version("torchao"), "path": str(Path(torchao.__file__).parent)}
    except Exception as exc:  # noqa: BLE001
        py = f"{sys.version_info.major}.{sys.version_info.minor}"
        try:
            from executor.components.float8 import TORCHAO_PIN as pin  # the release paired with .venv's torch
        except ImportError:
            pin = "torchao (see pyproject's consumers extra)"
        return {"available": False, "error": f"{type(exc).__name__}: {exc}", "how": (
            f"fp8 needs torchao's float8 training beside torch {torch_version or '(missing)'}. On a machine with the "
            f"network: `python3 -m pip download --no-deps --only-binary=:all: --python-version {py} "
            "--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "
            f"torchao==VERSION` (the torchao release built for this torch; meshplan pins {pin} for torch "
            "2.13), carry .whl beside the repository, then here: `python3 -m pip install --no-index --no-deps "
            "--target /tmp/site .whl/torchao-*.whl` and run with PYTHONPATH=/tmp/site added")}


# ---- planning -----------------------------------------------------------------------------


def meshplan_argv(*args: str) -> list[str]:
    return [sys.executable, str(ROOT / "cli.py"), *args]


def _env() -> dict:
    """This environment with the repository first on PYTHONPATH (a carried torchao's --target kept after it)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _run(argv: list[str], timeout: float | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=_env())


def model_file(work: Path, model: str, layers: int | None) -> str:
    """The preset's name, or a ModelSpec JSON of it with `layers` layers (the 8B architecture cut to fit)."""
    preset = MODELS[model][0]
    if layers is None:
        return preset
    from planner.model.load import load_model

    spec = load_model(preset)
    spec = dataclasses.replace(spec, n_layers=layers, name=f"{preset}-{layers}l")
    path = work / f"{spec.name}.json"
    path.write_text(json.dumps(spec.to_json(), indent=1))
    return str(path)


def plan_case(case: Case, work: Path, cluster: list[str], layers: int | None) -> int:
    """`meshplan plan` for the case; returns its exit code (3: nothing fits). Fills commands and plan."""
    _, seq, batch, _ = MODELS[case.model]
    path = work / f"{case.name}.plan.json"
    argv = meshplan_argv("plan", "--model", model_file(work, case.model, layers), *cluster, "--gpus", "1",
                         "--seq-len", str(seq), "--global-batch", str(batch), "--precision", case.precision,
                         *(["--compile"] if case.compile else []), "-o", str(path))
    proc = _run(argv, timeout=300)
    case.commands["plan"] = argv
    if proc.returncode != 0:
        case.reason = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        return proc.returncode
    doc = json.loads(path.read_text())
    pred = doc["prediction"]
    case.plan = {"path": str(path), "model": doc["model"]["name"], "layers": doc["model"]["n_layers"],
                 "parallel": {k: doc["parallel"][k] for k in ("micro_batch_size", "grad_accum_steps", "recompute",
                                                              "zero_stage", "dp_shard")},
                 "training": {k: doc["training"][k] for k in ("seq_len", "global_batch_size", "precision", "compile")}}
    case.predicted = {"step_time_s": pred["step_time_s"], "tokens_per_s": pred["tokens_per_s"], "mfu": pred["mfu"],
                      "peak_allocated_bytes": pred.get("allocated_peak_bytes"),
                      "peak_reserved_bytes": pred.get("reserved_peak_bytes"),
                      "peak_memory_bytes": pred["peak_memory_bytes"]}
    case.reason = None
    return 0


def plan_all(cases: list[Case], work: Path, cluster: list[str]) -> None:
    """Plan every case; the 8B architecture keeps the most layers (even counts from 32 down) that fit."""
    layers = FULL_LAYERS_8B
    for case in cases:
        if case.status == "skipped":
            continue
        if case.model != "8b":
            if plan_case(case, work, cluster, None):
                case.status = "skipped"
            continue
        while True:
            code = plan_case(case, work, cluster, None if layers == FULL_LAYERS_8B else layers)
            if code != 3 or layers <= 2:
                break
            layers -= 2
        if code:
            case.status = "skipped"
        elif layers < FULL_LAYERS_8B:
            case.plan["note"] = (f"{layers} of the 32 layers of Llama 3 8B: the memory model fits no more on one GPU "
                                 "of this kind with meshplan's recipe")


# ---- running ------------------------------------------------------------------------------


def steps_within(case: Case, remaining_s: float) -> int:
    """The case's steps, cut to what the time left allows by its estimate; 0 when fewer than MIN_STEPS fit."""
    steps = MODELS[case.model][3]
    fixed = STARTUP_S[case.model] + (COMPILE_S if case.compile else 0.0)
    per_step = case.predicted["step_time_s"] * ESTIMATE_MARGIN
    fit = int((remaining_s - fixed) // per_step) if remaining_s > fixed else 0
    return min(steps, fit) if fit >= MIN_STEPS else 0


def execute_argv(case: Case, work: Path, steps: int) -> list[str]:
    return meshplan_argv("execute", case.plan["path"], "--steps", str(steps), "--out", str(work / case.name),
                         "--overwrite", "--log-every", str(steps))


def run_case(case: Case, work: Path, steps: int, deadline: float) -> None:
    """`meshplan execute` the case's plan; SIGINT at the deadline (the run stops at a step boundary)."""
    out = work / case.name
    argv = execute_argv(case, work, steps)
    case.commands["execute"] = argv
    start = time.time()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        _, stderr = proc.communicate(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # `execute` stops every rank at the next step and writes what it has
        try:
            _, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
    case.wall_s = time.time() - start
    metrics = out / "metrics.jsonl"
    if proc.returncode not in (0, 130) or not metrics.exists():
        case.status, case.reason = "failed", f"exit {proc.returncode}: {stderr.strip()[-2000:]}"
        return
    measure_case(case, metrics)
    if proc.returncode == 130:
        case.status = "stopped"
        case.reason = f"stopped at the time budget after {case.measured['steps']} steps"


def measure_case(case: Case, metrics: Path) -> None:
    from executor.components.measure import counted_rows, measure, read_metrics
    from planner.plan import load_plan

    rows = read_metrics(metrics)
    skip = min(WARMUP_STEPS, len(rows) - 1)
    measured = measure(load_plan(case.plan["path"]), rows, skip)
    counted = counted_rows(rows, skip)
    reserved = [r["peak_reserved_bytes"] for r in counted if r.get("peak_reserved_bytes")]
    case.measured = {**{k: measured[k] for k in ("steps", "steps_counted", "step_time_s", "tokens_per_s", "mfu",
                                                 "loss_first", "loss_last")},
                     "peak_allocated_bytes": measured["peak_memory_bytes"],
                     "peak_reserved_bytes": max(reserved) if reserved else None}
    case.measured_over_predicted = {k: (case.measured[k] / case.predicted[k] if case.measured.get(k)
                                        and case.predicted.get(k) else None)
                                    for k in ("tokens_per_s", "mfu", "peak_allocated_bytes", "peak_reserved_bytes")}
    case.status = "ok"


# ---- the check ----------------------------------------------------------------------------


def cluster_flags(env: dict, gpu: str | None) -> tuple[list[str], str]:
    """`--cluster PRESET` (or dgx-h100 with --set gpu=NAME) for the GPU found, or for --gpu; and its catalog name."""
    from topologies.cluster_load import preset_for_gpu
    from topologies.errors import UsageError
    from topologies.hardware import get_gpu
    from topologies.smi_topo import catalog_name

    name = gpu or (catalog_name(env["cuda"]["name"]) if env["cuda"] else None)
    if name is None:
        raise UsageError(f"GPU {env['cuda']['name']!r} is not in meshplan's catalog: pass --gpu NAME "
                         "(`meshplan topo list`) to plan as the nearest one")
    get_gpu(name)
    preset = preset_for_gpu(name)
    return (["--cluster", preset] if preset else ["--cluster", "dgx-h100", "--set", f"gpu={name}"]), name


def skip_unrunnable(cases: list[Case], env: dict) -> None:
    """fp8 without torchao or below compute capability 8.9; anything without the packages meshplan imports."""
    capability = tuple(env["cuda"]["capability"]) if env["cuda"] else None
    for case in cases:
        if env["missing"]:
            case.status, case.reason = "skipped", f"missing Python packages: {', '.join(env['missing'])}"
        elif case.precision == "fp8" and not env["torchao"]["available"]:
            case.status, case.reason = "skipped", f"torchao not importable ({env['torchao']['error']})"
        elif case.precision == "fp8" and capability is not None and capability < (8, 9):
            case.status, case.reason = "skipped", f"fp8 needs compute capability 8.9+, this GPU is {capability}"


def check(args) -> dict:
    from topologies.errors import UsageError

    started = time.time()
    deadline = started + args.budget_s
    env = environment()
    if env["packages"]["torch"] is None:
        raise UsageError("torch is not importable here: " + env["import_errors"]["torch"])
    if not args.dry_run and env["cuda"] is None:
        raise UsageError(f"no CUDA device here (torch {env['packages']['torch']} sees none): run on a GPU machine, "
                         "or check the plans and the JSON on CPU with --dry-run")
    cluster, gpu = cluster_flags(env, args.gpu or ("h200" if args.dry_run and not env["cuda"] else None))
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    cases = [Case(m, p, c) for m, p, c in CASES if m in args.models and p in args.precisions
             and ("compile" if c else "eager") in args.modes]
    skip_unrunnable(cases, env)
    plan_all(cases, work, cluster)
    if args.dry_run:
        dry_run_cases(cases, work)
    else:
        for case in cases:
            if case.status != "pending":
                continue
            steps = steps_within(case, deadline - time.time())
            if not steps:
                case.status, case.reason = "skipped", "time budget: the estimate does not fit the time left"
                continue
            print(f"gpu-check: {case.name}, {steps} steps ...", file=sys.stderr, flush=True)
            run_case(case, work, steps, deadline)
    return {"schema": SCHEMA, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "dry_run": args.dry_run, "gpu": gpu, "cluster": cluster, "budget_s": args.budget_s,
            "elapsed_s": round(time.time() - started, 1), "environment": env,
            "cases": [c.to_json() for c in cases]}


def dry_run_cases(cases: list[Case], work: Path) -> None:
    """`meshplan execute PLAN --dry-run` of each model's first plan; every planned case becomes 'planned'."""
    checked: set[str] = set()
    for case in cases:
        if case.status != "pending":
            continue
        case.commands["execute"] = execute_argv(case, work, MODELS[case.model][3])
        case.status = "planned"
        if case.model in checked:
            continue
        checked.add(case.model)
        proc = _run(meshplan_argv("execute", case.plan["path"], "--dry-run"), timeout=600)
        if proc.returncode != 0:
            case.status, case.reason = "failed", f"execute --dry-run: {proc.stderr.strip()[-2000:]}"


def table(result: dict) -> str:
    """One line per case: measured next to predicted (tokens/s, MFU, allocated and reserved peak GiB)."""
    def cell(row: dict | None, key: str, width: int) -> str:
        value = (row or {}).get(key)
        if value is None:
            return "-".rjust(width)
        text = f"{value:.1%}" if key == "mfu" else f"{value / (1 << 30):.1f}" if key.endswith("bytes") else \
            f"{value:,.0f}"
        return text.rjust(width)

    columns = (("tokens_per_s", "tok/s", 8), ("mfu", "MFU", 6), ("peak_allocated_bytes", "alloc GiB", 9),
               ("peak_reserved_bytes", "resv GiB", 8))
    lines = [f"{'case':18s} {'status':8s} " + " ".join(f"{title:>{w}s} {'pred':>{w}s}" for _, title, w in columns)]
    for c in result["cases"]:
        cells = " ".join(f"{cell(c['measured'], k, w)} {cell(c['predicted'], k, w)}" for k, _, w in columns)
        lines.append(f"{c['name']:18s} {c['status']:8s} {cells}" + (f"  {c['reason']}" if c["reason"] else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="plans, command lines and the JSON on CPU; no GPU")
    p.add_argument("--gpu", default=None, help="catalog GPU to plan for (default: the one found; h200 in --dry-run)")
    p.add_argument("--out", default=str(ROOT / "runs" / "gpu-check"), help="plans, run directories, the JSON")
    p.add_argument("--json", default=None, help="the result file (default OUT/gpu_check.json)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="wall-clock budget of the runs")
    p.add_argument("--models", default="1b,8b", type=lambda s: s.split(","))
    p.add_argument("--precisions", default="bf16,fp8", type=lambda s: s.split(","))
    p.add_argument("--modes", default="eager,compile", type=lambda s: s.split(","))
    args = p.parse_args(argv)
    for given, known, flag in ((args.models, MODELS, "--models"), (args.precisions, ("bf16", "fp8"), "--precisions"),
                               (args.modes, ("eager", "compile"), "--modes")):
        if not given or any(g not in known for g in given):
            p.error(f"{flag} takes a comma-separated list of {', '.join(known)}")
    from topologies.errors import MeshplanError

    try:
        result = check(args)
    except MeshplanError as exc:  # no GPU, a GPU outside the catalog: one line, the error's exit code
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    path = Path(args.json) if args.json else Path(args.out) / "gpu_check.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    print(f"gpu-check: {result['gpu']}, torch {result['environment']['packages']['torch']}, "
          f"{result['elapsed_s']:.0f} s; JSON in {path}")


if __name__ == "__main__":
    main()

"""torchrun entry: `executor.worker` under torch's profiler, recording each step's collectives.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/collective_worker.py \
        REPORT_PREFIX PLAN --out DIR --steps S --log-every K

The profiler sees every collective a ProcessGroup runs, whoever issues it:
torch.distributed's Python functions, FSDP2 and DTensor, and the C++ reducer of
DDP, which never passes through Python (a wrapper over torch.distributed would
miss its bucket all-reduces). On gloo each collective is one `gloo:<kind>`
event carrying its input's shape and dtype. Each optimizer step
(`executor.train.Trainer.step`) runs inside a `meshplan_step_<n>` range; a
collective belongs to the step whose range holds it. Writes
REPORT_PREFIX.rank<R>.json per rank: {"steps": {n: [[kind, numel, dtype], ...]}}
in issue order.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository

STEP_RANGE = "meshplan_step_"


def collectives_by_step(trace: dict) -> dict[int, list[list]]:
    """{step: [[kind, numel, dtype], ...]} from a chrome trace of torch's profiler."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = [(e["ts"], e["ts"] + e["dur"], int(e["name"][len(STEP_RANGE):]))
             for e in events if e["name"].startswith(STEP_RANGE)]
    out: dict[int, list[list]] = {n: [] for _, _, n in steps}
    for e in sorted(events, key=lambda e: e["ts"]):
        if not e["name"].startswith("gloo:"):
            continue
        args = e.get("args", {})
        dims, types = args.get("Input Dims") or [[]], args.get("Input type") or [""]
        numel = 1
        for d in dims[0]:
            numel *= d
        for start, end, n in steps:
            if start <= e["ts"] <= end:
                out[n].append([e["name"][len("gloo:"):], numel, types[0]])
    return out


def main(argv: list[str]) -> None:

    from torch.profiler import ProfilerActivity, profile, record_function

    from executor import train, worker

    prefix, worker_argv = argv[0], argv[1:]
    Path(worker.parse_args(worker_argv)[1].out).mkdir(parents=True, exist_ok=True)  # as `execute` makes it
    step = train.Trainer.step

    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    started = []

    def ranged_step(self):
        if not started:  # started after the model is built: FSDP2 swaps parameters while
            prof.start()  # initializing, which the profiler's tensor references would block
            started.append(True)
        with record_function(f"{STEP_RANGE}{self.state.step + 1}"):
            return step(self)

    train.Trainer.step = ranged_step
    rank = os.environ.get("RANK", "0")
    worker.run(worker_argv)
    prof.stop()
    trace = Path(f"{prefix}.rank{rank}.trace.json")
    prof.export_chrome_trace(str(trace))
    steps = collectives_by_step(json.loads(trace.read_text()))
    trace.unlink()
    Path(f"{prefix}.rank{rank}.json").write_text(json.dumps({"steps": steps}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])

"""torchrun entry: `executor.worker` with a host-sync counter installed (tests/host_syncs.py).

    python -m torch.distributed.run --standalone --nproc-per-node N tests/host_sync_worker.py \
        REPORT_PREFIX PLAN --out DIR --steps S --log-every K

Runs the real worker (process group, mesh, Trainer.run: every step, the stop
check, the metrics line) and writes REPORT_PREFIX.rank<R>.json per rank:
{"mode": "cpu"|"cuda", "steps": [{"step", "own", "library"}]}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ (host_syncs)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository

from host_syncs import CudaSyncCounter, HostSyncCounter, StepWindows  # noqa: E402


def main(argv: list[str]) -> None:
    import torch

    from executor import train, worker
    from planner.plan import load_plan

    prefix, worker_argv = argv[0], argv[1:]
    cuda = torch.cuda.is_available() and load_plan(worker_argv[0]).cluster.gpu.kind != "cpu"
    Path(worker.parse_args(worker_argv)[1].out).mkdir(parents=True, exist_ok=True)  # as `execute` makes it
    counter = CudaSyncCounter() if cuda else HostSyncCounter()
    windows = StepWindows(counter)
    # reads by the clock (at least every READ_EVERY_S of training) depend on how fast a loaded host runs the
    # steps; the counts here are those of the logging steps alone (test_host_syncs' LOGGING_STEPS)
    train.READ_EVERY_S = 1e9
    step = train.Trainer.step

    def counted_step(self):
        windows.begin(self.state.step + 1)
        return step(self)

    train.Trainer.step = counted_step
    with counter:
        worker.run(worker_argv)
        windows.close()
    rank = os.environ.get("RANK", "0")
    Path(f"{prefix}.rank{rank}.json").write_text(json.dumps({"mode": "cuda" if cuda else "cpu",
                                                             "steps": windows.steps}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])

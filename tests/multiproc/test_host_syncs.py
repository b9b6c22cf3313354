"""Device-to-host syncs per optimizer step of the real training loop, counted on 4 CPU ranks.

On GPUs every host read of a device value (`.item()`, `float(t)`, `.tolist()`
...) waits for all queued kernels; a loop that reads values every step stalls
the host every step, which CPU timings cannot show (tests/host_syncs.py says
how reads are counted). Each layout is one torchrun of the real
`executor.worker` with the counter installed (tests/host_sync_worker.py),
`--log-every 3` over 6 steps: steps 1, 3 and 6 print a progress line, steps
2, 4 and 5 do not.

Two assertions:
- the reads, site by site, on every rank and every step: none on a step
  that logs nothing; on a logging step, the window's records read back at
  once (executor.components.metrics.MetricsWindow: the device values, then
  the agreed peaks and step time) and the stop agreement at the next step
  boundary (none after the last step); under expert parallelism also the
  token counts of each MoE layer's all-to-all (one `.tolist()` per MoE
  layer and micro-batch: torch.distributed.all_to_all_single takes its
  split sizes as host lists, as torchtitan's expert parallelism reads them
  too). A new read anywhere in the loop fails here, naming its site;
- no read on a step that logs nothing (loss and norms reduced on device and
  read on logging steps only), expert parallelism's split sizes apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import REPO
from torchrun_util import make_plan

from planner.plan import load_plan

RANKS, STEPS, LOG_EVERY = 4, 6, 3
LOGGING_STEPS = {1, 3, 6}  # executor.components.metrics.ProgressLine: the first, every K-th and the last
LAYOUTS = {
    "pp2_tp2": ("debug", ["--pp", "2", "--tp", "2", "--micro-batch", "2", "--pp-schedule", "1f1b"]),
    "moe_fsdp4_ep4": ("debug-moe", ["--dp-shard", "4", "--ep", "4", "--zero", "3", "--micro-batch", "1"]),
}
# on a logging step: the window read back (device values; the worst rank's peaks and the window's time)
READ_STEP = Counter({"executor/components/metrics.py read .tolist()": 2})
# the agreed stop request and whether an async checkpoint finished, at the boundary after a read step
STOP_READ = Counter({"executor/resilience/keeper.py boundary .tolist()": 1})
EP_SPLIT_SIZES = "executor/parallel/expert.py split_sizes .tolist()"  # send and receive sizes, one read


def _run(tmp_path: Path, name: str) -> tuple[Path, list[dict]]:
    model, pinned = LAYOUTS[name]
    plan = make_plan(tmp_path, name, *pinned, model=model, gpus=RANKS)
    prefix = tmp_path / f"{name}-syncs"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
         str(REPO / "tests" / "host_sync_worker.py"), str(prefix), str(plan), "--out", str(tmp_path / name),
         "--steps", str(STEPS), "--log-every", str(LOG_EVERY)],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return plan, [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(RANKS)]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("syncs")
    return {name: _run(tmp, name) for name in LAYOUTS}


def _expected(plan_path: Path, step: int) -> Counter:
    plan = load_plan(plan_path)
    want = READ_STEP + (STOP_READ if step < STEPS else Counter()) if step in LOGGING_STEPS else Counter()
    if plan.model.moe is not None and plan.layout.ep > 1:
        want[EP_SPLIT_SIZES] = plan.model.n_moe_layers * plan.layout.grad_accum_steps
    return want


@pytest.mark.parametrize("name", LAYOUTS)
def test_reads_per_step(reports, name):
    plan, per_rank = reports[name]
    for rank, report in enumerate(per_rank):
        assert report["mode"] == "cpu"
        assert [row["step"] for row in report["steps"]] == list(range(1, STEPS + 1))
        for row in report["steps"]:
            assert Counter(row["own"]) == _expected(plan, row["step"]), (name, rank, row["step"], row["own"])


@pytest.mark.parametrize("name", LAYOUTS)
def test_no_reads_on_steps_that_log_nothing(reports, name):
    _, per_rank = reports[name]
    for report in per_rank:
        quiet = {row["step"]: sum(n for site, n in row["own"].items() if site != EP_SPLIT_SIZES)
                 for row in report["steps"] if row["step"] not in LOGGING_STEPS}
        assert quiet and all(n == 0 for n in quiet.values()), quiet

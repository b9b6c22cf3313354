"""Device-to-host syncs per optimizer step of the real training loop, counted on 4 CPU ranks.

On GPUs every host read of a device value (`.item()`, `float(t)`, `.tolist()`
...) waits for all queued kernels; a loop that reads values every step stalls
the host every step, which CPU timings cannot show (tests/host_syncs.py says
how reads are counted). Each layout is one torchrun of the real
`executor.worker` with the counter installed (tests/host_sync_worker.py),
`--log-every 3` over 6 steps: steps 1, 3 and 6 print a progress line, steps
2, 4 and 5 do not.

Two assertions:
- today's reads, site by site, on every rank and every step: three in the
  step (the global norm for clipping, the loss checked finite before the
  update and the peak memory of the metrics record) and two in the stop
  check at the step boundary; under
  expert parallelism also the token counts of each MoE layer's all-to-all
  (three `.tolist()` per MoE layer and micro-batch). A new read anywhere in
  the loop fails here, naming its site;
- the target: no read on a step that logs nothing (loss and norms reduced on
  device and read on logging steps only). Marked xfail(strict=True): the
  day the step loop meets it, the test passes, strict turns that into a
  failure, and the marker must go, switching the guard on.
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
from host_syncs import syncs_per_step
from torchrun_util import make_plan

from planner.plan import load_plan

RANKS, STEPS, LOG_EVERY = 4, 6, 3
LOGGING_STEPS = {1, 3, 6}  # executor.components.metrics.ProgressLine: the first, every K-th and the last
LAYOUTS = {
    "pp2_tp2": ("debug", ["--pp", "2", "--tp", "2", "--micro-batch", "2", "--pp-schedule", "1f1b"]),
    "moe_fsdp4_ep4": ("debug-moe", ["--dp-shard", "4", "--ep", "4", "--zero", "3", "--micro-batch", "1"]),
}
# every step today, in the step itself
STEP_READS = Counter({
    "executor/components/optim.py clip_grad_norm float()": 1,  # the global gradient norm, for the clip factor
    "executor/train.py _reduce_loss float()": 1,  # the global mean loss, checked finite before the update
    "executor/train.py _reduce_peaks int()": 1,  # the worst rank's peak memory
})
# the agreed stop request and whether an async checkpoint finished, at every step boundary but the last
STOP_READ = Counter({"executor/resilience/keeper.py boundary .item()": 2})
EP_SPLIT_SIZES = "executor/parallel/expert.py split_sizes .tolist()"  # send, receive, per-peer counts


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
    want = STEP_READS + (STOP_READ if step < STEPS else Counter())
    if plan.model.moe is not None and plan.layout.ep > 1:
        want[EP_SPLIT_SIZES] = 3 * plan.model.n_moe_layers * plan.layout.grad_accum_steps
    return want


@pytest.mark.parametrize("name", LAYOUTS)
def test_reads_per_step_today(reports, name):
    plan, per_rank = reports[name]
    for rank, report in enumerate(per_rank):
        assert report["mode"] == "cpu"
        assert [row["step"] for row in report["steps"]] == list(range(1, STEPS + 1))
        for row in report["steps"]:
            assert Counter(row["own"]) == _expected(plan, row["step"]), (name, rank, row["step"], row["own"])


@pytest.mark.xfail(strict=True, reason="target: the step loop reads device values on logging steps only")
@pytest.mark.parametrize("name", LAYOUTS)
def test_no_reads_on_steps_that_log_nothing(reports, name):
    _, per_rank = reports[name]
    for report in per_rank:
        quiet = {step: n for step, n in syncs_per_step(report).items() if step not in LOGGING_STEPS}
        assert quiet and all(n == 0 for n in quiet.values()), quiet

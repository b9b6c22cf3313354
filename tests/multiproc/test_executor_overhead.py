"""bench/executor_overhead.py runs: the minimal hand-written loop trains the same model as `meshplan execute`.

The bench's ratios mean something only if both sides do the same work: same
weights, same batches, same updates. Their losses at every step must agree
(fp32 on CPU ranks), against `meshplan execute` and against the executor's
Trainer run beside the minimal loop in the same ranks (the A/B), here on
TP 2 x FSDP 2: the hand-written TP plan, loss_parallel and FSDP2 units.
Timings are printed, never asserted.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from conftest import REPO

LOSS_RTOL = 1e-3
STEPS = 3


def test_minimal_loop_matches_the_executor_and_the_last_line_lists_ratios(tmp_path):
    out = tmp_path / "overhead.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "executor_overhead.py"), "--layouts", "tp2_dp2",
                           "--rounds", "1", "--steps", str(STEPS), "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"ratios: tp2_dp2 \d+\.\d\dx", last), last
    row = json.loads(out.read_text())["rows"]["tp2_dp2"]
    (run,) = row["losses"]
    assert len(run["executor"]) == len(run["minimal"]) == STEPS
    for a, b in zip(run["executor"], run["minimal"], strict=True):
        assert abs(a - b) <= LOSS_RTOL * abs(b), run
    assert row["loss_rel_diff"] <= LOSS_RTOL  # the A/B's losses included
    assert row["ratio"] > 0 and row["ab_cpu_ratio"] > 0 and row["ab_wall_ratio"] > 0
    assert len(row["executor"]) == len(row["minimal"]) == len(row["ab_executor_cpu"]) == STEPS - 2  # 2 of warm-up

"""bench/executor_overhead.py runs: the minimal hand-written loop trains the same model as `meshplan execute`.

The bench's ratio means something only if both sides do the same work: same
weights, same batches, same updates. Their losses at every step must agree
(fp32 on CPU ranks), for FSDP and for TP 2 x FSDP 2, the hand-written TP plan
and loss_parallel included. Timings are printed, never asserted.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from conftest import REPO

LOSS_RTOL = 1e-3


def test_minimal_loop_matches_the_executor_and_the_last_line_lists_ratios(tmp_path):
    out = tmp_path / "overhead.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "executor_overhead.py"), "--layouts", "fsdp,tp2_dp2",
                           "--rounds", "1", "--steps", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"ratios: fsdp \d+\.\d\dx, tp2_dp2 \d+\.\d\dx", last), last
    rows = json.loads(out.read_text())["rows"]
    for name, row in rows.items():
        (run,) = row["losses"]
        assert len(run["executor"]) == len(run["minimal"]) == 3
        for a, b in zip(run["executor"], run["minimal"], strict=True):
            assert abs(a - b) <= LOSS_RTOL * abs(b), (name, run)
        assert row["ratio"] > 0 and len(row["executor"]) == len(row["minimal"]) == 1  # 3 steps, 2 of warm-up

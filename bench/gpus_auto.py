"""Time of `meshplan plan --gpus auto` (the GPU-count sweep), as a user runs it. Prints figures; asserts nothing.

    python bench/gpus_auto.py            # 405B and 70B on dgx-h100, 5 runs each
    python bench/gpus_auto.py --runs 3

Each run is a fresh process (`cli.py plan --model M --gpus auto --json`),
timed from start to exit, so imports count; the sweep's own time is the JSON's
`elapsed_s`. Figures depend on the CPU and its load: on a shared machine take
the best run as the figure and the median as the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
CASES = (("405B", "dgx-h100"), ("70B", "dgx-h100"))


def run_once(model: str, cluster: str) -> tuple[float, dict]:
    argv = [sys.executable, str(REPO / "cli.py"), "plan", "--model", model, "--cluster", cluster, "--gpus", "auto",
            "--json"]
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr}")
    return wall, json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    for model, cluster in CASES:
        walls, sweeps = [], []
        for _ in range(args.runs):
            wall, doc = run_once(model, cluster)
            walls.append(wall)
            sweeps.append(doc["elapsed_s"])
        counted = [p["gpus"] for p in doc["points"]]
        print(f"{model} on {cluster}: smallest fitting {doc['smallest_fitting_gpus']} GPUs, searched {counted}, "
              f"ruled out {doc['ruled_out_by_model_state']}, scaling stops paying after "
              f"{doc['scaling_stops_paying_after']}")
        print(f"  wall (process start to exit): best {min(walls):.2f} s, median {statistics.median(walls):.2f} s; "
              f"sweep alone: best {min(sweeps):.2f} s, median {statistics.median(sweeps):.2f} s ({args.runs} runs)")


if __name__ == "__main__":
    main()

"""Time of `meshplan plan --gpus auto` (the GPU-count sweep), as a user runs it. Prints figures; asserts nothing.

    python bench/gpus_auto.py            # 405B and 70B on dgx-h100, 5 runs each
    python bench/gpus_auto.py --runs 3

Each run is a fresh process (`cli.py plan --model M --gpus auto --json`),
timed from start to exit, so imports count; the sweep's own time is the JSON's
`elapsed_s`. Wall time depends on the machine's load, so the process's CPU
time (user + system, from os.wait4) is printed too: on an idle core the wall
time is about the CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {stderr}")
    return wall, json.loads(stdout)


def cpu_seconds_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    for model, cluster in CASES:
        walls, sweeps, cpus = [], [], []
        for _ in range(args.runs):
            before = cpu_seconds_of_children()
            wall, doc = run_once(model, cluster)
            cpus.append(cpu_seconds_of_children() - before)
            walls.append(wall)
            sweeps.append(doc["elapsed_s"])
        counted = [p["gpus"] for p in doc["points"]]
        print(f"{model} on {cluster}: smallest fitting {doc['smallest_fitting_gpus']} GPUs, searched {counted}, "
              f"ruled out {doc['ruled_out_by_model_state']}, scaling stops paying after "
              f"{doc['scaling_stops_paying_after']}")
        print(f"  wall (process start to exit): best {min(walls):.2f} s, median {statistics.median(walls):.2f} s; "
              f"sweep alone: best {min(sweeps):.2f} s, median {statistics.median(sweeps):.2f} s; "
              f"CPU time of the process: median {statistics.median(cpus):.2f} s ({args.runs} runs, load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()

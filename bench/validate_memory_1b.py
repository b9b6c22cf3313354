"""The memory model against PyTorch's tracker for a 1B-class Llama on 64 GPUs (the README's validation figure).

Llama 3.2 1B (16 layers, hidden 2048, 32/8 heads, 128k vocabulary, tied
embeddings) on 8 DGX H100 nodes, bf16, sequence 2048, micro-batch 1, one rank
of the full 64-rank world per layout, built by the executor under a fake
process group and FakeTensorMode (`meshplan validate-memory`). Target:
|predicted - tracked| / tracked <= 10% for FSDP, HSDP, TP x FSDP, ZeRO-1 and CP x FSDP.
(Pipeline and expert-parallel cases, on smaller models: tests/unit/test_memory_phases.py.)

    .venv/bin/python bench/validate_memory_1b.py [--json out.json] [--seq-len 2048]

Takes about a minute on 2 CPU cores (ZeRO-1 is the slowest: DDP over full
fp32 replicas).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from executor.validate.memory import TOLERANCE, validate_plan  # noqa: E402
from planner.layout import Layout  # noqa: E402
from planner.model.load import load_model  # noqa: E402
from planner.plan import Plan, with_stage_layers  # noqa: E402
from planner.training import TrainingSpec  # noqa: E402
from topologies.cluster_load import load_cluster  # noqa: E402

GPUS = 64
LAYOUTS = {
    "FSDP (ZeRO-3) 64": dict(dp_shard=64, zero_stage=3),
    "HSDP 8 x 8": dict(dp_replicate=8, dp_shard=8, zero_stage=3),
    "TP 4 x FSDP 16": dict(tp=4, dp_shard=16, zero_stage=3),
    "ZeRO-1 64 (DDP + ZeroRedundancyOptimizer)": dict(dp_shard=64, zero_stage=1),
    "CP 2 x FSDP 32 (K/V all-gathered over cp)": dict(cp=2, dp_shard=32, zero_stage=3),
}


def plan_for(layout: dict, seq_len: int) -> Plan:
    model = load_model("llama3.2-1b")
    lay = with_stage_layers(model, Layout(micro_batch_size=1, **layout))
    return Plan(model=model, cluster=load_cluster("dgx-h100", GPUS),
                training=TrainingSpec(seq_len=seq_len, global_batch_size=lay.dp * lay.micro_batch_size),
                layout=lay)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--json", type=Path, default=None, help="also write every report here")
    args = parser.parse_args()
    gib = 2**30
    results = {}
    print(f"llama3.2-1b on {GPUS} x h100-sxm, bf16, seq {args.seq_len}, micro-batch 1 (tensor bytes, GiB)")
    print(f"{'layout':44s} {'predicted':>9s} {'tracked':>8s} {'error':>7s}  worst category gaps (pred - tracked)")
    for name, layout in LAYOUTS.items():
        start = time.perf_counter()
        doc = validate_plan(plan_for(layout, args.seq_len))
        gaps = sorted(doc["by_category"].items(), key=lambda kv: -abs(kv[1]["difference"]))[:2]
        gap_text = ", ".join(f"{k} {v['difference'] / gib:+.2f}" for k, v in gaps)
        flag = "" if abs(doc["error"]) <= TOLERANCE else "  <-- outside 10%"
        print(f"{name:44s} {doc['predicted_peak_bytes'] / gib:9.2f} {doc['tracked_peak_bytes'] / gib:8.2f} "
              f"{100 * doc['error']:+6.1f}%  {gap_text}  ({time.perf_counter() - start:.0f} s){flag}")
        results[name] = doc
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

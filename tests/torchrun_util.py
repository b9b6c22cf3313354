"""Helpers for multi-process executor tests: make plans with the `plan` verb, run `execute` for real.

Every multi-rank test launches real workers: `meshplan execute` starts
torchrun itself (CPU ranks on gloo), so these helpers only run the CLI as a
user would and read what it wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli

TEST_DATA = ("--global-batch", "8", "--seq-len", "64")


def make_plan(tmp: Path, name: str, *pinned: str, model: str = "debug", gpus: int = 4) -> Path:
    """`meshplan plan --model M --cluster cpu --gpus N --global-batch 8 --seq-len 64 PINNED -o NAME.json`."""
    path = tmp / f"{name}.json"
    res = run_cli("plan", "--model", model, "--cluster", "cpu", "--gpus", str(gpus), *TEST_DATA, *pinned,
                  "-o", str(path))
    assert res.code == 0, f"plan {pinned} failed: {res.stderr}"
    return path


def local_gpu_cluster(n_gpus: int):
    """A cluster of this machine's GPU model (a preset of it, else dgx-h100 with `gpu` set to it).

    `execute` refuses a plan made for another GPU model (executor.preflight), so
    GPU tests plan for the one they run on.
    """
    import torch

    from topologies.cluster_load import load_cluster, preset_for_gpu
    from topologies.smi_topo import catalog_name

    name = catalog_name(torch.cuda.get_device_name(0))
    preset = preset_for_gpu(name) if name else None
    if preset:
        return load_cluster(preset, n_gpus)
    return load_cluster("dgx-h100", n_gpus, {"gpu": name} if name else None)


def execute(plan: Path, out: Path, *flags: str, steps: int = 4, timeout: float = 300) -> list[dict]:
    """Run `meshplan execute PLAN --steps N --out OUT FLAGS`; return metrics.jsonl's records."""
    res = run_cli("execute", str(plan), "--steps", str(steps), "--out", str(out), "--log-every", "100", *flags,
                  timeout=timeout)
    assert res.code == 0, f"execute {plan.name} failed ({res.code}):\n{res.stderr[-4000:]}"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


# name -> (model, pinned `meshplan plan` flags). Eight layouts (DDP, ZeRO-1/2/3, HSDP, TP, PP, PP+TP), with gradient
# accumulation and recomputation folded into some, plus the paths they do not reach:
# GPT-style (tied embeddings, learned positions, biases) under TP+SP with FSDP2's replicate,
# and the interleaved pipeline schedule with FSDP (pp2_dp2 pins ZeRO-0: replicate under PP).
DETERMINISM_LAYOUTS = {
    "ddp": ("debug", ["--dp", "4", "--zero", "0", "--micro-batch", "1", "--recompute", "selective"]),
    "zero1": ("debug", ["--dp-shard", "4", "--zero", "1"]),
    "zero2": ("debug", ["--dp-shard", "4", "--zero", "2", "--micro-batch", "1"]),
    "zero3": ("debug", ["--dp-shard", "4", "--zero", "3", "--recompute", "full"]),
    "hsdp_2x2": ("debug", ["--dp", "4", "--dp-shard", "2", "--zero", "3"]),
    "tp2_dp2": ("debug", ["--tp", "2", "--dp", "2"]),
    "pp2_dp2": ("debug", ["--pp", "2", "--dp", "2", "--zero", "0", "--micro-batch", "1", "--pp-schedule", "1f1b"]),
    "pp2_tp2": ("debug", ["--pp", "2", "--tp", "2", "--micro-batch", "2", "--pp-schedule", "1f1b"]),
    "gpt_tp2_dp2_replicate": ("debug-gpt", ["--tp", "2", "--dp", "2", "--zero", "0", "--sequence-parallel"]),
    "pp2_interleaved_dp2": ("debug", ["--pp", "2", "--dp", "2", "--micro-batch", "1",
                                      "--pp-schedule", "interleaved-1f1b", "--virtual-stages", "2"]),
}

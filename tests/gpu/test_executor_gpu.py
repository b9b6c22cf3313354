"""The CUDA path on one GPU (skipped without CUDA): bf16 and fp16 training, measured peak vs the memory model.

What runs on GPUs and never on the CPU tier: bf16 compute (autocast, FSDP2
mixed precision), fp16 with dynamic loss scaling, the CUDA SDPA kernels and
the caching allocator. Each case is one real `meshplan execute` on one GPU.

- bf16 / fp16 `debug` against the fp32 single-process CPU reference of the
  determinism test at a loose tolerance (low-precision matmuls);
- the measured peak (torch.cuda.max_memory_allocated, metrics.jsonl) of a
  ~100M-parameter Llama against `validate-memory`'s prediction for the same
  plan, within 10% (tensor bytes: the prediction's `other` is left out), and
  the reserved peak (torch.cuda.max_memory_reserved) against the memory
  model's reserved figure within 15%.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import run_cli
from torchrun_util import execute, local_gpu_cluster

from planner.layout import Layout
from planner.model.load import load_model
from planner.model.spec import ModelSpec
from planner.plan import Plan, with_stage_layers
from planner.training import TrainingSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "multiproc"))
from test_executor_determinism import GLOBAL_BATCH, SEED, SEQ_LEN, STEPS, reference_run  # noqa: E402

LOW_PRECISION_RTOL = 2e-2


def _plan(tmp_path: Path, spec: ModelSpec, dtype: str, seq_len: int, batch: int, **layout) -> Path:
    lay = with_stage_layers(spec, Layout(micro_batch_size=batch, **layout))
    plan = Plan(model=spec, cluster=local_gpu_cluster(1),
                training=TrainingSpec(seq_len=seq_len, global_batch_size=batch, dtype=dtype), layout=lay)
    path = tmp_path / f"{spec.name}-{dtype}.json"
    plan.save(path)
    return path


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_debug_tracks_the_fp32_cpu_reference(tmp_path, dtype):
    plan = _plan(tmp_path, load_model("debug"), dtype, SEQ_LEN, GLOBAL_BATCH)
    records = execute(plan, tmp_path / "run", "--seed", str(SEED), steps=STEPS)
    for got, want in zip(records, reference_run("debug"), strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=LOW_PRECISION_RTOL), (dtype, got["step"])


def test_measured_peak_matches_validate_memory(tmp_path):
    spec = ModelSpec(name="llama-100m", n_layers=8, hidden=768, n_heads=12, n_kv_heads=4, head_dim=64,
                     ffn_hidden=2048, vocab=32000, max_seq_len=1024)
    plan = _plan(tmp_path, spec, "bf16", 1024, 2, recompute="op")
    records = execute(plan, tmp_path / "run", steps=3)
    measured = max(r["peak_memory_bytes"] for r in records)
    res = run_cli("validate-memory", str(plan), "--json", timeout=300)
    assert res.code == 0, res.stderr
    predicted = json.loads(res.stdout)["predicted_peak_bytes"]
    assert abs(predicted - measured) / measured <= 0.10, (predicted, measured)
    # the caching allocator's high-water mark (expandable segments, as the launcher sets them) against the
    # memory model's reserved figure (planner.memory.reserved): one GPU, one pool, the loss's hole
    from planner.memory.estimate import estimate_memory
    from planner.plan import load_plan

    loaded = load_plan(plan)
    reserved = estimate_memory(loaded.model, loaded.training, loaded.layout, loaded.cluster.gpu, loaded.engine,
                               0).reserved_bytes
    measured_reserved = max(r["peak_reserved_bytes"] for r in records)
    assert measured_reserved >= measured
    assert abs(reserved - measured_reserved) / measured_reserved <= 0.15, (reserved, measured_reserved)

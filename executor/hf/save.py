"""`execute --save-hf-every K`: a Hugging Face model directory RUN/hf/step-K/ written by the running job.

Collective (every rank calls it at the same step): the model's state is
saved with DCP into RUN/hf/.tmp-step-K/dcp (each rank its shards, as a
checkpoint), then every rank converts its share of the output shard files
from it (executor.hf.export.write_shards, shard i on rank i % world), rank 0
writes config.json, the index and the tokenizer files, and renames the
directory to step-K once all are complete, so a crash leaves no partial
step-K behind. Written every K steps and at the run's last step.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch import nn

from planner.model.spec import ModelSpec
from planner.run_flags import RunFlags
from topologies.terminal import log

HF_DIR = "hf"


def save_hf_due(opts: RunFlags, step: int) -> bool:
    """Whether --save-hf-every K asks for an export at this step (every K-th and the last step)."""
    every = getattr(opts, "save_hf_every", 0)
    return bool(every) and (step % every == 0 or step == opts.steps)


def save_hf_if_due(parts: list[nn.Module], spec: ModelSpec, opts: RunFlags, step: int) -> Path | None:
    """RUN/hf/step-K/ when --save-hf-every K asks for one at this step (or it is the last step)."""
    if not save_hf_due(opts, step):
        return None
    return save_hf(parts, spec, opts.out_dir, step)


def save_hf(parts: list[nn.Module], spec: ModelSpec, run_dir: Path, step: int) -> Path:
    from executor.components.checkpoint import (
        _agree,
        _barrier,
        _collect,
        _distributed,
        _on_rank0,
        _rank,
        _single_process_is_intended,
    )
    from executor.hf.export import SOURCE, finish, plan_export, write_shards

    root = run_dir / HF_DIR
    tmp, final = root / f".tmp-step-{step}", root / f"step-{step}"

    def prepare() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "out").mkdir(parents=True)

    _agree(_on_rank0(prepare), f"cannot prepare {tmp}")
    state, _ = _collect({"model": parts})
    with _single_process_is_intended():
        dcp.save(state, checkpoint_id=str(tmp / "dcp"), no_dist=not _distributed())
    _barrier()
    source = run_dir / SOURCE if (run_dir / SOURCE).is_dir() else None
    # a LoRA run's directory holds the merged weights (executor.hf.peft): every adapted linear knows alpha / r
    scale = next((m.lora_scale for part in parts for m in part.modules() if hasattr(m, "lora_scale")), None)
    plan = plan_export(spec, tmp / "dcp", None, source, lora_scale=scale)
    world = _world()
    write_shards(plan, tmp / "dcp", tmp / "out", _rank(), world)
    _barrier()

    def publish() -> None:
        finish(plan, tmp / "out", source)
        if final.exists():  # the same step written again after a restart
            shutil.rmtree(final)
        os.replace(tmp / "out", final)
        shutil.rmtree(tmp, ignore_errors=True)

    _agree(_on_rank0(publish), f"cannot publish {final}")
    if _rank() == 0:
        log(f"hf: wrote {final} ({len(plan.shards)} shard file{'s' if len(plan.shards) > 1 else ''}, {plan.dtype})")
    return final


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

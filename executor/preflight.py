"""Checks before any worker starts: does this machine match the plan, can the run write and read?

A plan is priced for one machine shape; running it elsewhere silently
invalidates the prediction (or runs out of memory an hour in). So `execute`
refuses, with the numbers, a plan whose device type, node count, GPUs per
node or per-GPU memory does not match what it finds. A plan for the `cpu`
cluster runs CPU ranks anywhere its predicted memory fits in the host's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from planner.plan import Plan
from planner.run_flags import RunFlags
from topologies.errors import UsageError
from topologies.hardware import GIB

MEMORY_TOLERANCE = 0.95  # spec sheets round up: an "80 GB" H100 reports 79.2 GiB to CUDA


@dataclass(frozen=True)
class Found:
    """The accelerators of this node, as CUDA reports them (n_devices 0 without CUDA)."""

    n_devices: int
    memory_bytes: int = 0  # of device 0
    name: str = ""
    host_available_bytes: int = 0  # MemAvailable of /proc/meminfo; 0 when unknown

    @classmethod
    def detect(cls) -> Found:
        import torch

        host = _host_available_bytes()
        if not torch.cuda.is_available():
            return cls(0, host_available_bytes=host)
        props = torch.cuda.get_device_properties(0)
        return cls(torch.cuda.device_count(), int(props.total_memory), props.name, host)


def _host_available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def check_hardware(plan: Plan, found: Found, nnodes: int) -> None:
    """Raise UsageError when the plan cannot run as planned on `nnodes` nodes like this one."""
    cluster = plan.cluster
    shape = f"{plan.world_size} ranks as {cluster.n_nodes} node(s) x {cluster.gpus_per_node}"
    if nnodes != cluster.n_nodes:
        raise UsageError(
            f"the plan runs {shape}, but --nnodes is {nnodes}: launch on {cluster.n_nodes} node(s) "
            f"or re-plan with --gpus {nnodes * cluster.gpus_per_node}"
        )
    if cluster.gpu.kind == "cpu":
        _check_host_memory(plan, found)
        return
    if found.n_devices == 0:
        raise UsageError(
            f"the plan is for {plan.world_size} x {cluster.gpu.name} GPUs ({shape}) but this machine has no "
            "CUDA device: run it where the GPUs are, or plan CPU ranks with --cluster cpu"
        )
    if found.n_devices < cluster.gpus_per_node:
        raise UsageError(
            f"the plan needs {cluster.gpus_per_node} GPUs per node ({shape}) but this node has "
            f"{found.n_devices}: re-plan with --gpus {found.n_devices * nnodes}"
        )
    planned = cluster.gpu.memory_bytes
    if found.memory_bytes < MEMORY_TOLERANCE * planned:
        raise UsageError(
            f"the plan is for {cluster.gpu.name} with {planned / GIB:.1f} GiB per GPU but this {found.name} has "
            f"{found.memory_bytes / GIB:.1f} GiB: re-plan for this GPU"
        )
    peak = predicted_peak_bytes(plan)
    if peak > found.memory_bytes:
        raise UsageError(
            f"the plan needs a peak of {peak / GIB:.1f} GiB per GPU, more than "
            f"this {found.name}'s {found.memory_bytes / GIB:.1f} GiB: re-plan (more GPUs, ZeRO-3 or recomputation)"
        )


def predicted_peak_bytes(plan: Plan) -> int:
    """The memory model's peak for the plan as it is now.

    Re-estimated rather than read from plan.json's prediction: a plan edited
    by hand (a bigger model, another batch) keeps a stale prediction.
    """
    from planner.memory.estimate import estimate_memory

    return estimate_memory(plan.model, plan.training, plan.layout, plan.cluster.gpu, plan.engine).peak_bytes


def _check_host_memory(plan: Plan, found: Found) -> None:
    """CPU ranks share the host's memory, and compute in fp32 (twice a 16-bit plan's bytes)."""
    if not found.host_available_bytes:
        return
    peak = predicted_peak_bytes(plan)
    per_rank = peak * (1 if plan.training.dtype == "fp32" else 2)
    ranks = plan.cluster.gpus_per_node
    if per_rank * ranks > found.host_available_bytes:
        raise UsageError(
            f"the plan needs {peak / GIB:.1f} GiB per rank "
            f"({per_rank / GIB:.1f} GiB in fp32 on CPU ranks) x {ranks} ranks = {per_rank * ranks / GIB:.1f} GiB, "
            f"but this machine has {found.host_available_bytes / GIB:.1f} GiB available: "
            "plan a smaller --global-batch or --micro-batch, or fewer ranks"
        )


def check_data(plan: Plan, flags: RunFlags) -> str:
    """Open the token source and read the first global batch's first and last sequence.

    Text is tokenized here, once, before any rank starts (and cached next to the
    data; executor/components/data/cache.py), so a bad line, an id outside the
    model's vocabulary or a corpus shorter than one sequence is refused in one line.
    Two sequences prove the source opens and yields in-vocabulary tokens at both
    ends of a batch; reading the whole batch could cost gigabytes before launch.
    """
    from executor.components.data import open_source, run_tokenizer
    from executor.components.data.tokenizer import tokenizer_files
    from topologies.terminal import log

    tokenizer = run_tokenizer(flags)
    if tokenizer is not None:  # checked even when the data is token ids: a mistyped path is found now
        tokenizer_files(tokenizer)
    source = open_source(flags.data, plan.model.vocab, plan.training.seq_len, flags.seed, tokenizer=tokenizer,
                         log=lambda line: log(f"execute: {line}"))
    source.sequences(np.array(sorted({0, plan.training.global_batch_size - 1})))
    return source.describe()


def prepare_out(out: Path, plan_text: str) -> None:
    """Create the run directory and write its plan.json copy; UsageError when it cannot."""
    from topologies.files import write_text

    try:
        out.mkdir(parents=True, exist_ok=True)
        write_text(out / "plan.json", plan_text, what="the run's plan copy")
    except OSError as exc:
        raise UsageError(f"cannot write the run directory {str(out)!r}: {exc.strerror}; pass a writable --out") from None


RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "checkpoints")  # what a run leaves in --out (plan.json is rewritten)


def check_run_dir(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to run into a directory holding another run unless --resume or --overwrite says what to do.

    Without this, a new run would truncate the old metrics.jsonl and keep the
    old checkpoints, which a later --resume would then load: two runs mixed.
    """
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} is a file: give a directory for the run")
    held = [name for name in RUN_OUTPUTS if (out / name).exists()]
    if resume:
        if held and not (out / "checkpoints").is_dir():  # it would start from step 0 and truncate the metrics
            raise UsageError(f"--resume: {str(out)!r} holds a run but no checkpoints/ to continue it from; pass "
                             "--overwrite to start over (and --checkpoint-every K to be able to resume later)")
        return
    if held and not overwrite:
        raise UsageError(f"--out {str(out)!r} already holds a run ({', '.join(held)}): pass --resume to continue "
                         "it, --overwrite to delete it and start over, or another --out")


def clear_run_dir(out: Path) -> None:
    """--overwrite: delete the previous run's metrics, summary and checkpoints (nothing else in the directory)."""
    import shutil

    for name in RUN_OUTPUTS:
        path = out / name
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        except OSError as exc:
            raise UsageError(f"--overwrite: cannot delete {str(path)!r}: {exc.strerror}") from None

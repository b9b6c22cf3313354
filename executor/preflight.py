"""Checks before any worker starts: does this machine match the plan, can the run write and read?

A plan is priced for one machine shape; running it elsewhere silently
invalidates the prediction (or runs out of memory an hour in), and MFU, which
divides by the planned GPU's peak, would be computed against another chip's.
So `execute` refuses, with the numbers, a plan whose node count, GPUs per
node, GPU model or per-GPU memory does not match what it finds:

- the GPU model: CUDA's device name mapped to the catalog
  (topologies.smi_topo.catalog_name) must be the plan's GPU, and its compute
  capability the catalog's for it (COMPUTE_CAPABILITY). A device the catalog
  does not name runs a plan only when its capability is the planned GPU's,
  with a note saying so;
- memory: at least MEMORY_TOLERANCE of the planned GPU's (spec sheets round
  up), and above the memory model's peak for the plan as it is now;
- a plan made with `--set` (gpu_memory_gib=94, gpu_bf16_tflops=...) carries
  the changed GPU; every message names the changes, so a refusal says what
  the plan expects and where that came from.

A plan for the `cpu` cluster runs CPU ranks anywhere its predicted memory
fits in the host's.
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
    capability: tuple[int, int] = (0, 0)  # of device 0; (0, 0) when not read

    @classmethod
    def detect(cls) -> Found:
        import torch

        host = _host_available_bytes()
        if not torch.cuda.is_available():
            return cls(0, host_available_bytes=host)
        props = torch.cuda.get_device_properties(0)
        return cls(torch.cuda.device_count(), int(props.total_memory), props.name, host, (props.major, props.minor))

    def describe(self) -> str:
        """'NVIDIA H100 80GB HBM3 (compute capability 9.0, 79.2 GiB)', or 'no CUDA device'."""
        if not self.n_devices:
            return "no CUDA device"
        cc = f"compute capability {_cc(self.capability)}, " if self.capability != (0, 0) else ""
        return f"{self.name} ({cc}{self.memory_bytes / GIB:.1f} GiB)"


def _cc(capability: tuple[int, int] | None) -> str:
    return f"{capability[0]}.{capability[1]}" if capability else "unknown"


def expected_gpu(plan: Plan) -> str:
    """What the plan expects of each GPU, with its --set changes:
    'h100-sxm (80.0 GiB, compute capability 9.0, bf16 peak 989.4 TFLOP/s)', or with
    '; by --set gpu_memory_gib=94 (catalog 80)' before the closing parenthesis."""
    from topologies.cluster_load import gpu_settings
    from topologies.smi_topo import COMPUTE_CAPABILITY

    gpu = plan.cluster.gpu
    dtype = _peak_dtype(plan)
    changes = gpu_settings(gpu)
    made = "" if not changes else "; by --set " + ", ".join(f"{key}={value} (catalog {was})"
                                                            for key, value, was in changes)
    peak = f"{dtype} peak {gpu.peak_flops(dtype) / 1e12:,.1f} TFLOP/s" if _has_peak(gpu, dtype) else f"no {dtype} peak"
    return (f"{gpu.name} ({gpu.memory_bytes / GIB:.1f} GiB, compute capability "
            f"{_cc(COMPUTE_CAPABILITY.get(gpu.name))}, {peak}{made})")


def _peak_dtype(plan: Plan) -> str:
    """The dtype MFU divides by on GPUs (executor.components.measure.flops_dtype)."""
    return plan.training.dtype


def _has_peak(gpu, dtype: str) -> bool:
    """False where the GPU has no tensor cores for `dtype` (GPUSpec.peak_flops refuses it: T4 and bf16)."""
    from topologies.errors import TopologyError

    try:
        return gpu.peak_flops(dtype) > 0
    except TopologyError:
        return False


def _host_available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def check_hardware(plan: Plan, found: Found, nnodes: int) -> list[str]:
    """Raise UsageError when the plan cannot run as planned on `nnodes` nodes like this one.

    Returns notes worth a line on the console (a device the catalog does not
    name, accepted on its compute capability); empty when all is as planned.
    """
    cluster = plan.cluster
    shape = f"{plan.world_size} ranks as {cluster.n_nodes} node(s) x {cluster.gpus_per_node}"
    if nnodes != cluster.n_nodes:
        raise UsageError(
            f"the plan runs {shape}, but --nnodes is {nnodes}: launch on {cluster.n_nodes} node(s) "
            f"or re-plan with --gpus {nnodes * cluster.gpus_per_node}"
        )
    if cluster.gpu.kind == "cpu":
        _check_host_memory(plan, found)
        return []
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
    notes = check_gpu_model(plan, found)
    planned = cluster.gpu.memory_bytes
    if found.memory_bytes < MEMORY_TOLERANCE * planned:
        raise UsageError(
            f"the plan expects {expected_gpu(plan)}: {planned / GIB:.1f} GiB per GPU, but this {found.name} has "
            f"{found.memory_bytes / GIB:.1f} GiB: re-plan for this GPU"
        )
    peak = predicted_peak_bytes(plan)
    if peak > found.memory_bytes:
        raise UsageError(
            f"the plan needs a peak of {peak / GIB:.1f} GiB per GPU, more than "
            f"this {found.name}'s {found.memory_bytes / GIB:.1f} GiB: re-plan (more GPUs, ZeRO-3 or recomputation)"
        )
    return notes


def check_gpu_model(plan: Plan, found: Found) -> list[str]:
    """Refuse a GPU other than the plan's (module docstring); a note for an uncatalogued one that matches.

    The plan's step time, memory and MFU are the planned GPU's: run on another
    model, MFU divides by a peak that is not this chip's and the prediction
    it is compared with was never about this machine.
    """
    from topologies.cluster_load import preset_for_gpu
    from topologies.smi_topo import COMPUTE_CAPABILITY, catalog_name

    gpu = plan.cluster.gpu
    planned_cc = COMPUTE_CAPABILITY.get(gpu.name)
    here = catalog_name(found.name)
    dtype = _peak_dtype(plan)
    if here is not None and here != gpu.name:
        from topologies.hardware import get_gpu

        other = get_gpu(here)
        peak = f"{dtype} peak {other.peak_flops(dtype) / 1e12:,.1f} TFLOP/s" if _has_peak(other, dtype) else \
            f"no {dtype} tensor cores"
        preset = preset_for_gpu(here)
        fix = f"--cluster {preset}" if preset else f"--set gpu={here}"
        raise UsageError(
            f"the plan expects {expected_gpu(plan)} but GPU 0 here is {found.describe()}, the catalog's {here} "
            f"({peak}): the plan's step time, memory and MFU would not hold; re-plan for this GPU with {fix}"
        )
    known_cc = found.capability != (0, 0)
    if here == gpu.name:
        if known_cc and planned_cc is not None and found.capability != planned_cc:
            raise UsageError(
                f"GPU 0 here reports the name of {gpu.name} but compute capability {_cc(found.capability)}, not "
                f"{gpu.name}'s {_cc(planned_cc)} ({found.describe()}): check the driver and CUDA install, or "
                "re-plan for this GPU"
            )
        return []
    if planned_cc is None:  # neither side is in the catalog: nothing to compare but memory
        return [f"GPU 0 here is {found.describe()}; the plan's {gpu.name} is not in the catalog, so only its "
                "memory is checked"]
    if known_cc and found.capability == planned_cc:
        return [f"GPU 0 here is {found.describe()}, which the catalog does not name; its compute capability is "
                f"{gpu.name}'s, so the plan runs as made for {expected_gpu(plan)} (MFU against that peak)"]
    raise UsageError(
        f"the plan expects {expected_gpu(plan)} but GPU 0 here is {found.describe()}, which the catalog does not "
        f"name and whose compute capability is not {_cc(planned_cc)}: re-plan with a cluster file describing this "
        "GPU (gpu = the nearest catalog GPU, gpu_memory_gib, gpu_bf16_tflops, ...; `meshplan topo list`)"
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

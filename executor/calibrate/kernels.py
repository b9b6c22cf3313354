"""Running the single-device benchmarks the way training ranks run: `ranks` at once when they share cores.

Two CPU ranks on a 2-core machine get one core each (the executor sets
OMP_NUM_THREADS = cores // ranks), share the memory bandwidth and the last
level cache, and on a shared host compete with everything else. Measured
alone on one idle thread a GEMM is up to twice as fast as the same GEMM in a
rank of a run. So on CPU `measure_kernels` starts one process per rank, each
with the executor's thread count, and runs every benchmark in all of them at
the same moment (a barrier before each); a sample is the median over the
processes. On GPUs each rank owns its device: one process measures, as
before, through the same steps and the same result format.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

Step = tuple[str, str, tuple]  # (benchmark kind, dtype, arguments)


def threads_per_rank(cores: int, ranks: int, omp_num_threads: str | None = None) -> int:
    """Threads the executor gives each CPU rank: OMP_NUM_THREADS when set, else cores // ranks, at least 1
    (executor.launch's rule)."""
    if omp_num_threads and omp_num_threads.strip().isdigit() and int(omp_num_threads) > 0:
        return int(omp_num_threads)
    return max(1, cores // max(ranks, 1))


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask: a taskset or a container's cpuset), else all."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _adamw_step_s(n_params: int, device) -> float:  # noqa: ANN001
    """One foreach AdamW step over n_params fp32 parameters in 8 tensors (the executor's optimizer)."""
    import torch

    from executor.calibrate.bench import time_call_s

    params = [torch.zeros(n_params // 8, device=device, requires_grad=True) for _ in range(8)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    return time_call_s(opt.step, device)


def _layer_overhead_s(device) -> float:  # noqa: ANN001
    """Forward time of one tiny executor block (8 tokens of the debug model): host-bound, the GPU work is nil."""
    import torch

    from executor.calibrate.bench import time_call_s
    from executor.model import Block, rope_tables
    from planner.model.load import load_model

    spec = load_model("debug")
    block = Block(spec).to(device)
    x = torch.randn(1, 8, spec.hidden, device=device)
    cos, sin = rope_tables(spec.head_dim, 8, device)
    with torch.no_grad():
        return time_call_s(lambda: block(x, cos, sin), device, min_reps=20)


def run_step(step: Step, device) -> float:  # noqa: ANN001
    """Seconds of one benchmark step on `device`."""
    from executor.calibrate.bench import bench_attention, bench_gemm, bench_memory

    kind, dtype, args = step
    if kind == "gemm":
        return bench_gemm(*args, dtype, device).time_s
    if kind == "attention":
        return bench_attention(*args, dtype, device).time_s
    if kind == "copy":
        return bench_memory(args[0], device).time_s
    if kind == "adamw":
        return _adamw_step_s(args[0], device)
    return _layer_overhead_s(device)


def _worker(steps: Sequence[Step], threads: int, barrier, queue, index: int) -> None:  # noqa: ANN001
    """One sharing rank: the executor's thread count, every step after a barrier with the others."""
    import torch

    torch.set_num_threads(threads)
    device = torch.device("cpu")
    times = []
    for i, step in enumerate(steps):
        barrier.wait()
        times.append(run_step(step, device))
        if index == 0:
            queue.put(("progress", i + 1))
    queue.put(("times", index, times))


def measure_kernels(steps: Sequence[Step], device_kind: str, ranks: int, threads: int,
                    on_progress: Callable[[int], None] | None = None) -> list[float]:
    """Seconds of every step: on CPU the median over `ranks` processes running it at once."""
    import torch

    if device_kind == "cuda" or ranks <= 1:
        device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
        if device_kind == "cpu":
            torch.set_num_threads(threads)
        out = []
        for i, step in enumerate(steps):
            out.append(run_step(step, device))
            if on_progress:
                on_progress(i + 1)
        return out
    import multiprocessing as mp

    from topologies.errors import ExecutionError

    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(list(steps), threads, barrier, queue, i), daemon=True)
             for i in range(ranks)]
    for p in procs:
        p.start()
    per_rank: dict[int, list[float]] = {}
    while len(per_rank) < ranks:
        try:
            message = queue.get(timeout=600)
        except Exception:  # queue.Empty: a worker died or hangs
            for p in procs:
                p.kill()
            raise ExecutionError(f"kernel benchmark with {ranks} sharing processes stopped answering "
                                 f"(exit codes {[p.exitcode for p in procs]})") from None
        if message[0] == "progress":
            if on_progress:
                on_progress(message[1])
        else:
            per_rank[message[1]] = message[2]
    for p in procs:
        p.join()
    return [statistics.median(per_rank[r][i] for r in range(ranks)) for i in range(len(steps))]


def samples_from_times(steps: Sequence[Step], times: Sequence[float]) -> tuple[dict[str, list], dict[str, Any]]:
    """({"gemm", "attention", "copy"} sample lists, {"adamw": (s, params), "layer_overhead_s": s})."""
    from executor.calibrate.bench import AttentionSample, GemmSample, MemorySample

    results: dict[str, list] = {"gemm": [], "attention": [], "copy": []}
    extra: dict[str, Any] = {}
    for (kind, dtype, args), t in zip(steps, times, strict=True):
        if kind == "gemm":
            results["gemm"].append(GemmSample(*args, dtype, t))
        elif kind == "attention":
            results["attention"].append(AttentionSample(*args, dtype, t))
        elif kind == "copy":
            results["copy"].append(MemorySample(args[0] // 4 * 4, t))
        elif kind == "adamw":
            extra["adamw"] = (t, args[0] // 8 * 8)
        else:
            extra["layer_overhead_s"] = t
    return results, extra

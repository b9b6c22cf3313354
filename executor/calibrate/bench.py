"""Single-device microbenchmarks for `meshplan calibrate`: GEMM, attention, memory bandwidth.

Each benchmark returns plain samples (shape, dtype, measured seconds); the
fitting step (`executor.calibrate.fit`) turns them into the planner's
efficiency parameters by asking the simulator's own time model to reproduce
them. FLOPs follow the planner's conventions so the two line up:

  GEMM [m, k] x [k, n]:        2 * m * n * k FLOPs
  causal attention, fwd+bwd:   7 * b * a * s^2 * d executed FLOPs: the forward's
                               QK^T and AV are 4*b*a*s^2*d, halved by the causal
                               mask; the backward is 2.5x the forward
                               (FlashAttention-2's count, as planner.simulate.compute uses)
  memory copy of N bytes:      2 * N bytes moved (read + write)

Timing: one warm-up call, then repeats until at least `min_reps` calls and
`min_time_s` seconds; the MEDIAN repeat is kept. The simulator predicts what a
training rank gets, and a rank shares its machine: with its peer ranks (two
ranks on two cores leave each one core, and `meshplan calibrate` runs one
benchmark process per rank at once to reproduce that), and on a shared host
with whatever else runs. The fastest repeat would describe an idle machine
that training never sees; the median is robust to one descheduled repeat.
On CUDA every timed call is bracketed by `torch.cuda.synchronize()`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class GemmSample:
    m: int
    n: int
    k: int
    dtype: str
    time_s: float

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


@dataclass(frozen=True)
class AttentionSample:
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    dtype: str
    time_s: float  # forward + backward of causal scaled_dot_product_attention

    @property
    def flops(self) -> float:
        return 7.0 * self.batch * self.heads * self.seq_len**2 * self.head_dim


@dataclass(frozen=True)
class MemorySample:
    size_bytes: int  # bytes of the source tensor; the copy moves twice this
    time_s: float

    @property
    def gbytes_per_s(self) -> float:
        return 2.0 * self.size_bytes / self.time_s / 1e9


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call_s(fn: Callable[[], Any], device: torch.device, min_reps: int = 7, min_time_s: float = 0.05,
                max_reps: int = 100) -> float:
    """Median wall time of fn() on device over the repeats, after one warm-up call."""
    fn()
    _synchronize(device)
    times: list[float] = []
    while len(times) < min_reps or (sum(times) < min_time_s and len(times) < max_reps):
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_gemm(m: int, n: int, k: int, dtype: str, device: torch.device) -> GemmSample:
    """Time one [m, k] x [k, n] matrix product into a preallocated output."""
    torch_dtype = TORCH_DTYPES[dtype]
    a = torch.randn(m, k, device=device, dtype=torch_dtype)
    b = torch.randn(k, n, device=device, dtype=torch_dtype)
    out = torch.empty(m, n, device=device, dtype=torch_dtype)
    return GemmSample(m, n, k, dtype, time_call_s(lambda: torch.mm(a, b, out=out), device))


def bench_attention(batch: int, heads: int, seq_len: int, head_dim: int, dtype: str,
                    device: torch.device) -> AttentionSample:
    """Time forward + backward of causal SDPA (the executor's attention kernel)."""
    torch_dtype = TORCH_DTYPES[dtype]
    shape = (batch, heads, seq_len, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=torch_dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=torch_dtype)

    def step() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    return AttentionSample(batch, heads, seq_len, head_dim, dtype, time_call_s(step, device))


def bench_memory(size_bytes: int, device: torch.device) -> MemorySample:
    """Time a device-to-device copy of size_bytes (a stand-in for memory-bound kernels)."""
    n = size_bytes // 4
    src = torch.ones(n, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    return MemorySample(n * 4, time_call_s(lambda: dst.copy_(src), device))

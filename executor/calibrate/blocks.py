"""One real executor block, timed plain, under TP and under FSDP: the host cost kernels do not show.

Kernel benchmarks price a layer's GEMMs, attention and elementwise passes; a
training step also pays Python and dispatch for every module and operator,
DTensor's redistributions under TP and FSDP2's hooks and copies around each
all-gather and reduce-scatter. Those are measured here, inside the
collective benchmark's torchrun ranks (`executor.calibrate.comm --block`), on
`executor.model.Block` at the plan's micro-batch and sequence length:

  plain       forward + backward of a local block, every rank at once
  plain_solo  the same on each rank alone in turn while the others wait in
              a gloo barrier (as a pipeline stage waits for its peer): the
              ratio is `solo_speedup`
  tp          the same block split by `block_tp_plan` over all ranks (DTensor)
  tp_ops      operators dispatched on DTensors per TP-split linear, forward
              and backward, counted in one untimed pass (`DTensorOpCounter`)
  fsdp        the block under fully_shard (ZeRO-3) inside a parameterless root,
              so it gathers in the forward and backward and reduce-scatters

`executor.calibrate.fit.fit_blocks` turns the times into the compute level,
`dtensor_op_overhead_s`, `fsdp_call_overhead_s` and `solo_speedup` by
subtracting what the simulator already prices for the same block.
"""

from __future__ import annotations

import statistics
import time
from typing import Any


def _timed_rounds(steps: dict[str, Any], reps: int, barrier, rank: int, world: int) -> dict[str, float]:  # noqa: ANN001
    """Median seconds of each step over `reps` rounds after one warm-up, on the slowest rank.

    A round runs every step once, in turn, each started together on all ranks;
    a "solo" step runs on each rank in turn while the others wait in `barrier`
    (as a pipeline stage waits for its peer). A burst of load from other jobs
    so falls on every kind of block alike and their ratios stay meaningful.
    The median is the statistic `meshplan report` takes of a run's steps; the
    slowest rank's, because a synchronous step waits for it (on a host where
    another job shares one core, the rank on that core).
    """
    import torch
    import torch.distributed as dist

    def once(name: str, step) -> float:  # noqa: ANN001
        solo = name.endswith("_solo")
        elapsed = 0.0
        for turn in range(world if solo else 1):
            barrier()
            start = time.perf_counter()
            if not solo or rank == turn:
                step()
                elapsed = time.perf_counter() - start
            barrier()  # the next step starts only when the solo rank is done
        return elapsed

    for name, step in steps.items():
        once(name, step)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            times[name].append(once(name, step))
    medians = torch.tensor([statistics.median(times[name]) for name in steps], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(steps, medians.tolist(), strict=True))


def dtensor_op_counter():  # noqa: ANN201
    """A TorchDispatchMode counting the operators dispatched with a DTensor among their arguments (.count).

    The mode sees every aten operator before the DTensor subclass handles it;
    the operators DTensor then runs on its local shards happen inside the
    mode's handler and are not counted twice.
    """
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class DTensorOpCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.count += any(issubclass(t, DTensor) for t in types)
            return func(*args, **(kwargs or {}))

    return DTensorOpCounter()


def count_dtensor_ops(module, x, grad, cos, sin) -> tuple[int, int]:  # noqa: ANN001
    """(forward, backward) DTensor operators of one pass of `module` (`dtensor_op_counter`)."""
    with dtensor_op_counter() as forward:
        out = module(x, cos, sin)
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
    with dtensor_op_counter() as backward:
        out.backward(grad)
    for p in module.parameters():
        p.grad = None
    return forward.count, backward.count


def time_blocks(model_path: str, micro_batch: int, seq_len: int, reps: int, world: int) -> dict[str, Any]:
    """{"plain": s, "plain_solo": s, "tp": s or None, "tp_ops": [fwd, bwd] or None, "fsdp": s, ...}
    for one block on this rank (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from executor.model import Block, rope_tables
    from executor.parallel.parallelize import block_tp_plan
    from planner.model.load import load_model

    spec = load_model(model_path)
    torch.manual_seed(0)
    x = torch.randn(micro_batch, seq_len, spec.hidden)
    grad = torch.randn(micro_batch, seq_len, spec.hidden)
    cos, sin = rope_tables(spec.head_dim, seq_len, "cpu")

    def run(module: nn.Module) -> Any:
        def step() -> None:
            out = module(x, cos, sin)
            out = out.full_tensor() if hasattr(out, "full_tensor") else out
            out.backward(grad)
            for p in module.parameters():
                p.grad = None
        return step

    out: dict[str, Any] = {"micro_batch": micro_batch, "seq_len": seq_len, "model": spec.name, "world": world}
    plain = Block(spec)
    steps = {"plain": run(plain), "plain_solo": run(plain)}
    mesh = init_device_mesh("cpu", (world,))
    out["tp"] = out["tp_ops"] = None
    if spec.n_heads % world == 0 and spec.n_kv_heads % world == 0:
        block = Block(spec)
        tp_plan = block_tp_plan(block, False)
        parallelize_module(block, mesh, tp_plan)
        steps["tp"] = run(block)
        ops = count_dtensor_ops(block, x, grad, cos, sin)
        out["tp_ops"] = [ops[0] / len(tp_plan), ops[1] / len(tp_plan)]

    class Root(nn.Module):  # no parameters of its own: the block stays a non-root FSDP unit
        def __init__(self) -> None:
            super().__init__()
            self.block = Block(spec)

        def forward(self, x, cos, sin):  # noqa: ANN001, ANN202
            return self.block(x, cos, sin)

    root = Root()
    fully_shard(root.block, mesh=mesh, reshard_after_forward=True)
    fully_shard(root, mesh=mesh, reshard_after_forward=True)
    steps["fsdp"] = run(root)
    out.update(_timed_rounds(steps, reps, dist.barrier, dist.get_rank(), world))
    return out

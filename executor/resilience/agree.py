"""Ranks that agree: rank 0 decides or acts, every rank learns the outcome, so no rank raises alone and
leaves its peers waiting in a collective. World of 1 (or no process group): plain local calls.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from topologies.errors import ExecutionError, NonFiniteError


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world() -> int:
    return dist.get_world_size() if distributed() else 1


def barrier() -> None:
    if distributed():
        dist.barrier()


def broadcast(obj: Any) -> Any:
    """Rank 0's value on every rank (our own objects, never read from disk)."""
    if not distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(obj: Any) -> list[Any]:
    """Every rank's value, in rank order, on every rank (our own objects, never read from disk)."""
    if not distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def on_rank0(fn) -> str | None:
    """Run fn on rank 0 only; its OSError becomes a message instead of an exception."""
    if rank() != 0:
        return None
    try:
        fn()
    except OSError as exc:
        return f"{exc.strerror or exc} ({exc.filename or ''})"
    return None


def agree(error: str | None, what: str) -> None:
    """Every rank learns rank 0's outcome, so a failure there raises everywhere instead of hanging."""
    error = broadcast(error)
    if error:
        raise ExecutionError(f"{what}: {error}")


def flag_device() -> torch.device:
    """Where a collective's small tensor lives: the current GPU under NCCL, else the host."""
    if distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def refuse_non_finite(state: dict[str, Any], step: int) -> None:
    """Raise NonFiniteError on every rank when any rank's state holds a NaN or infinity (one all-reduce).

    The last line of defence of "no checkpoint with non-finite values": the
    training loop skips updates whose loss or gradient norm is not finite, so
    this finds only what slipped past it. The keys are named (first few).
    """
    from torch.distributed.tensor import DTensor

    tensors = []
    for part in ("model", "optim"):
        for key, value in _flat(state.get(part, {}), part):
            local = value.to_local() if isinstance(value, DTensor) else value
            if isinstance(local, torch.Tensor) and local.is_floating_point() and local.numel():
                tensors.append((key, local))
    device = flag_device()
    bad = torch.zeros((), dtype=torch.int32, device=device)
    if tensors:
        flags = torch.stack([(~torch.isfinite(t)).any().to(device) for _, t in tensors])
        bad += flags.any().int()
    if distributed():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if not bad.item():
        return
    mine = [key for key, t in tensors if not torch.isfinite(t).all()]
    names = sorted({k for keys in all_gather(mine[:5]) for k in keys})
    raise NonFiniteError(f"not saving checkpoint step-{step}: the state holds NaN or infinite values "
                         f"({', '.join(names[:5])}{' ...' if len(names) > 5 else ''}); the last checkpoint stays "
                         "the latest; resume from it with a lower --lr")


def _flat(obj: Any, prefix: str):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _flat(value, f"{prefix}.{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _flat(value, f"{prefix}.{i}")
    else:
        yield prefix, obj

"""CheckpointManager across layouts on 2 gloo ranks (torch.multiprocessing), against one process.

A toy MLP is trained under layout A (ZeRO-1, FSDP2 or TP), checkpointed at
step 2, then a *differently initialised* model under layout B loads the
checkpoint and trains to step 5. The reference is the same model trained
without interruption in this process on the full batch: data-parallel ranks
average gradients of equal halves, so every layout computes the same step
up to fp32 summation order. Losses and final parameters must agree.
"""

from __future__ import annotations

import gc
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from executor.components.checkpoint import CheckpointManager

WORLD, BATCH, SAVE_AT, LAST = 2, 6, 2, 5


class Train:
    """TrainState stand-in: step and a warm-up LR schedule (so the LR must survive the resume)."""

    def __init__(self, optim) -> None:
        self.step = 0
        self.sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 4))

    def state_dict(self) -> dict:
        return {"step": self.step, "sched": self.sched.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]
        self.sched.load_state_dict(sd["sched"])


def toy(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batch(step: int) -> torch.Tensor:
    return torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(1000 + step))


def adamw(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def build(layout: str, seed: int):
    """(model, optimizer, this rank's slice of the batch) for a layout on the 2-rank world."""
    from torch.distributed.device_mesh import init_device_mesh

    model, rank = toy(seed), dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    half = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    if layout == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        return model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05, weight_decay=0.1), half
    if layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
        return model, adamw(model.parameters()), half
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, adamw(model.parameters()), slice(0, BATCH)


def run(model, optim, state: Train, rows: slice, until: int, mgr=None) -> list[float]:
    """Train to `until`; returns the global-batch loss of each step (mean over data-parallel ranks)."""
    losses = []
    while state.step < until:
        loss = model(batch(state.step + 1)[rows]).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        state.sched.step()
        state.step += 1
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / WORLD)
        if mgr and state.step == SAVE_AT:
            mgr.save(state.step, {"model": model, "optim": optim, "train": state})
    return losses


PAIRS = [("zero1", "fsdp"), ("fsdp", "tp"), ("tp", "zero1")]


def worker(rank: int, port: int, out: str) -> None:
    """All pairs in one spawn: starting processes costs more than the training."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    for src, dst in PAIRS:
        mgr = CheckpointManager(f"{out}/{src}-{dst}")
        model, optim, rows = build(src, seed=0)
        run(model, optim, Train(optim), rows, SAVE_AT + 1, mgr)  # step 3 is lost: not in the checkpoint
        model, optim, rows = build(dst, seed=7)
        state = Train(optim)
        assert mgr.load_latest({"model": model, "optim": optim, "train": state}) == SAVE_AT
        losses = run(model, optim, state, rows, LAST)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        if rank == 0:
            result = {"losses": losses, "params": {k: v.detach().clone() for k, v in full.items()}}
            torch.save(result, f"{out}/{src}-{dst}/result.pt")
    # Free FSDP/DDP state while its groups exist and let every rank arrive before the
    # teardown: a rank leaving while its peer still talks aborts in gloo's threads.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = toy(0)
    optim = adamw(model.parameters())
    state, losses = Train(optim), []
    while state.step < LAST:
        loss = model(batch(state.step + 1)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        state.sched.step()
        state.step += 1
        losses.append(loss.item())
    return losses, model.state_dict()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("reshard")
    mp.spawn(worker, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    return out


@pytest.mark.parametrize("src,dst", PAIRS)
def test_checkpoint_moves_between_layouts(results, src, dst):
    got = torch.load(results / f"{src}-{dst}" / "result.pt", weights_only=True)
    ref_losses, ref_params = reference()
    torch.testing.assert_close(got["losses"], ref_losses[SAVE_AT:], rtol=1e-5, atol=0)
    assert got["params"].keys() == ref_params.keys()
    for key, value in ref_params.items():
        torch.testing.assert_close(got["params"][key], value, rtol=1e-5, atol=1e-6, msg=key)

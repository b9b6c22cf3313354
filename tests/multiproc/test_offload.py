"""Parameter offload (Layout.offload "optimizer+params", FSDP2's CPUOffloadPolicy) trains the same model.

On CPU ranks the host is the device, so the policy moves no bytes; what it
changes still runs: FSDP2 keeps each unit's sharded parameters as host
tensors of the policy (`FSDPParam.offload_to_cpu`), moves each reduced
gradient shard to the host (accumulating there across micro-batches), and the
optimizer steps over the host shards. `test_policy_applied` shows the
executor really applies the policy to every unit on CPU ranks (pinning needs
an accelerator, so CPU ranks run it unpinned); the end-to-end test runs
`meshplan plan --offload params` and `meshplan execute` on 4 gloo ranks with
two micro-batches per step, against the same layout without offload and
against the single-process reference of test_executor_determinism.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_executor_determinism import RTOL, SEED, STEPS, reference_run
from torchrun_util import execute, make_plan

PINS = ("--dp-shard", "4", "--zero", "3", "--micro-batch", "1")


def _probe(rank: int, world: int, port: int, plan_path: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        from executor.model import build_model
        from executor.parallel.mesh import build_mesh
        from executor.parallel.parallelize import parallelize
        from planner.plan import load_plan

        plan = load_plan(plan_path)
        mesh = build_mesh(plan, "cpu")
        parts = parallelize(build_model(plan.model), plan, mesh, torch.device("cpu"), seed=SEED).parts
        policies, offloaded = [], []
        for unit in (m for part in parts for m in part.modules() if hasattr(m, "_get_fsdp_state")):
            group = unit._get_fsdp_state()._fsdp_param_group
            if group is not None:
                policies.append(type(group.offload_policy).__name__)
                offloaded += [p.offload_to_cpu for p in group.fsdp_params]
        if rank == 0:
            out["policies"], out["offloaded"] = policies, offloaded
    finally:
        dist.destroy_process_group()


def test_policy_applied(tmp_path):
    """Every FSDP unit the executor builds for an offload plan carries CPUOffloadPolicy and offloads its
    parameters (on CPU ranks too); the plan without offload gets none."""
    for flags, policy in (((), "OffloadPolicy"), (("--offload", "params"), "CPUOffloadPolicy")):
        plan = make_plan(tmp_path, f"fsdp2{'_offload' if flags else ''}", "--dp-shard", "2", "--zero", "3",
                         *flags, gpus=2)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = mp.Manager().dict()
        mp.spawn(_probe, args=(2, port, str(plan), out), nprocs=2, join=True)
        assert len(out["policies"]) >= 3  # embeddings, every block, norm + output
        assert set(out["policies"]) == {policy}
        assert all(out["offloaded"]) == bool(flags) and any(out["offloaded"]) == bool(flags)


def test_offload_matches_no_offload_and_single_process(tmp_path):
    plain = make_plan(tmp_path, "fsdp4", *PINS)
    offload = make_plan(tmp_path, "fsdp4_offload", *PINS, "--offload", "params")
    from planner.plan import load_plan

    assert load_plan(offload).layout.offload == "optimizer+params"
    assert load_plan(offload).prediction.extra["offload"]["host_memory_per_node_bytes"] > 0
    want = execute(plain, tmp_path / "plain", "--seed", str(SEED), steps=STEPS)
    got = execute(offload, tmp_path / "offload", "--seed", str(SEED), steps=STEPS)
    ref = reference_run("debug")
    assert load_plan(offload).layout.grad_accum_steps == 2  # gradients accumulate on the host shard
    for g, w, r in zip(got, want, ref, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-6), g["step"]
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-6), g["step"]
        assert g["loss"] == pytest.approx(r["loss"], rel=RTOL), g["step"]
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=RTOL), g["step"]

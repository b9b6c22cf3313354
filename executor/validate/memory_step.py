"""One tracked training step of one rank under a fake process group and FakeTensorMode.

`tracked_peak(plan, rank)` returns PyTorch's tracker's peak snapshot
(category -> bytes, plus "Total") for that rank; `executor.validate.memory`
explains what is compared and why. What this module adapts, and why each is
faithful to a real run:

* DDP (ZeRO-0/1 without TP) was written for real tensors: its constructor's
  cross-rank shape check reads tensor data, so it is skipped (one process
  cannot disagree with itself); the fake group's all-reduce returns no
  tensor, so a communication hook does locally what DDP's default hook does
  to the bucket (divide it by the group size, in place) and hands it back.
  Its C++ reducer allocates the gradient buckets at construction, outside any
  dispatch mode; the tracker first sees a bucket's storage when the reducer
  copies a gradient into it. DDP rebuilds its buckets after its first
  iteration, which needs real data, so exactly one DDP iteration runs (hence
  the optimizer state is created beforehand, see below), and in that first
  iteration DDP keeps ALL gradients in ONE bucket (torch 2.13: bucketing
  starts at the rebuild), which the first gradient of the backward touches.
  So a same-size stand-in is registered before the step and dropped when the
  module's backward starts: it counts through the forward and the loss
  backward, the real bucket from the first parameter gradient on (between
  the two, only the last block's input-gradient work runs). With
  `gradient_as_bucket_view` the gradients ARE the buckets: no stand-in.
* The optimizer's state appears at its first step. A zero-gradient step
  before tracking creates it, so the tracked step is a steady-state one:
  parameters and optimizer state live, gradients freed (set to None) as
  `zero_grad` leaves them.
* Device meshes are built with fake mode paused (`_real_device_meshes`), and
  DDP models with fake CPU tensors rather than on meta (`_fake_model`).
* RMSNorm saves what CUDA's fused kernel saves, not what the CPU composite
  saves (`_CudaFusedRMSNorm`): the fake world is CPU, the plan is for GPUs.
* Pipeline plans run their rank's stages in torch's schedule order (1F1B,
  interleaved 1F1B) without torch.distributed.pipelining, which exchanges
  real shapes and votes between stages before its first step
  (executor.validate.memory_pipeline).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from planner.plan import Plan
from topologies.errors import PlanError

MAX_MICRO_BATCHES = 2  # the 2nd carries the 1st's accumulated gradients, as every later one does


def _ddp_hook(group_size, bucket):  # noqa: ANN001, ANN201 - DDP checks annotations at run time; strings fail
    """DDP's default all-reduce hook minus the communication: divide the bucket in place."""
    buffer = bucket.buffer()
    buffer.div_(group_size)
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def _instrument_ddp(ddp, group, tracker) -> dict:  # noqa: ANN001
    """The stand-in communication hook, and bucket stand-ins that leave when the backward starts."""
    stand_ins: dict[int, torch.Tensor] = {}
    if not ddp.gradient_as_bucket_view:
        stand_ins = {b.index(): b.buffer() for b in ddp.reducer._get_zeros_like_grad_buckets()}
        tracker.track_external(*stand_ins.values())
        ddp.module.register_full_backward_pre_hook(lambda module, grad_output: stand_ins.clear())
    ddp.register_comm_hook(group.size(), _ddp_hook)
    return stand_ins


def _fake_model(plan: Plan) -> torch.nn.Module:
    """The executor's model, built inside FakeTensorMode: on meta when FSDP2 will shard it, else on CPU.

    FSDP2 (and its replicate) materialize their sharded parameters themselves
    (`init_weights` -> to_empty). A plain module on meta would be materialized
    by Module.to_empty, which swaps tensors, and FakeTensorMode's weak
    references forbid swapping: so DDP plans build with fake CPU tensors, the
    rope tables the model keeps on meta materialized by assignment.
    """
    from executor.model import build_model

    if plan.layout.dp > 1 and (plan.layout.zero_stage >= 2 or plan.layout.tp > 1):
        return build_model(plan.model, "meta")
    model = build_model(plan.model, "cpu")
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.empty_like(buf, device="cpu")
    return model


def _prime_optimizers(optimizers: list, parts: list) -> None:  # noqa: ANN001
    """One step on zero gradients: the optimizer state exists before the tracked step, as in training."""
    for part in parts:
        for p in part.parameters():
            p.grad = torch.zeros_like(p)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _train_step(plan: Plan, pm, optimizers: list, mesh, tokens: torch.Tensor, tracker,  # noqa: ANN001
                dtype: torch.dtype = torch.float32) -> None:
    """The executor's own step (executor.train / executor.components.optim): micro-steps, clipping, AdamW.

    Pipeline plans run their rank's stages in torch's schedule order (executor.validate.memory_pipeline).

    Clipping keeps the norm on the device (no value read back), so it runs
    under fake tensors like the rest of the step; a data-dependent read,
    should one appear, ends the clip there and the step goes on.
    """
    from torch._subclasses.fake_tensor import DataDependentOutputException

    from executor.components.optim import clip_grad_norm, unique_params
    from executor.train import AccumulationStep

    n = min(plan.layout.grad_accum_steps, MAX_MICRO_BATCHES)

    def next_micro_batch(i: int) -> None:
        # The trackers refuse a module's second forward in one session; their
        # module stats reset between micro-batches, the peak snapshot stays.
        if i:
            tracker.reset_mod_stats()

    if plan.layout.pp > 1:
        from executor.validate.memory_pipeline import pipeline_micro_steps

        def forget(stage: torch.nn.Module) -> None:
            for module in stage.modules():
                tracker.memory_tracking.pop(module, None)

        pipeline_micro_steps(plan, pm, mesh, tokens, dtype, forget)
    else:
        AccumulationStep(pm, n, torch.device("cpu"), before_micro_batch=next_micro_batch)(tokens, tokens)
    with contextlib.suppress(DataDependentOutputException):
        clip_grad_norm(unique_params(pm.parts), plan.layout.pp)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if pm.float8_all_gather:  # fp8 under FSDP2: executor.train's post-optimizer hook
        from executor.components.float8 import precompute_scales

        precompute_scales(pm.parts)


class _CudaFusedRMSNorm(torch.autograd.Function):
    """Memory stand-in of CUDA's fused RMSNorm kernel, for FakeTensorMode only (values are never read).

    On a GPU, F.rms_norm runs one fused kernel that saves its input and the
    fp32 1/rms per token and allocates only its outputs; the CPU build runs a
    composite that saves two fp32 copies of the input (8 bytes per element
    against 2 in bf16, per norm). The fake world is CPU, so this Function
    allocates and saves exactly what the CUDA kernel does.
    """

    @staticmethod
    def forward(ctx, x, weight, eps):  # noqa: ANN001, ANN205
        rstd = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), (torch.empty_like(weight) if weight is not None else None), None


def _cuda_rms_norm(x, normalized_shape, weight=None, eps=None):  # noqa: ANN001, ANN202
    return _CudaFusedRMSNorm.apply(x, weight, eps)


def _outside_fake_mode(fn):  # noqa: ANN001, ANN202
    """fn run with FakeTensorMode paused."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def run(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return run


@contextlib.contextmanager
def plan_dtype_on_cpu(plan: Plan):
    """Let the executor build a GPU plan's compute dtype on the fake CPU world.

    `executor.parallel.parallelize.compute_dtype` runs CPU ranks in fp32 (real CPU
    kernels); under FakeTensorMode nothing executes, so the plan's own dtype
    (bf16 mixed precision, autocast) is what must be tracked.
    """
    import torch

    import executor.parallel.parallelize as parallelize_module

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[plan.training.dtype]
    with mock.patch.object(parallelize_module, "compute_dtype", lambda plan, device: dtype):
        yield dtype


@contextlib.contextmanager
def _real_device_meshes():
    """DeviceMeshes are built with fake mode paused: their rank tables are real integers that get indexed.

    fully_shard on TP parameters concatenates the (dp, tp) meshes while it
    shards, i.e. inside the fake region; a fake rank table has no values.
    """
    from torch.distributed.device_mesh import DeviceMesh

    from executor.parallel.expert import ExpertParallel

    # expert parallelism carves its groups from the mesh's rank table the same way
    with mock.patch.object(DeviceMesh, "__init__", _outside_fake_mode(DeviceMesh.__init__)), \
            mock.patch.object(ExpertParallel, "__init__", _outside_fake_mode(ExpertParallel.__init__)):
        yield


@contextlib.contextmanager
def _sharding_propagation_apart():
    """DTensor's sharding propagation runs in a FakeTensorMode of its own, as it does in a real run.

    To learn an op's output shape DTensor runs the op once on fake tensors of the GLOBAL shapes
    (ShardingPropagator._propagate_tensor_meta_non_cached, cached per op schema). It reuses the fake mode
    already active, and here that is the harness's own: the tracker, which skips only ops of another fake
    mode than the one it entered under, would count those global tensors, tp times the local ones, as this
    rank's memory. At the loss backward of a vocabulary-parallel loss that is 4 B x tp per local logit on
    top of the real peak (tp 4: +0.98 GiB, -12% error, on Llama 3 8B at TP 4 x FSDP 16). Without an active
    fake mode it makes its own, which the tracker then skips.
    """
    import torch.distributed.tensor._sharding_prop as sharding_prop

    with mock.patch.object(sharding_prop, "detect_fake_mode", lambda *args: None):
        yield


@contextlib.contextmanager
def _quiet_known_warnings():
    """Silence warnings this harness causes by design (they would read as problems of the plan)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")  # stand-in retirement hook
        warnings.filterwarnings("ignore", message=".*returned a view tensor")  # FSDP2 on the fake root output
        yield


@contextlib.contextmanager
def _balanced_routing():
    """MoE routing with every expert given an equal share of the rows, as the memory model assumes.

    The router's counts decide shapes (`MoE.expert_counts`, `ExpertGroup.split_sizes`), and fake tensors
    have no values: each expert gets an equal share of the routed rows, and every ep rank is taken to send
    this rank what it receives from it.
    """
    from executor.moe import MoE
    from executor.parallel.expert import ExpertGroup

    def balanced(rows: int, experts: int) -> list[int]:
        return [rows // experts + (e < rows % experts) for e in range(experts)]

    def counts(self, flat: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        if self.ep is not None:  # the layer's routed rows, for its dispatch below
            self.ep.routed_rows = flat.numel()
        return torch.tensor(balanced(flat.numel(), self.n_experts))

    def split_sizes(self, counts: torch.Tensor):  # noqa: ANN001, ANN202
        # every ep rank routes alike, so this rank receives from each what it sends to each
        per_expert = balanced(self.routed_rows, self.size * self.local_experts)
        per_rank = [per_expert[r * self.local_experts:(r + 1) * self.local_experts] for r in range(self.size)]
        mine = per_rank[0]
        return [sum(p) for p in per_rank], [sum(mine)] * self.size, torch.tensor([mine] * self.size)

    with mock.patch.object(MoE, "expert_counts", counts), mock.patch.object(ExpertGroup, "split_sizes", split_sizes):
        yield


@contextlib.contextmanager
def _stages_built_afresh(plan: Plan):
    """executor.parallel.pipeline.split_stage deep-copies the model per stage; a deep copy of fake tensors
    lands in another fake mode, so each stage starts from a freshly built model instead (same modules)."""
    import types

    import executor.parallel.pipeline as pipeline_module

    fresh = types.SimpleNamespace(deepcopy=lambda model: _fake_model(plan))
    with mock.patch.object(pipeline_module, "copy", fresh):
        yield


def _peak_snapshot(tracker) -> dict[str, int]:  # noqa: ANN001
    """The tracker's peak snapshot summed over devices, keyed by category name."""
    out: dict[str, int] = {}
    for dev_snap in tracker.get_tracker_snapshot("peak").values():
        for key, value in dev_snap.items():
            name = getattr(key, "value", key)
            out[name] = out.get(name, 0) + int(value)
    return out


def tracked_peak(plan: Plan, rank: int, on_phase=None) -> dict[str, int]:
    """PyTorch's tracker's peak for `rank` over one steady-state step of the plan (see module docstring).

    on_phase(text), when given, hears what the rank is doing: building its model, tracking its step.
    """
    on_phase = on_phase or (lambda text: None)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from executor.components.optim import build_optimizers
    from executor.parallel.context import shard_sequence
    from executor.parallel.mesh import build_mesh, grad_flat
    from executor.parallel.parallelize import parallelize

    if plan.layout.pp > 1:
        from executor.validate.memory_pipeline import check_emulated

        check_emulated(plan)
    if plan.model.moe is not None and plan.training.dtype != "bf16":
        raise PlanError(
            f"validate-memory traces MoE experts in bf16 only (plan dtype {plan.training.dtype}): torch's meta "
            "function of the experts' grouped GEMM (torch._grouped_mm) takes bf16, and fake tensors have no "
            "counts to run them one expert at a time; check the plan made with --precision bf16, or measure with "
            "`meshplan execute`"
        )
    dist.init_process_group("fake", rank=rank, world_size=plan.world_size, store=FakeStore())
    try:
        mesh = build_mesh(plan, "cpu")  # outside FakeTensorMode: meshes hold real rank tensors
        skip_check = mock.patch("torch.nn.parallel.distributed._verify_param_shape_across_processes")
        gpu_rms_norm = mock.patch("torch.nn.functional.rms_norm", _cuda_rms_norm)
        with FakeTensorMode(), plan_dtype_on_cpu(plan) as dtype, skip_check, _real_device_meshes(), gpu_rms_norm, \
                _balanced_routing(), _stages_built_afresh(plan), _sharding_propagation_apart():
            on_phase("building and parallelizing the model under FakeTensorMode")
            pm = parallelize(_fake_model(plan), plan, mesh, torch.device("cpu"))
            optimizers = build_optimizers(pm.parts, plan, mesh, lr=1e-4)
            _prime_optimizers(optimizers, pm.parts)
            n_micro = plan.layout.grad_accum_steps if plan.layout.pp > 1 else \
                min(plan.layout.grad_accum_steps, MAX_MICRO_BATCHES)
            shape = (plan.layout.micro_batch_size * n_micro, plan.training.seq_len)
            tokens = torch.randint(0, plan.model.vocab, shape)
            if pm.cp is not None:  # this rank's load-balanced chunks, as executor.train does
                tokens = shard_sequence(tokens, pm.cp)
            if pm.dp_kind == "fsdp":
                tracker = FSDPMemTracker(pm.parts[0], optimizers[0])
                tracker.track_inputs((tokens,))

            else:
                tracker = MemTracker()
                # ZeroRedundancyOptimizer keeps its shard's state in the wrapped local optimizer
                tracker.track_external(*pm.parts, *(getattr(o, "optim", o) for o in optimizers))
            stand_ins = _instrument_ddp(pm.runners[0], grad_flat(mesh).get_group(), tracker) if pm.dp_kind == "ddp" else {}
            on_phase("tracking one training step")
            with tracker, _quiet_known_warnings():
                _train_step(plan, pm, optimizers, mesh, tokens, tracker, dtype)
            del stand_ins  # the bucket stand-ins were alive until the backward started
            return _peak_snapshot(tracker)
    finally:
        dist.destroy_process_group()

"""The per-layer activation formulas against what PyTorch autograd really saves.

Reference: torch.autograd.graph.saved_tensors_hooks sees every tensor the
executor's own Block (executor/model.py) keeps for its backward; the sum of
their distinct storages, parameters excluded, is the layer's activation
memory. LayerNorm is used because its CPU kernel is fused like the GPU norms
the model assumes (CPU RMSNorm is a composite that saves extra fp32 copies).
What the formulas leave out (rotary cos/sin tables, per-token norm
statistics) is under 3% here.
"""

from __future__ import annotations

import pytest
import torch  # noqa: E402

from executor.model import Block, rope_tables  # noqa: E402
from planner.memory.activations import (  # noqa: E402
    layer_activation_bytes,
    layer_activation_terms,
    rope_table_bytes,
)
from planner.model.spec import ModelSpec  # noqa: E402

SEQ, BATCH = 256, 2


def _spec(mlp: str) -> ModelSpec:
    return ModelSpec(name="probe", n_layers=1, hidden=512, n_heads=8, n_kv_heads=2, head_dim=64,
                     ffn_hidden=1408, vocab=1000, max_seq_len=512, norm="layernorm", mlp=mlp)


def _saved_bytes(spec: ModelSpec, dtype, recompute: str) -> int:
    block = Block(spec).to(dtype)
    block.full_recompute = recompute == "full"
    block.attention.selective_recompute = recompute == "selective"
    x = torch.randn(BATCH, SEQ, spec.hidden, dtype=dtype, requires_grad=True)
    cos, sin = rope_tables(spec.head_dim, SEQ, "cpu")
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, cos, sin)
    return sum(storages.values())


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
@pytest.mark.parametrize("dtype,nbytes", [("float32", 4), ("bfloat16", 2)])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_layer_formula_matches_autograd_saved_tensors(mlp, dtype, nbytes, recompute):
    spec = _spec(mlp)
    terms = layer_activation_terms(spec, SEQ, BATCH, dtype_bytes=nbytes, fused_attention=True)
    kept, _ = layer_activation_bytes(terms, recompute)
    measured = _saved_bytes(spec, getattr(torch, dtype), recompute)
    if recompute == "full":  # the block input, plus the rotary tables the checkpoint keeps
        assert kept <= measured <= kept + 4 * SEQ * spec.head_dim * nbytes
    else:
        assert measured == pytest.approx(kept, rel=0.03)


def test_autocast_block_saves_fp32_norm_inputs_separate_casts_and_weight_copies():
    """meshplan's DDP path: fp32 Block under torch.autocast(bf16), the model's `autocast` accounting.

    Saved: the layer terms with autocast (fp32 norm inputs, a bf16 copy of the
    norm output per projection), autocast's bf16 weight copies of every matrix
    (planner.memory.estimate ModelStates.compute_copy) and RoPE's 4 bf16 slices of s rows.
    """
    spec = _spec("swiglu")
    block = Block(spec)
    x = torch.randn(BATCH, SEQ, spec.hidden, requires_grad=True)
    cos, sin = rope_tables(spec.head_dim, SEQ, "cpu")
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() != x.untyped_storage().data_ptr():
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, cos, sin)
    terms = layer_activation_terms(spec, SEQ, BATCH, dtype_bytes=2, fused_attention=True, autocast=True)
    kept, _ = layer_activation_bytes(terms, "none")
    matrices = sum(p.numel() for p in block.parameters() if p.ndim == 2)
    expected = kept - terms["norm1_input"] + 2 * matrices + rope_table_bytes(spec, SEQ, 2, cast_block_inputs=False, recompute="none")
    assert sum(storages.values()) == pytest.approx(expected, rel=0.01)  # the block input x is the caller's


@pytest.mark.parametrize("name", ["llama3.2-1b", "debug-gpt"])
def test_zero1_worst_rank_matches_zero_redundancy_optimizer(name):
    """torch's own partition of the executor's parameter groups (matrices, then 1-D), whole tensors."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from executor.model import build_model
    from planner.layout import Layout
    from planner.memory.params import stage_params, zero1_rank_params
    from planner.model.load import load_model

    spec, world = load_model(name), 16
    params = list(dict.fromkeys(build_model(spec, "meta").parameters()))  # tied ones once
    groups = [{"params": [p for p in params if p.ndim >= 2]}, {"params": [p for p in params if p.ndim < 2]}]
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        zero = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW)
        loads = [sum(p.numel() for g in rank for p in g["params"]) for rank in zero._partition_parameters()]
    finally:
        dist.destroy_process_group()
    sp = stage_params(spec, Layout(dp_shard=world, zero_stage=1), 0)
    assert zero1_rank_params(spec, 1, sp, world, tied_vocab_parallel=False) == max(loads)
    assert sum(loads) == sp.total


def _loss_bytes_per_logit(tp: int) -> tuple[float, float]:
    """(alive at the loss backward's start, peak during it) per local logit, for torchtitan's loss_fn
    (cross_entropy of the bf16 logits cast to fp32, the logits dropped before backward), through DTensor's
    loss_parallel over a fake tp group when tp > 1; the CPU allocator's events as the profiler logs them."""
    import contextlib

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.testing._internal.distributed.fake_pg import FakeStore

    tokens, hidden, vocab = 2048, 32, 4096
    head = torch.nn.Linear(hidden, vocab, bias=False, dtype=torch.bfloat16)
    x = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, vocab, (1, tokens))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        if tp > 1:
            parallelize_module(head, init_device_mesh("cpu", (tp,)),
                               ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                               use_local_output=False))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with loss_parallel() if tp > 1 else contextlib.nullcontext():
                pred = head(x)
                loss = F.cross_entropy(pred.flatten(0, 1).float(), y.flatten(0, 1))
                del pred
                with record_function("loss_backward"):
                    loss.backward()
    finally:
        dist.destroy_process_group()
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    start = next(e.start_ns() for e in events if e.name() == "loss_backward")
    alive, at_start, peak = 0, 0, 0
    for e in events:
        if e.name() != "[memory]":
            continue
        alive += e.nbytes()
        if e.start_ns() < start:
            at_start = alive
        else:
            peak = max(peak, alive)
    local = tokens * vocab / tp
    return at_start / local, peak / local


@pytest.mark.parametrize("tp", [1, 2])
def test_loss_backward_bytes_per_logit_match_torch(tp):
    """aten's log_softmax + nll_loss backward holds 8 B per logit beside the saved 4 B; DTensor's
    loss_parallel fuses the two into one step that holds 12 B (torchtitan under TP)."""
    from planner.memory.activations import (
        LOGIT_LOSS_PARALLEL_TRANSIENT_BYTES,
        LOGIT_SAVED_BYTES,
        LOGIT_TRANSIENT_BYTES,
    )

    at_start, peak = _loss_bytes_per_logit(tp)
    transient = LOGIT_LOSS_PARALLEL_TRANSIENT_BYTES if tp > 1 else LOGIT_TRANSIENT_BYTES
    assert at_start == pytest.approx(LOGIT_SAVED_BYTES, abs=0.1)
    assert peak == pytest.approx(LOGIT_SAVED_BYTES + transient, abs=0.1)


def test_compiled_loss_keeps_two_bytes_per_logit_and_writes_two():
    """torchtitan's loss under torch.compile (inductor on CPU here): the bf16 logits saved, a bf16 gradient
    made in the backward; the constants planner.memory.estimate uses for the "compile" fused loss (mechanisms.Loss)."""
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile, record_function

    def loss_fn(pred, labels):
        return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))

    tokens, vocab = 1024, 4096
    compiled = torch.compile(loss_fn)
    w = torch.randn(32, vocab, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(1, tokens, 32, dtype=torch.bfloat16)
    y = torch.randint(0, vocab, (1, tokens))
    compiled(x @ w, y).backward()  # compile outside the measured step
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        pred = x @ w
        loss = compiled(pred, y)
        del pred
        with record_function("loss_backward"):
            loss.backward()
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    start = next(e.start_ns() for e in events if e.name() == "loss_backward")
    alive, at_start, peak = 0, 0, 0
    for e in events:
        if e.name() == "[memory]":
            alive += e.nbytes()
            at_start, peak = (alive, peak) if e.start_ns() < start else (at_start, max(peak, alive))
    assert at_start / (tokens * vocab) == pytest.approx(2, abs=0.1)
    assert peak / (tokens * vocab) == pytest.approx(4, abs=0.1)


def test_eager_rms_norm_saves_an_fp32_copy_and_its_normalized_output():
    """An RMSNorm written as eager ops on an fp32 copy (torchtitan's final norm, outside torch.compile): autograd
    keeps the copy (4 B) and the normalized bf16 tensor (2 B) per element, not the input."""
    weight = torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
    x = torch.randn(2, 128, 256, dtype=torch.bfloat16, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        wide = x.float()
        normalized = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x)
        (normalized * weight).sum()
    saved.pop(weight.untyped_storage().data_ptr(), None)
    assert x.untyped_storage().data_ptr() not in saved
    assert sum(saved.values()) / x.numel() == pytest.approx(6, abs=0.05)

"""Optimizer pieces: LR schedule formula, default LR, clipping equal to torch's on one process."""

from __future__ import annotations

import math

import pytest
import torch

from executor.components.optim import (
    WarmupCosine,
    build_optimizers,
    clip_grad_norm,
    default_lr,
    unique_params,
)
from planner.layout import Layout
from planner.model.load import load_model
from planner.plan import Plan, with_stage_layers
from planner.training import TrainingSpec
from topologies.cluster_load import load_cluster


def test_warmup_then_cosine_to_ten_percent():
    sched = WarmupCosine.for_run(100)
    assert sched.warmup_steps == 10
    factors = [sched(k) for k in range(100)]
    assert factors[:10] == pytest.approx([(k + 1) / 10 for k in range(10)])
    assert factors[10] == pytest.approx(1.0)
    assert factors[99] == pytest.approx(0.1)
    mid = 10 + (99 - 10) / 2
    assert sched(int(mid)) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (int(mid) - 10) / 89)))
    assert all(a >= b for a, b in zip(factors[10:], factors[11:], strict=False))


def test_default_lr_shrinks_with_width():
    assert default_lr(64) == pytest.approx(2.5e-3)  # debug models
    assert default_lr(16) == 3e-3  # the cap
    assert default_lr(4096) == pytest.approx(3.125e-4)  # Llama 2 7B trained at 3e-4
    assert default_lr(8192) < default_lr(4096)


@pytest.mark.parametrize("max_norm", [0.01, 1.0, 1e6])
def test_clip_matches_torch_on_one_process(max_norm):
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b, strict=True):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    ours = clip_grad_norm(a, pp=1, max_norm=max_norm)
    theirs = torch.nn.utils.clip_grad_norm_(b, max_norm)
    assert isinstance(ours, torch.Tensor) and ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_weight_decay_on_matrices_only():
    from executor.model import build_model

    spec = load_model("debug-gpt")  # has biases, LayerNorm weights and biases, tied embeddings
    model = build_model(spec, "cpu")
    plan = Plan(model=spec, cluster=load_cluster("cpu", 1), training=TrainingSpec(seq_len=64, global_batch_size=8),
                layout=with_stage_layers(spec, Layout(micro_batch_size=8)))
    (opt,) = build_optimizers([model], plan, mesh=None, lr=1e-3)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in decayed) == (p.ndim >= 2), name
    assert len(unique_params([model])) == len(list(model.parameters()))  # the tied weight once


def test_fp16_loss_scaling_skips_the_step_on_inf_and_backs_off():
    """unscale_and_check + skip_update_where, as executor.train runs them: an inf gradient skips the fused
    AdamW step on the device (weights and step count unchanged) and halves the scale; finite gradients are
    unscaled and the step is taken (GradScaler runs on CPU tensors too)."""
    from executor.components.optim import skip_update_where, unscale_and_check

    weight = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([weight], lr=0.1, weight_decay=0.0, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(weight.sum()).backward()
    weight.grad[0] = float("inf")
    found = unscale_and_check(scaler, [opt], torch.device("cpu"))
    assert found.dtype == torch.bool and bool(found)
    skip_update_where([opt], found)
    opt.step()
    scaler.update()
    assert torch.equal(weight.detach(), torch.ones(4)) and scaler.get_scale() == 512.0
    assert opt.state[weight]["step"].item() == 0
    opt.zero_grad()
    scaler.scale(weight.sum()).backward()
    found = unscale_and_check(scaler, [opt], torch.device("cpu"))
    assert not bool(found)
    assert torch.allclose(weight.grad, torch.ones(4))  # unscaled before clipping
    skip_update_where([opt], found)
    opt.step()
    assert torch.allclose(weight.detach(), torch.full((4,), 0.9))  # Adam's first step moves by lr
    assert opt.state[weight]["step"].item() == 1


def test_skipped_update_leaves_weights_moments_and_step_count_as_they_were():
    """The non-finite guard's skip on the device: fused AdamW with found_inf set changes nothing, NaN
    gradients included; the next finite step matches an optimizer that never saw the skipped one."""
    from executor.components.optim import skip_update_where

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 4))
    ref = torch.nn.Parameter(w.detach().clone())
    ours = torch.optim.AdamW([w], lr=0.1, fused=True)
    theirs = torch.optim.AdamW([ref], lr=0.1)
    grad = torch.randn(3, 4)
    for p, opt in ((w, ours), (ref, theirs)):
        p.grad = grad.clone()
        skip_update_where([opt], torch.tensor(False)) if opt is ours else None
        opt.step()
    moments = ours.state[w]["exp_avg"].clone()
    w.grad = torch.full((3, 4), float("nan"))
    before = w.detach().clone()
    skip_update_where([ours], torch.tensor(True))
    ours.step()
    assert torch.equal(w.detach(), before) and torch.equal(ours.state[w]["exp_avg"], moments)
    assert ours.state[w]["step"].item() == 1
    for p, opt in ((w, ours), (ref, theirs)):
        p.grad = -grad
        skip_update_where([opt], torch.tensor(False)) if opt is ours else None
        opt.step()
    torch.testing.assert_close(w.detach(), ref.detach())


def test_clip_norm_stays_on_the_device_and_counts_copies():
    """local_grad_norm_sq weighs a piece held by k ranks 1/k (here: one process standing in for a world whose
    gradients are copies), clip_grads_ scales in place; nothing is read back."""
    from executor.components.optim import clip_grads_, local_grad_norm_sq

    p = torch.nn.Parameter(torch.zeros(2, 2))
    p.grad = torch.full((2, 2), 3.0)  # norm 6
    q = torch.nn.Parameter(torch.zeros(3))
    q.grad = torch.tensor([0.0, 8.0, 0.0], dtype=torch.float32)
    sq = local_grad_norm_sq([p, q], pp=1, device=torch.device("cpu"), expert_holders={id(q): 4})
    assert sq.dtype == torch.float64 and sq.item() == pytest.approx(36 + 64 / 4)
    clip_grads_([p, q], sq.sqrt(), max_norm=1.0)
    assert p.grad[0, 0].item() == pytest.approx(3.0 / (52 ** 0.5 + 1e-6))
    clip_grads_([p], torch.tensor(float("nan")), max_norm=1.0)  # NaN norm: NaN gradients, the update is skipped
    assert torch.isnan(p.grad).all()

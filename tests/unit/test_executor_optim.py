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
    assert ours == pytest.approx(theirs.item(), rel=1e-6)
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
    """unscale_and_check: an inf gradient skips the step (weights unchanged) and halves the scale;
    finite gradients are unscaled and the step is taken (GradScaler runs on CPU tensors too)."""
    from executor.components.optim import unscale_and_check

    weight = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([weight], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(weight.sum()).backward()
    weight.grad[0] = float("inf")
    assert unscale_and_check(scaler, [opt], torch.device("cpu"))
    scaler.step(opt)
    scaler.update()
    assert torch.equal(weight.detach(), torch.ones(4)) and scaler.get_scale() == 512.0
    opt.zero_grad()
    scaler.scale(weight.sum()).backward()
    assert not unscale_and_check(scaler, [opt], torch.device("cpu"))
    assert torch.allclose(weight.grad, torch.ones(4))  # unscaled before clipping
    scaler.step(opt)
    assert torch.allclose(weight.detach(), torch.full((4,), 0.9))

"""`--compile`: torch.compile per block, after recomputation, computes what eager does (inductor on CPU).

One process, the debug model with per-op SAC (the most involved block
forward: torch.utils.checkpoint with a selective policy inside the compiled
region). Inductor's C++ kernels take tens of seconds to build on a small
CPU, so the case is marked slow.
"""

from __future__ import annotations

import pytest
import torch

from executor.model import build_model, init_weights
from executor.parallel.parallelize import apply_compile
from executor.parallel.recompute import apply_ac
from planner.model.load import load_model


def _step(compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    spec = load_model("debug")
    model = build_model(spec, "cpu")
    init_weights(model, spec, 0, torch.device("cpu"))
    apply_ac(model, "op")
    if compiled:
        apply_compile(model)
    tokens = torch.randint(0, spec.vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    logits.pow(2).mean().backward()
    return logits.detach(), model.layers["0"].attention.wq.weight.grad


@pytest.mark.slow
def test_compiled_blocks_match_eager():
    eager_out, eager_grad = _step(False)
    out, grad = _step(True)
    assert torch.allclose(out, eager_out, atol=1e-5, rtol=1e-4)
    assert torch.allclose(grad, eager_grad, atol=1e-7, rtol=1e-4)
    assert grad.abs().max() > 0


@pytest.mark.slow
def test_compiled_moe_blocks_match_eager():
    """A MoE block compiled on CPU: fp32 is outside torch's traced grouped GEMM (bf16 only), so the experts
    run one chain each there (executor.experts), with a graph break where their counts are read."""
    spec = load_model("debug-moe")

    def step(compiled: bool):
        model = build_model(spec, "cpu")
        init_weights(model, spec, 0, torch.device("cpu"))
        if compiled:
            apply_compile(model)
        tokens = torch.randint(0, spec.vocab, (2, 32), generator=torch.Generator().manual_seed(0))
        logits = model(tokens)
        logits.pow(2).mean().backward()
        return logits.detach(), model.layers["1"].feed_forward.w2.grad

    (eager_out, eager_grad), (out, grad) = step(False), step(True)
    assert torch.allclose(out, eager_out, atol=1e-5, rtol=1e-4)
    assert torch.allclose(grad, eager_grad, atol=1e-7, rtol=1e-4) and grad.abs().max() > 0

"""Routed experts as grouped GEMMs (executor/experts.py, executor/moe.py) against one linear chain per expert.

The reference runs every chunk of rows through its own expert with plain matmuls: outputs and the
gradients of the rows and of the stacked weights must agree, for one source (no expert parallelism) and
for chunks from several ep ranks, with empty experts, unpadded (CPU) and padded to CUDA's 8-row blocks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from executor.experts import GROUP_ALIGN_ROWS, group_layout, grouped_mlp
from executor.model import FeedForward, build_model, init_weights
from executor.moe import MoE
from planner.model.load import load_model

H, FE, E = 32, 16, 4


def reference_mlp(x, chunks, w1, w2, w3, act):
    """Each (source, expert) chunk through its expert's linears, in arrival order."""
    outs, start = [], 0
    for i, n in enumerate(chunks.flatten().tolist()):
        e, rows = i % chunks.shape[1], x[start:start + n]
        start += n
        h = act(rows @ w1[e].t())
        outs.append((h * (rows @ w3[e].t()) if w3 is not None else h) @ w2[e].t())
    return torch.cat(outs)


def _case(chunks: list[list[int]], swiglu: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    chunks = torch.tensor(chunks)
    x = torch.randn(int(chunks.sum()), H, generator=gen)
    w1, w2 = torch.randn(E, FE, H, generator=gen) / 4, torch.randn(E, H, FE, generator=gen) / 4
    w3 = torch.randn(E, FE, H, generator=gen) / 4 if swiglu else None
    return chunks, x, w1, w2, w3


def _run(fn, x, ws, chunks, act, **kw):
    leaves = [t.clone().requires_grad_() for t in (x, *[w for w in ws if w is not None])]
    xs, rest = leaves[0], iter(leaves[1:])
    w1, w2 = next(rest), next(rest)
    w3 = next(rest) if ws[2] is not None else None
    out = fn(xs, chunks, w1, w2, w3, act, **kw)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return [out.detach()] + [t.grad for t in leaves]


CHUNKS = {
    "one source": [[5, 0, 7, 3]],
    "three ep sources": [[2, 0, 3, 1], [0, 0, 4, 2], [3, 1, 0, 0]],
    "nothing routed here": [[0, 0, 0, 0], [0, 0, 0, 0]],
}


@pytest.mark.parametrize("align", [1, GROUP_ALIGN_ROWS])
@pytest.mark.parametrize("swiglu", [True, False])
@pytest.mark.parametrize("name", CHUNKS)
def test_grouped_mlp_equals_a_chain_per_expert(name, swiglu, align):
    chunks, x, w1, w2, w3 = _case(CHUNKS[name], swiglu)
    got = _run(grouped_mlp, x, (w1, w2, w3), chunks, F.silu, align=align)
    want = _run(reference_mlp, x, (w1, w2, w3), chunks, F.silu) if x.shape[0] else None
    if want is None:  # no rows: an empty output, zero weight gradients
        assert got[0].shape == (0, H) and all(float(g.abs().sum()) == 0 for g in got[2:])
        return
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_group_layout_pads_every_expert_to_whole_blocks():
    chunks = torch.tensor([[2, 0, 9, 1], [0, 0, 4, 8]])
    rows = int(chunks.sum())
    dest, ends, buffer_rows = group_layout(chunks, rows, 8)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    assert sizes.tolist() == [8, 8, 16, 16]  # an empty expert gets one block of zero rows
    assert buffer_rows >= int(ends[-1]) and buffer_rows == rows + 4 * 8
    assert len(set(dest.tolist())) == rows  # every row its own slot
    expert = torch.arange(4).repeat(2).repeat_interleave(chunks.flatten())
    starts = ends - sizes
    for e in range(4):  # an expert's rows are the first rows of its block, sources in order
        mine = dest[expert == e]
        assert mine.tolist() == list(range(int(starts[e]), int(starts[e]) + len(mine)))
    unpadded, ends1, n = group_layout(chunks[:1], int(chunks[0].sum()), 1)
    assert unpadded is None and ends1.tolist() == [2, 2, 11, 12] and n == 12  # already in expert order


def test_widths_the_grouped_kernel_refuses_run_per_expert():
    """fp32 rows 6 wide break the kernel's 16-byte strides: the per-expert fallback gives the same values."""
    gen = torch.Generator().manual_seed(1)
    chunks = torch.tensor([[3, 0, 2, 1]])
    x, w1, w2, w3 = (torch.randn(*s, generator=gen) for s in ((6, 6), (4, 5, 6), (4, 6, 5), (4, 5, 6)))
    torch.testing.assert_close(grouped_mlp(x, chunks, w1, w2, w3, F.silu),
                               reference_mlp(x, chunks, w1, w2, w3, F.silu))


HOST_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "cpu", "numpy")


def _refuse(*args, **kwargs):
    raise AssertionError("a tensor was read on the host")


def test_grouped_path_reads_nothing_on_the_host():
    """No count is read on the host (a device-to-host sync on a GPU), padding and EP chunks included."""
    chunks, x, w1, w2, w3 = _case(CHUNKS["three ep sources"], True)
    x.requires_grad_()
    with pytest.MonkeyPatch.context() as mp:
        for name in HOST_READS:
            mp.setattr(torch.Tensor, name, _refuse)
        grouped_mlp(x, chunks, w1, w2, w3, F.silu, align=GROUP_ALIGN_ROWS).sum().backward()
    assert x.grad is not None


def test_moe_layer_without_ep_reads_nothing_on_the_host():
    spec = load_model("debug-moe")
    moe = MoE(spec, FeedForward)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
    x = torch.randn(2, 16, spec.hidden, requires_grad=True)
    with pytest.MonkeyPatch.context() as mp:
        for name in HOST_READS:
            mp.setattr(torch.Tensor, name, _refuse)
        out = moe(x)
        out.sum().backward()
    assert out.shape == x.shape and x.grad is not None


def test_moe_layer_equals_each_token_through_its_experts():
    """The whole layer (router, sort, grouped experts, weighted combine, shared expert) against a loop over
    tokens, on debug-moe's first MoE layer as the model initializes it."""
    spec = dataclasses.replace(load_model("debug-moe"), n_layers=1)
    model = build_model(spec, "cpu")
    init_weights(model, spec, 0, torch.device("cpu"))
    moe = model.layers["0"].feed_forward
    tokens = torch.randn(24, spec.hidden)
    weights, experts = moe.route(tokens)
    want = moe.shared(tokens).clone()
    for t in range(tokens.shape[0]):
        for w, e in zip(weights[t], experts[t], strict=True):
            h = moe.act(tokens[t] @ moe.w1[e].t()) * (tokens[t] @ moe.w3[e].t())
            want[t] += w * (h @ moe.w2[e].t())
    torch.testing.assert_close(moe(tokens[None])[0], want, rtol=1e-5, atol=1e-6)

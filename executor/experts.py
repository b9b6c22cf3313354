"""Routed experts as grouped GEMMs: one kernel per projection for all of a rank's experts.

The rows a rank runs arrive as chunks: chunk (s, e) holds the rows source s
routed to local expert e, chunks in source-major order (one source without
expert parallelism, the ep ranks with it: executor.parallel.expert). A grouped
GEMM wants each expert's rows contiguous, so `group_layout` computes, on the
device and without reading any count on the host, where every row goes:
groups in expert order, the sources in order inside a group. The SwiGLU (or
GELU) MLP then runs as three (two) `torch._grouped_mm` calls over the stacked
(E, out, in) weights, whose offsets are the groups' cumulative ends, and the
outputs are read back in arrival order.

CUDA: the bf16 kernel gets each group padded with zero rows to a multiple of
GROUP_ALIGN_ROWS, and an empty group to one such block (torchtitan's
TOKEN_GROUP_ALIGN_SIZE_M and generate_permute_indices: an expert that gets
no token still produces a zero weight gradient). The padded buffer has a
fixed length, rows + E x GROUP_ALIGN_ROWS, so no count is read on the host.
CPU: torch implements `_grouped_mm` as a loop of matmuls over the groups,
exact against per-expert linears (tests/unit/test_experts.py), unpadded.

Fallback: the grouped kernel needs 16-byte aligned strides (the rows' and
the experts' widths times the element size), and torch's meta function of
`_grouped_mm`, which torch.compile and FakeTensorMode trace with, takes bf16
only (its eager kernels take any dtype); a model whose widths are not aligned,
or a traced non-bf16 step, runs one matmul chain per expert over its rows,
which needs the counts on the host (one sync per call; a graph break when
compiled).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

GROUP_ALIGN_ROWS = 8  # rows per group the CUDA bf16 grouped GEMM is given a multiple of (torchtitan's, for bf16)
_STRIDE_ALIGN_BYTES = 16  # torch._grouped_mm's requirement on every operand's strides


def grouped_mm_fits(x: torch.Tensor, ffn: int) -> bool:
    """Whether torch._grouped_mm takes the rows `x` and experts of width `ffn` (module docstring: fallback)."""
    from torch._subclasses.fake_tensor import is_fake

    size = x.element_size()
    aligned = (x.shape[-1] * size) % _STRIDE_ALIGN_BYTES == 0 and (ffn * size) % _STRIDE_ALIGN_BYTES == 0
    traced = torch.compiler.is_compiling() or is_fake(x)
    return hasattr(torch, "_grouped_mm") and aligned and (x.dtype == torch.bfloat16 or not traced)


def group_layout(chunks: torch.Tensor, rows: int, align: int) -> tuple[torch.Tensor | None, torch.Tensor, int]:
    """(destination of each arriving row or None for "in place", the groups' int32 end offsets, buffer rows).

    chunks: (sources, experts) row counts in arrival order (module docstring); rows = chunks.sum(), known
    on the host as the length of the rows. align > 1 pads every group to a multiple of align (at least one
    block). All on the device: no count is read on the host.
    """
    per_group = chunks.sum(0)
    n_src, n_exp = chunks.shape
    if align == 1 and n_src == 1:  # already grouped in expert order
        return None, per_group.cumsum(0).to(torch.int32), rows
    padded = per_group if align == 1 else (per_group.clamp_min(1) + align - 1) // align * align
    ends = padded.cumsum(0)
    within = chunks.cumsum(0) - chunks  # rows of earlier sources ahead in the same group
    first_dest = (ends - padded)[None, :] + within  # (sources, experts): where each chunk starts
    flat = chunks.flatten()
    first_src = flat.cumsum(0) - flat  # where each chunk starts in arrival order
    chunk_of = torch.repeat_interleave(torch.arange(flat.numel(), device=chunks.device), flat, output_size=rows)
    dest = first_dest.flatten()[chunk_of] + torch.arange(rows, device=chunks.device) - first_src[chunk_of]
    buffer_rows = rows if align == 1 else rows + n_exp * align
    return dest, ends.to(torch.int32), buffer_rows


def grouped_mlp(x: torch.Tensor, chunks: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor | None,
                act: Callable[[torch.Tensor], torch.Tensor], align: int | None = None) -> torch.Tensor:
    """Each arriving row through its expert's MLP, w2(act(w1 x) * w3 x) (GELU: w2(act(w1 x))), arrival order.

    x: (rows, h) in arrival order; chunks: (sources, experts) counts (module docstring); w1/w3 (E, f, h),
    w2 (E, h, f) in x's dtype; align: rows per group block, by default GROUP_ALIGN_ROWS on CUDA, else 1.
    """
    if not grouped_mm_fits(x, w1.shape[1]):
        return _looped_mlp(x, chunks, w1, w2, w3, act)
    align = align if align is not None else GROUP_ALIGN_ROWS if x.is_cuda else 1
    dest, offsets, buffer_rows = group_layout(chunks, x.shape[0], align)
    # index_put keeps only the index for its backward (index_copy would keep x too)
    grouped = x if dest is None else x.new_zeros(buffer_rows, x.shape[-1]).index_put((dest,), x)
    h = act(torch._grouped_mm(grouped, w1.transpose(-2, -1), offs=offsets))
    if w3 is not None:
        h = h * torch._grouped_mm(grouped, w3.transpose(-2, -1), offs=offsets)
    out = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)
    return out if dest is None else out[dest]


def _looped_mlp(x: torch.Tensor, chunks: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor | None,
                act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The same MLP one chunk at a time (module docstring: shapes the grouped kernel refuses); a host sync."""
    n_exp = chunks.shape[1]
    outs = []
    for i, rows in enumerate(torch.split(x, chunks.flatten().tolist())):
        e = i % n_exp
        if rows.shape[0]:
            h = act(rows @ w1[e].t())
            outs.append((h * (rows @ w3[e].t()) if w3 is not None else h) @ w2[e].t())
    return torch.cat(outs) if outs else x[:0]

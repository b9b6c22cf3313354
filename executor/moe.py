"""Mixture-of-experts MLP: a top-k router, routed experts as stacked weights, optional shared experts.

Router: fp32 softmax over the experts' logits, the top_k per token, their
probabilities renormalized to sum to 1 (Mixtral's routing); no auxiliary
loss. Routed experts are SwiGLU (or GELU) MLPs whose weights are stacked
3-D parameters, w1/w3 (E, h, f_e) and w2 (E, f_e, h), so expert parallelism
shards them along dim 0. Tokens are sorted by expert and each expert runs
one matmul chain over its contiguous rows (a grouped matmul done as a loop:
the debug models have a handful of experts). Shared experts are one dense
MLP of width n_shared * shared_ffn_hidden every token goes through.

Expert parallelism (executor.parallel.expert) gives this module an
`ExpertGroup`; the rows then travel to the rank owning their expert and
back with all_to_all over the ep group, and this rank's parameters hold only
experts [first, first + E / ep).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.model.spec import ModelSpec


class MoE(nn.Module):
    def __init__(self, spec: ModelSpec, dense_mlp: type[nn.Module]) -> None:
        super().__init__()
        moe = spec.moe
        h, f = spec.hidden, moe.expert_ffn_hidden
        self.n_experts, self.top_k = moe.n_experts, moe.top_k
        self.swiglu = spec.mlp == "swiglu"
        self.router = nn.Linear(h, moe.n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(moe.n_experts, h, f))
        self.w2 = nn.Parameter(torch.empty(moe.n_experts, f, h))
        self.w3 = nn.Parameter(torch.empty(moe.n_experts, h, f)) if self.swiglu else None
        shared = moe.n_shared_experts * (moe.shared_ffn_hidden or f)
        self.shared = None
        if shared:  # dense_mlp: executor.model.FeedForward (passed in: model imports this module)
            self.shared = dense_mlp(spec, ffn_hidden=shared)
        self.ep = None  # executor.parallel.expert.ExpertGroup under expert parallelism
        self.expert_rows = (0, moe.n_experts)  # the experts this rank holds (expert parallelism cuts them)

    def expert_params(self) -> list[nn.Parameter]:
        return [p for p in (self.w1, self.w2, self.w3) if p is not None]

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert e on rows x (weights cast to the rows' dtype: FSDP2 leaves them unmanaged)."""
        w1, w2 = self.w1[e].to(x.dtype), self.w2[e].to(x.dtype)
        if self.swiglu:
            return (F.silu(x @ w1) * (x @ self.w3[e].to(x.dtype))) @ w2
        return F.gelu(x @ w1, approximate="tanh") @ w2

    def expert_counts(self, flat: torch.Tensor) -> torch.Tensor:
        """Rows routed to each expert: data-dependent shapes (validate-memory balances them, like
        `routed_sizes` and `ExpertGroup.split_sizes`)."""
        return torch.bincount(flat, minlength=self.n_experts)

    def routed_sizes(self, counts: torch.Tensor) -> list[int]:
        """The counts as split sizes (a host sync)."""
        return counts.tolist()

    def run_experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by local expert (counts[e] rows each, in order) -> their outputs."""
        outs = [self._expert(e, rows) for e, rows in enumerate(torch.split(x, counts)) if rows.shape[0]]
        return torch.cat(outs) if outs else x[:0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        token_of = order // self.top_k
        rows = tokens[token_of]
        counts = self.expert_counts(flat)
        if self.ep is None:
            out_rows = self.run_experts(rows, self.routed_sizes(counts))
        else:
            out_rows = self.ep.dispatch_run_combine(rows, counts, self.run_experts)
        out_rows = out_rows * weights.flatten()[order, None].to(out_rows.dtype)
        # scatter_add (torchtitan's combine) keeps only the index for its backward; index_add would keep
        # the weighted rows too (top_k x hidden per token)
        index = token_of[:, None].expand(-1, tokens.shape[-1])
        out = torch.zeros_like(tokens).scatter_add(0, index, out_rows.to(tokens.dtype))
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.reshape(shape)

"""Mixture-of-experts MLP: a top-k router, routed experts as stacked weights, optional shared experts.

Routers, as transformers' modeling code of each family computes them (no
auxiliary loss):
  softmax (Mixtral, Qwen2/3-MoE): fp32 softmax over the experts' logits, the
    top_k per token, renormalized to sum to 1 when norm_topk_prob (always for
    Mixtral; Qwen's config key);
  sigmoid (DeepSeek-V3): fp32 sigmoid per expert; the choice adds the score
    correction bias (`score_bias`, transformers' e_score_correction_bias, a
    buffer: DeepSeek moves it by load balancing, not by gradient, and meshplan
    keeps it as loaded) and, with n_group groups, keeps only the topk_group
    groups whose two best scores sum highest; the weights are the chosen
    experts' unbiased scores, renormalized when norm_topk_prob, times
    routed_scaling.
Routed experts are SwiGLU (or GELU) MLPs whose weights are stacked 3-D
parameters in torchtitan's GroupedExperts layout (E, out, in): w1/w3 (E, f_e,
h) and w2 (E, h, f_e), each expert's slice the weight of an nn.Linear (and of
a Hugging Face expert's gate/up/down_proj), so expert parallelism shards them
along dim 0. Tokens are sorted by expert and every projection of every expert
runs as one grouped GEMM (executor.experts), the counts per expert staying on
the device. Shared experts are one dense MLP of width n_shared *
shared_ffn_hidden every token goes through, scaled by sigmoid(shared_gate x)
in Qwen2-MoE.

Precision: under FSDP2 (and its replicate) the expert weights are the
module's own parameters in its units (executor.parallel.parallelize), so
their compute-dtype copies are FSDP2's, made once per unit; under autocast
(DDP, or no data parallelism) they are cast once per forward, as autocast
casts every other weight, since autocast does not cover torch._grouped_mm.

Expert parallelism (executor.parallel.expert) gives this module an
`ExpertGroup`; the rows then travel to the rank owning their expert and
back with all_to_all over the ep group, and this rank's parameters hold only
experts [first, first + E / ep).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor.experts import grouped_mlp
from planner.model.spec import ModelSpec


class MoE(nn.Module):
    def __init__(self, spec: ModelSpec, dense_mlp: type[nn.Module]) -> None:
        super().__init__()
        moe = spec.moe
        h, f = spec.hidden, moe.expert_ffn_hidden
        self.n_experts, self.top_k = moe.n_experts, moe.top_k
        self.routing = moe  # scoring, norm_topk_prob, routed_scaling, n_group, topk_group
        self.swiglu = spec.mlp == "swiglu"
        self.act = dense_mlp.activation(spec)
        self.router = nn.Linear(h, moe.n_experts, bias=False)
        if moe.router_bias and moe.scoring == "sigmoid":
            self.register_buffer("score_bias", torch.empty(moe.n_experts))
        else:
            self.score_bias = None
        self.w1 = nn.Parameter(torch.empty(moe.n_experts, f, h))
        self.w2 = nn.Parameter(torch.empty(moe.n_experts, h, f))
        self.w3 = nn.Parameter(torch.empty(moe.n_experts, f, h)) if self.swiglu else None
        shared = moe.n_shared_experts * (moe.shared_ffn_hidden or f)
        self.shared = self.shared_gate = None
        if shared:  # dense_mlp: executor.model.FeedForward (passed in: model imports this module)
            self.shared = dense_mlp(spec, ffn_hidden=shared)
            if moe.shared_expert_gate:
                self.shared_gate = nn.Linear(h, 1, bias=False)
        self.ep = None  # executor.parallel.expert.ExpertGroup under expert parallelism
        self.expert_rows = (0, moe.n_experts)  # the experts this rank holds (expert parallelism cuts them)

    def expert_params(self) -> list[nn.Parameter]:
        return [p for p in (self.w1, self.w2, self.w3) if p is not None]

    def dense_modules(self) -> list[nn.Module]:
        """The modules whose parameters every data-parallel rank holds (router, shared experts and gate)."""
        return [m for m in (self.router, self.shared, self.shared_gate) if m is not None]

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts), each (tokens, top_k): the family's router (see the module docstring)."""
        r = self.routing
        logits = self.router(tokens).float()
        if r.scoring == "softmax":
            weights, experts = F.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
        else:
            scores = logits.sigmoid()
            choice = scores + self.score_bias if self.score_bias is not None else scores
            if r.n_group > 1:
                grouped = choice.view(-1, r.n_group, self.n_experts // r.n_group)
                best = grouped.topk(2, dim=-1)[0].sum(-1).topk(r.topk_group, dim=-1, sorted=False)[1]
                keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
                choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(-1, self.n_experts)
            experts = choice.topk(self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, experts)
        if r.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if r.scoring == "sigmoid" else 0.0))
        return weights * r.routed_scaling if r.routed_scaling != 1.0 else weights, experts

    def expert_counts(self, flat: torch.Tensor) -> torch.Tensor:
        """Rows routed to each expert, on the device: a scatter of ones into E bins (CUDA's bincount reads the
        largest index on the host to size its output). validate-memory balances them, like
        `ExpertGroup.split_sizes`."""
        return flat.new_zeros(self.n_experts).scatter_add_(0, flat, torch.ones_like(flat))

    def run_experts(self, x: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
        """Rows in chunks (source, local expert) (executor.experts) -> their experts' outputs, same order."""
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        w1, w2, w3 = (None if w is None else w if w.dtype == dtype else w.to(dtype) for w in (self.w1, self.w2, self.w3))
        return grouped_mlp(x.to(dtype), chunks, w1, w2, w3, self.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, experts = self.route(tokens)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        token_of = order // self.top_k
        rows = tokens[token_of]
        counts = self.expert_counts(flat)
        if self.ep is None:
            out_rows = self.run_experts(rows, counts.view(1, -1))
        else:
            out_rows = self.ep.dispatch_run_combine(rows, counts, self.run_experts)
        out_rows = out_rows * weights.flatten()[order, None].to(out_rows.dtype)
        # scatter_add (torchtitan's combine) keeps only the index for its backward; index_add would keep
        # the weighted rows too (top_k x hidden per token)
        index = token_of[:, None].expand(-1, tokens.shape[-1])
        out = torch.zeros_like(tokens).scatter_add(0, index, out_rows.to(tokens.dtype))
        if self.shared is not None:
            shared = self.shared(tokens)
            out = out + (torch.sigmoid(self.shared_gate(tokens)) * shared if self.shared_gate is not None else shared)
        return out.reshape(shape)

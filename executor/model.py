"""Our own decoder-only transformer, built from a ModelSpec: Llama-style or GPT-style.

Llama-style (norm="rmsnorm", mlp="swiglu", position="rope"): RMSNorm, rotary
position embeddings, SwiGLU MLP w2(silu(w1 x) * w3 x), grouped-query attention
(n_kv_heads <= n_heads). GPT-style (norm="layernorm", mlp="gelu",
position="learned"): LayerNorm, learned positions added to the token
embedding, GELU MLP w2(gelu(w1 x)), biases when the spec says so, output layer
tied to the token embedding when the spec says so. Any mix of the three
choices builds; ALiBi is refused.

The numerics of the Hugging Face families (transformers' modeling code) come
from the spec: rope theta and scaling (executor.rope), the norms' epsilon,
the MLP's activation, the attention's biases, q/k norms, sliding windows and
MLA (executor.attention), and per layer a dense MLP or the mixture of
experts with its family's router (executor.moe).

Parameter names (FQNs) are the contract with checkpoints: they are the same
under every layout. `layers` is a ModuleDict keyed by str(layer_index), so a
pipeline stage keeps the original names after deleting the blocks it does not
own; off their stage `tok_embeddings`, `pos_embeddings`, `norm` and `output`
are set to None (torchtitan's convention). Activation checkpointing lives
inside the blocks (a `recompute` attribute), not in wrapper modules, so it
never inserts a name either.

Shapes under tensor parallelism: attention and MLP read the head count from
their input (`view(..., -1, head_dim)`), so a block whose q/k/v projections
were split column-wise over tp ranks runs a_local = a / tp heads unchanged.

Initialization is deterministic from (seed, FQN) and independent of the
layout: every parameter's *full* value is drawn from its own generator (see
`full_init_value`), then each rank keeps its shard of it (`init_weights`).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from executor.attention import Attention, MLAttention, attention_core
from executor.moe import MoE
from executor.parallel.context import ContextShard
from executor.rope import rope_tables, rotate_half_apply
from planner.model.spec import ModelSpec
from topologies.errors import ModelError

__all__ = ["Attention", "Block", "FeedForward", "MLAttention", "Transformer", "attention_core", "build_model",
           "full_init_value", "init_weights", "rope_tables", "rotate_half_apply"]

INIT_STD = 0.02  # GPT-2 / nanoGPT: N(0, 0.02) for weights and embeddings
# the MoE's stacked expert w2 and its shared experts' w2 are residual projections too
RESIDUAL_PROJECTIONS = ("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.w2", "shared.w2.weight")
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return nn.RMSNorm(spec.hidden, eps=spec.norm_eps)
    return nn.LayerNorm(spec.hidden, eps=spec.norm_eps, bias=True)


def rope_dim(spec: ModelSpec) -> int:
    """Width of the rotated part of a head: head_dim, or MLA's qk_rope_head_dim."""
    return spec.mla.qk_rope_head_dim if spec.mla is not None else spec.head_dim


class FeedForward(nn.Module):
    def __init__(self, spec: ModelSpec, ffn_hidden: int | None = None) -> None:
        super().__init__()
        f = ffn_hidden or spec.ffn_hidden
        self.swiglu = spec.mlp == "swiglu"
        self.act = ACTIVATIONS[spec.mlp_activation]
        self.w1 = nn.Linear(spec.hidden, f, bias=spec.bias)
        self.w2 = nn.Linear(f, spec.hidden, bias=spec.bias)
        self.w3 = nn.Linear(spec.hidden, f, bias=spec.bias) if self.swiglu else None

    @staticmethod
    def activation(spec: ModelSpec):
        """The spec's MLP activation as a function (the MoE's experts use it too)."""
        return ACTIVATIONS[spec.mlp_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.w2(self.act(self.w1(x)) * self.w3(x))
        return self.w2(self.act(self.w1(x)))


class Block(nn.Module):
    """Pre-norm residual block: h = x + attn(norm(x)); out = h + mlp(norm(h))."""

    def __init__(self, spec: ModelSpec, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = _norm(spec)
        attention = MLAttention if spec.mla is not None else Attention
        self.attention = attention(spec, window=spec.window_of(layer))
        self.ffn_norm = _norm(spec)
        if spec.moe is not None and spec.moe.is_moe_layer(layer):
            self.feed_forward: nn.Module = MoE(spec, FeedForward)
        else:
            self.feed_forward = FeedForward(spec)
        self.full_recompute = False  # recompute the whole block in backward (keep only its input)
        self.op_recompute = False  # per-op SAC: torchtitan's save list (executor.parallel.recompute)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        if self.full_recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        if self.op_recompute and torch.is_grad_enabled():
            from executor.parallel.recompute import op_sac_context

            return checkpoint(self._forward, x, cos, sin, use_reentrant=False, context_fn=op_sac_context)
        return self._forward(x, cos, sin)


class Transformer(nn.Module):
    """The whole decoder, or one pipeline stage of it (modules it does not own are None)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(spec.vocab, spec.hidden)
        learned = spec.position == "learned"
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(spec.max_seq_len, spec.hidden) if learned else None
        self.layers = nn.ModuleDict({str(i): Block(spec, i) for i in range(spec.n_layers)})
        self.norm: nn.Module | None = _norm(spec)
        self.output: nn.Linear | None = nn.Linear(spec.hidden, spec.vocab, bias=False)
        self.tie_weights()
        self.cp: ContextShard | None = None  # context parallel: this rank's load-balanced sequence chunks
        # sequence parallel on a pipeline stage without the embedding: the residual stream it receives is this
        # rank's 1/seq_shards of the sequence (a Shard(1) local tensor), the attention's all-gather sees it whole
        self.seq_shards = 1
        cos, sin = rope_tables(rope_dim(spec), spec.max_seq_len, "meta", spec)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        """Share the output layer's weight with the token embedding when the spec ties them.

        Called again after materialization: `to_empty` from meta gives each
        module its own new tensor, which silently unties them.
        """
        if self.spec.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            if self.output.weight is not self.tok_embeddings.weight:
                self.output.weight = self.tok_embeddings.weight

    def positions(self, seq: int, device: torch.device) -> torch.Tensor:
        """Global positions of this rank's `seq` tokens: 0..seq-1, or its cp chunks."""
        if self.cp is not None:
            return self.cp.positions(seq, device)
        return torch.arange(seq, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (B, S) -> logits (B, S, V) for the whole model; a stage maps what it receives.

        The rotary tables are cut to this rank's positions and cast to the
        compute dtype once here, so every block shares one small copy
        (FSDP2's input cast of each block is then a no-op).
        """
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        seq = x.shape[1] if self.tok_embeddings is not None else x.shape[1] * self.seq_shards  # this rank's (cp)
        pos = self.positions(seq, x.device)
        if self.cp is not None:
            self.cp.prepare(seq)
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(pos)
        cos = sin = None
        if self.spec.position == "rope":
            dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else h.dtype
            cos, sin = (self.rope_cos[pos].to(dtype), self.rope_sin[pos].to(dtype)) if self.cp is not None else \
                (self.rope_cos[:seq].to(dtype), self.rope_sin[:seq].to(dtype))
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def build_model(spec: ModelSpec, device: str | torch.device = "meta") -> Transformer:
    """Construct the full model on `device` (meta by default: no memory until materialized).

    On a real device the weights are left uninitialized; call `init_weights`.
    """
    if spec.position == "alibi":
        raise ModelError(f"model {spec.name!r}: the executor implements rope and learned positions, not alibi")
    with torch.device(device):
        return Transformer(spec)


def param_seed(seed: int, fqn: str) -> int:
    """A 63-bit generator seed from (run seed, parameter FQN), stable across processes.

    Python's hash() is salted per process, so a digest is used instead.
    """
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def full_init_value(fqn: str, shape: tuple[int, ...], spec: ModelSpec, seed: int,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """The full (unsharded) initial value of one parameter, fp32.

    Norm weights 1 and every bias 0; other weights N(0, 0.02), residual
    projections (attention.wo, feed_forward.w2) scaled by 1/sqrt(2 * n_layers)
    as in GPT-2, so the residual stream's variance does not grow with depth.
    Drawn on `device` with a generator seeded by (seed, fqn): the same on any
    layout of the same device type.
    """
    if spec.tie_embeddings and fqn == "output.weight":  # a pipeline's last stage holds the tied copy
        fqn = "tok_embeddings.weight"
    parts = fqn.rsplit(".", 2)
    leaf = parts[-1]
    is_norm = len(parts) > 1 and parts[-2].endswith("norm")  # attention_norm, ffn_norm, norm, q/k/kv norms
    if leaf == "bias":
        return torch.zeros(shape, device=device)
    if is_norm:
        return torch.ones(shape, device=device)
    std = INIT_STD
    if fqn.endswith(RESIDUAL_PROJECTIONS):
        std /= math.sqrt(2 * spec.n_layers)
    gen = torch.Generator(device=device)
    gen.manual_seed(param_seed(seed, fqn))
    return torch.randn(shape, generator=gen, device=device) * std


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give a meta-device model (or stage) real, uninitialized storage on `device`, tied weights tied again."""
    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        model.to_empty(device=device)
        for module in model.modules():
            if isinstance(module, Transformer):
                module.tie_weights()


def local_expert_rows(model: nn.Module) -> dict[int, tuple[int, int]]:
    """id(expert parameter) -> the experts [first, last) of the stacked value this rank holds (expert parallel)."""
    return {id(p): m.expert_rows for m in model.modules() if hasattr(m, "expert_rows") for p in m.expert_params()}


@torch.no_grad()
def init_weights(model: nn.Module, spec: ModelSpec, seed: int, device: torch.device) -> None:
    """Materialize (if on meta) and initialize every local parameter shard, then the rope tables.

    For a DTensor parameter (TP and/or FSDP sharded) the full value is cut
    with `distribute_tensor(..., src_data_rank=None)`, which takes this rank's
    piece locally (no communication) following the placements, strided FSDP+TP
    shards included.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    materialize(model, device)
    expert_rows = local_expert_rows(model)
    for fqn, param in model.named_parameters():
        rows = expert_rows.get(id(param))
        shape = (spec.moe.n_experts, *param.shape[1:]) if rows else tuple(param.shape)
        full = full_init_value(fqn, shape, spec, seed, device)
        if rows:
            full = full[rows[0]:rows[1]]
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)
    for module in model.modules():  # the routers' score-correction biases start at zero (DeepSeek-V3)
        if isinstance(module, MoE) and module.score_bias is not None:
            module.score_bias.zero_()
    init_rope(model, spec, device)


@torch.no_grad()
def init_rope(model: nn.Module, spec: ModelSpec, device: torch.device) -> None:
    """The rope tables (not persistent: computed from the spec on every start)."""
    for module in model.modules():
        if isinstance(module, Transformer):
            cos, sin = rope_tables(rope_dim(spec), spec.max_seq_len, device, spec)
            module.rope_cos.copy_(cos)
            module.rope_sin.copy_(sin)

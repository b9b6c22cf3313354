"""State-dict adapters: our parameter names (executor.model) <-> each family's Hugging Face tensors.

A `Rule` ties some of our tensors to some of theirs, both directions:
  Same        one to one (Llama-style projections, norms, embeddings);
  Transposed  GPT-2's Conv1D weights, stored (in, out);
  Split       GPT-2's fused c_attn: our q, k and v are column blocks of it (transposed), its bias in thirds;
  Experts     our stacked (E, out, in) expert weight <-> one tensor per expert, as save_pretrained of
              transformers 5.23 writes them by default (save_original_format) and as the hubs hold them:
              mlp.experts.{e}.gate_proj/up_proj/down_proj (Qwen-MoE, DeepSeek), block_sparse_moe.experts.{e}
              .w1/w3/w2 (Mixtral);
  Fused       transformers 5's in-memory layout, also found on disk (save_original_format=False):
              mlp.experts.gate_up_proj (E, 2f, h), gate rows first, and mlp.experts.down_proj (E, h, f).
Loading reads either expert layout (whichever the files hold) and a GPT-2
checkpoint with or without the `transformer.` prefix; exports write the
default save_pretrained layout. A tied output layer has no tensor of its own:
a pipeline's last stage loads its copy from the embedding, and exports leave
it out (save_pretrained drops tied weights too).

`rows` in `load` are a range along our tensor's dimension 0 (FSDP's shard,
a column-parallel slice, an expert-parallel rank's experts): the rules that
can read just those rows from the file do (Same, Experts, Fused); the others
read the whole tensor once and cut it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from planner.model.spec import ModelSpec
from topologies.errors import UsageError

Reader = Callable[[str, "tuple[int, int] | None"], torch.Tensor]  # WeightsDir.read


def _rows(t: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    return t if rows is None else t[rows[0]:rows[1]]


@dataclass(frozen=True)
class Rule:
    ours: tuple[str, ...]
    theirs: tuple[str, ...]

    def load(self, read: Reader, fqn: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        raise NotImplementedError

    def save(self, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError


@dataclass(frozen=True)
class Same(Rule):
    def load(self, read, fqn, rows=None):
        return read(self.theirs[0], rows)

    def save(self, ours):
        return {self.theirs[0]: ours[self.ours[0]]}


@dataclass(frozen=True)
class Transposed(Rule):
    def load(self, read, fqn, rows=None):
        return _rows(read(self.theirs[0], None).t(), rows)

    def save(self, ours):
        return {self.theirs[0]: ours[self.ours[0]].t().contiguous()}


@dataclass(frozen=True)
class Split(Rule):
    """Our tensors are equal blocks of theirs along `dim` (transposed after the cut when `transpose`)."""

    dim: int = 0
    transpose: bool = False

    def load(self, read, fqn, rows=None):
        block = read(self.theirs[0], None).chunk(len(self.ours), dim=self.dim)[self.ours.index(fqn)]
        return _rows(block.t() if self.transpose else block, rows)

    def save(self, ours):
        blocks = [ours[name].t() if self.transpose else ours[name] for name in self.ours]
        return {self.theirs[0]: torch.cat(blocks, dim=self.dim).contiguous()}


@dataclass(frozen=True)
class Experts(Rule):
    """Our stacked weight <-> theirs[e] for every expert e."""

    def load(self, read, fqn, rows=None):
        first, last = rows if rows is not None else (0, len(self.theirs))
        return torch.stack([read(self.theirs[e], None) for e in range(first, last)])

    def save(self, ours):
        stacked = ours[self.ours[0]]
        return {key: stacked[e].contiguous() for e, key in enumerate(self.theirs)}


@dataclass(frozen=True)
class Fused(Rule):
    """Our w1 and w3 are the gate and up halves of transformers 5's gate_up_proj (E, 2f, h)."""

    def load(self, read, fqn, rows=None):
        both = read(self.theirs[0], rows)
        return both.chunk(2, dim=1)[self.ours.index(fqn)]

    def save(self, ours):
        return {self.theirs[0]: torch.cat([ours[n] for n in self.ours], dim=1).contiguous()}


def _linear(ours: str, theirs: str, bias: bool) -> list[Rule]:
    rules: list[Rule] = [Same((f"{ours}.weight",), (f"{theirs}.weight",))]
    if bias:
        rules.append(Same((f"{ours}.bias",), (f"{theirs}.bias",)))
    return rules


def _attention(spec: ModelSpec, our: str, hf: str) -> list[Rule]:
    if spec.mla is not None:
        m = spec.mla
        pairs = [("wkv_a", "kv_a_proj_with_mqa", spec.attention_bias), ("wkv_b", "kv_b_proj", False),
                 ("wo", "o_proj", spec.attention_bias)]
        pairs += ([("wq_a", "q_a_proj", spec.attention_bias), ("wq_b", "q_b_proj", False)] if m.q_lora_rank
                  else [("wq", "q_proj", False)])
        rules = [r for ours, theirs, bias in pairs for r in _linear(f"{our}.{ours}", f"{hf}.{theirs}", bias)]
        rules.append(Same((f"{our}.kv_norm.weight",), (f"{hf}.kv_a_layernorm.weight",)))
        if m.q_lora_rank:
            rules.append(Same((f"{our}.q_norm.weight",), (f"{hf}.q_a_layernorm.weight",)))
        return rules
    qkv_bias = spec.bias or spec.attention_bias or spec.qkv_bias
    rules = [r for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"))
             for r in _linear(f"{our}.{ours}", f"{hf}.{theirs}", qkv_bias)]
    rules += _linear(f"{our}.wo", f"{hf}.o_proj", spec.bias or spec.attention_bias)
    if spec.qk_norm:
        rules += [Same((f"{our}.q_norm.weight",), (f"{hf}.q_norm.weight",)),
                  Same((f"{our}.k_norm.weight",), (f"{hf}.k_norm.weight",))]
    return rules


def _moe(spec: ModelSpec, our: str, hf: str, available: set[str] | None) -> list[Rule]:
    """One MoE layer: router, score bias, experts (either on-disk layout), shared experts and their gate."""
    moe = spec.moe
    mixtral = spec.family == "mixtral"
    legacy_hf = hf.replace(".mlp", ".block_sparse_moe") if mixtral else hf
    fused = available is not None and f"{hf}.experts.gate_up_proj" in available
    rules: list[Rule] = []
    gate = f"{hf}.gate.weight" if fused or not mixtral else f"{legacy_hf}.gate.weight"
    rules.append(Same((f"{our}.router.weight",), (gate,)))
    if moe.router_bias and moe.scoring == "sigmoid":
        rules.append(Same((f"{our}.score_bias",), (f"{hf}.gate.e_score_correction_bias",)))
    if fused:
        rules.append(Fused((f"{our}.w1", f"{our}.w3"), (f"{hf}.experts.gate_up_proj",)))
        rules.append(Same((f"{our}.w2",), (f"{hf}.experts.down_proj",)))
    else:
        names = {"w1": "w1", "w3": "w3", "w2": "w2"} if mixtral else {"w1": "gate_proj", "w3": "up_proj",
                                                                      "w2": "down_proj"}
        for ours, theirs in names.items():
            if ours == "w3" and spec.mlp != "swiglu":
                continue
            keys = tuple(f"{legacy_hf}.experts.{e}.{theirs}.weight" for e in range(moe.n_experts))
            rules.append(Experts((f"{our}.{ours}",), keys))
    if moe.n_shared_experts:
        shared = f"{hf}.shared_expert" if spec.family == "qwen2_moe" else f"{hf}.shared_experts"
        rules += _mlp(spec, f"{our}.shared", shared)
        if moe.shared_expert_gate:
            rules.append(Same((f"{our}.shared_gate.weight",), (f"{hf}.shared_expert_gate.weight",)))
    return rules


def _mlp(spec: ModelSpec, our: str, hf: str) -> list[Rule]:
    rules = _linear(f"{our}.w1", f"{hf}.gate_proj", spec.bias) + _linear(f"{our}.w2", f"{hf}.down_proj", spec.bias)
    return rules + _linear(f"{our}.w3", f"{hf}.up_proj", spec.bias)


def _llama_like(spec: ModelSpec, available: set[str] | None) -> list[Rule]:
    rules: list[Rule] = [Same(("tok_embeddings.weight",), ("model.embed_tokens.weight",)),
                         Same(("norm.weight",), ("model.norm.weight",)),
                         Same(("output.weight",), ("model.embed_tokens.weight" if spec.tie_embeddings
                                                   else "lm_head.weight",))]
    if spec.norm != "rmsnorm" or spec.mlp != "swiglu" or spec.position != "rope":
        raise UsageError(f"model {spec.name!r}: a {spec.family or 'llama'} checkpoint holds a Llama-style model "
                         f"(rmsnorm, swiglu, rope), not {spec.norm}, {spec.mlp}, {spec.position}")
    for i in range(spec.n_layers):
        our, hf = f"layers.{i}", f"model.layers.{i}"
        rules += [Same((f"{our}.attention_norm.weight",), (f"{hf}.input_layernorm.weight",)),
                  Same((f"{our}.ffn_norm.weight",), (f"{hf}.post_attention_layernorm.weight",))]
        rules += _attention(spec, f"{our}.attention", f"{hf}.self_attn")
        if spec.moe is not None and spec.moe.is_moe_layer(i):
            rules += _moe(spec, f"{our}.feed_forward", f"{hf}.mlp", available)
        else:
            rules += _mlp(spec, f"{our}.feed_forward", f"{hf}.mlp")
    return rules


def _gpt2(spec: ModelSpec, available: set[str] | None) -> list[Rule]:
    p = "transformer." if available is None or "transformer.wte.weight" in available else ""
    rules: list[Rule] = [Same(("tok_embeddings.weight",), (f"{p}wte.weight",)),
                         Same(("pos_embeddings.weight",), (f"{p}wpe.weight",)),
                         Same(("norm.weight",), (f"{p}ln_f.weight",)), Same(("norm.bias",), (f"{p}ln_f.bias",)),
                         Same(("output.weight",), (f"{p}wte.weight",))]
    for i in range(spec.n_layers):
        our, hf = f"layers.{i}", f"{p}h.{i}"
        for ours, theirs in (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")):
            rules += [Same((f"{our}.{ours}.{leaf}",), (f"{hf}.{theirs}.{leaf}",)) for leaf in ("weight", "bias")]
        qkv = tuple(f"{our}.attention.{n}" for n in ("wq", "wk", "wv"))
        rules += [Split(tuple(f"{n}.weight" for n in qkv), (f"{hf}.attn.c_attn.weight",), dim=1, transpose=True),
                  Split(tuple(f"{n}.bias" for n in qkv), (f"{hf}.attn.c_attn.bias",), dim=0)]
        for ours, theirs in (("attention.wo", "attn.c_proj"), ("feed_forward.w1", "mlp.c_fc"),
                             ("feed_forward.w2", "mlp.c_proj")):
            rules += [Transposed((f"{our}.{ours}.weight",), (f"{hf}.{theirs}.weight",)),
                      Same((f"{our}.{ours}.bias",), (f"{hf}.{theirs}.bias",))]
    return rules


def rules_for(spec: ModelSpec, available: set[str] | None = None) -> dict[str, Rule]:
    """Our FQN -> its rule, for the spec's family; `available` (a directory's keys) picks the on-disk layout."""
    if spec.family == "gpt2":
        rules = _gpt2(spec, available)
    elif spec.position == "learned" or spec.norm == "layernorm":
        raise UsageError(f"model {spec.name!r} ({spec.family or 'meshplan'}'s GPT-style layers) has no Hugging "
                         "Face layout meshplan writes; Llama-style (rmsnorm, swiglu, rope) and GPT-2 models do")
    else:
        rules = _llama_like(spec, available)
    return {fqn: rule for rule in rules for fqn in rule.ours}


def export_rules(spec: ModelSpec) -> list[Rule]:
    """The rules an export writes, each once, without the tied output layer (save_pretrained drops it too)."""
    unique = {id(rule): rule for rule in rules_for(spec).values()}
    tied = "output.weight" if spec.tie_embeddings else None
    return [r for r in unique.values() if tied not in r.ours]

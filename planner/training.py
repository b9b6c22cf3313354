"""TrainingSpec: batch, sequence, precision and optimizer of a run.

Orthogonal to the model and the cluster. The global batch counts sequences;
tokens per step = global_batch_size * seq_len.

Two precisions: `dtype` is what activations, norms, attention and the stored
low-precision weights are kept in; `precision` is how the block GEMMs run.
For bf16/fp16/fp32 they are the same. For fp8 (per-tensor scaling, Hopper and
later: Transformer Engine's delayed/current scaling, torchao's float8) and
mxfp8 (32-element block scaling, Blackwell only) the GEMM operands are cast to
8 bits around a bf16 (or fp16) model: `dtype` stays the 16-bit type. What each
engine keeps in higher precision is its recipe (planner.engines).

`attention` ("fused" | "eager") names the attention kernel; "" means the
engine's default and is resolved when a plan is built. `compile` is
torch.compile per block (torchtitan's and meshplan's engines). `cuda_graphs`,
`moe_router_graphs`, `moe_grouped_gemm` and `moe_router_fusion` are recipe options of Megatron-Core /
Transformer Engine stacks that change how many operations the host dispatches
(planner.simulate.launches); `moe_a2a_overlap` (Megatron-Core's
--overlap-moe-expert-parallel-comm) runs one micro-batch's expert all-to-alls
under another's compute (planner.simulate.step). `async_tp` pipelines the tensor-parallel
all-gathers and reduce-scatters of sequence parallelism with the GEMMs that
consume or produce them (torchtitan's enable_async_tensor_parallel under
torch.compile, Megatron-Core's --tp-comm-overlap with Transformer Engine's
userbuffers; planner.simulate.tp_overlap). `tp_overlap_cfg` names the
userbuffers config whose SM claims the overlap pays (planner.engines.megatron).
`fp8_params` and `fused_cross_entropy` change only memory: 8-bit parameters
instead of 16-bit weights with 8-bit copies, and Transformer Engine's loss
that keeps only the compute-dtype logits (planner.memory; torchtitan compiles
its loss with --compile instead, from its 2025-06 release).

`finetune` ("full" | "lora" | "qlora") says which weights train. LoRA (Hu et
al. 2021) freezes the base weights in the compute dtype and trains, beside
each target linear W (out x in), lora_A (rank x in) and lora_B (out x rank),
adding (alpha / rank) * B A x to W x; QLoRA (Dettmers et al. 2023) stores the
frozen base in 4-bit NF4. `lora_targets` names the adapted linears
(LORA_TARGETS); the default is every linear of the blocks, as QLoRA found
adapters on all of them needed to match full fine-tuning and as PEFT's
"all-linear" does. The rules of what LoRA keeps and costs are
planner.memory.lora and planner.simulate.lora. plan.json writes the four keys
only for a LoRA plan (a full plan's training is unchanged).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from topologies.errors import PlanError, UsageError

DTYPES = ("bf16", "fp16", "fp32")
PRECISIONS = (*DTYPES, "fp8", "mxfp8")
FP8_PRECISIONS = ("fp8", "mxfp8")
ATTENTION_KINDS = ("fused", "eager")
OPTIMIZERS = ("adamw", "sgd")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Sequences per step or tokens per sequence beyond 2^24 (16.7M) are typos, not runs.
MAX_SIZE = 1 << 24
# Tokens per optimizer step: 256x the largest published batch (16M tokens, Llama 3
# 405B); beyond it the search would enumerate millions of data-parallel shapes.
MAX_TOKENS_PER_STEP = 1 << 32
# Recipe options of the training stack, optional in plan.json: the first six change the host time or
# the overlap (planner.simulate), the last three only memory (planner.memory).
_OPTIONAL_KEYS = {"cuda_graphs": False, "moe_grouped_gemm": True, "async_tp": False, "moe_router_fusion": False,
                  "moe_router_graphs": False, "moe_a2a_overlap": False, "fp8_params": False,
                  "fused_cross_entropy": False, "optimizer_dtype": "fp32", "tp_overlap_cfg": ""}
# what Adam's moments (SGD's momentum) may be stored in: Megatron-Core's precision-aware optimizer
# (--use-precision-aware-optimizer --exp-avg-dtype / --exp-avg-sq-dtype, Transformer Engine's FusedAdam)
OPTIMIZER_DTYPES = ("fp32", "bf16", "fp16")

FINETUNE_KINDS = ("full", "lora", "qlora")
# the block linears an adapter may sit beside, by their Hugging Face names (q_proj ... down_proj)
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
DEFAULT_LORA_RANK = 16
DEFAULT_LORA_ALPHA = 32.0
MAX_LORA_RANK = 4096
# written to plan.json only when finetune is not "full"; LORA_FIELDS: their names
_LORA_KEYS = {"finetune": "full", "lora_rank": DEFAULT_LORA_RANK, "lora_alpha": DEFAULT_LORA_ALPHA,
              "lora_targets": LORA_TARGETS}
LORA_FIELDS = tuple(_LORA_KEYS)

# The recipe options `plan --recipe KEY=VALUE` sets (async_tp has its own flag, --async-tp); grad_dtype is
# a training key every plan.json writes: the dtype gradients are kept and reduced in (Megatron's
# grad_reduce_in_fp32 off: bf16)
RECIPE_KEYS = (*(k for k in _OPTIONAL_KEYS if k != "async_tp"), "grad_dtype")


def parse_recipe(items: tuple[str, ...] | list[str]) -> dict[str, bool | str]:
    """`plan --recipe cuda_graphs=true --recipe optimizer_dtype=bf16` -> {key: value}; a UsageError names what
    is wrong."""
    out: dict[str, bool | str] = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in RECIPE_KEYS:
            raise UsageError(f"--recipe {item!r}: expected KEY=VALUE with KEY one of {', '.join(RECIPE_KEYS)}")
        if key in out:
            raise UsageError(f"--recipe {key} given twice; give each option once")
        text = value.strip().lower()
        if key in ("optimizer_dtype", "grad_dtype"):
            allowed = OPTIMIZER_DTYPES if key == "optimizer_dtype" else DTYPES
            if text not in allowed:
                raise UsageError(f"--recipe {item!r}: {key} takes {', '.join(allowed)}, got {value!r}")
            out[key] = text
        elif key == "tp_overlap_cfg":  # a name the engine checks (Engine.tp_overlap_configs)
            if not text or not text.replace("_", "").isalnum():
                raise UsageError(f"--recipe {item!r}: tp_overlap_cfg takes the name of a userbuffers config "
                                 "(letters, digits and underscores), e.g. userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192")
            out[key] = text
        elif text in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            out[key] = text in ("true", "1", "yes", "on")
        else:
            raise UsageError(f"--recipe {item!r}: {key} takes true or false, got {value!r}")
    return out


# Default global batch: about one million tokens a step, the order of magnitude
# Llama 2/3 and GPT-3 trained with (GPT-3 175B: 3.2M; Llama 2: 4M; smaller
# models ~0.5-1M). The search rounds it to a multiple its layout needs.
DEFAULT_TOKENS_PER_STEP = 1 << 20
# Default sequence length cap: the model's native context, at most 4096.
DEFAULT_MAX_SEQ_LEN = 4096


@dataclass(frozen=True)
class TrainingSpec:
    seq_len: int  # tokens per sequence
    global_batch_size: int  # sequences per optimizer step, all replicas together
    dtype: str = "bf16"  # compute dtype of matmuls and activations
    optimizer: str = "adamw"  # adamw: two fp32 moments; sgd: one fp32 momentum
    grad_dtype: str = "fp32"  # dtype gradients are reduced and kept in
    precision: str = ""  # how block GEMMs run: bf16 | fp16 | fp32 | fp8 | mxfp8 ("" = dtype)
    attention: str = ""  # fused | eager ("" = the engine's default, resolved in a plan)
    compile: bool = False  # torch.compile per transformer block
    cuda_graphs: bool = False  # layers replayed as CUDA graphs (Megatron-Core/TE --enable-cuda-graph)
    moe_grouped_gemm: bool = True  # routed experts as one grouped GEMM per matrix (else one MLP per local expert)
    async_tp: bool = False  # TP collectives pipelined with their GEMMs (needs tp > 1 with sequence parallel)
    moe_router_fusion: bool = False  # score function, top-k and aux-loss scores as fused TE kernels (--moe-router-fusion)
    moe_router_graphs: bool = False  # only the router + dispatch preprocessing as CUDA graphs (--cuda-graph-scope)
    # expert all-to-alls of one micro-batch overlapped with another's compute (--overlap-moe-expert-parallel-comm)
    moe_a2a_overlap: bool = False
    # the block-linear weights are stored as 8-bit tensors, no 16-bit copy (Transformer Engine's
    # quantized_model_init; Megatron-Core --fp8-param-gather, which Megatron-Bridge's fp8 and mxfp8
    # recipes turn on): needs precision fp8 or mxfp8 and an engine whose Fp8Recipe has primary_weights
    fp8_params: bool = False
    # the loss is one kernel that writes the logits' gradient into the compute-dtype logits in its
    # forward (Transformer Engine's parallel_cross_entropy: Megatron-Core --cross-entropy-loss-fusion
    # --cross-entropy-fusion-impl te, Megatron-Bridge's performance recipes): no fp32 logits
    fused_cross_entropy: bool = False
    optimizer_dtype: str = "fp32"  # the optimizer's moments (OPTIMIZER_DTYPES); master weights stay fp32
    # under async TP, the named userbuffers config whose SMs each overlapped collective takes from its GEMM
    # (Engine.tp_overlap_configs: NeMo's and Megatron-Bridge's configs); "" = the engine's default
    tp_overlap_cfg: str = ""
    finetune: str = "full"  # full | lora | qlora (FINETUNE_KINDS; module docstring)
    lora_rank: int = DEFAULT_LORA_RANK  # r: the adapters' inner width
    lora_alpha: float = DEFAULT_LORA_ALPHA  # the adapters' output is scaled by alpha / r
    lora_targets: tuple[str, ...] = LORA_TARGETS  # adapted linears (LORA_TARGETS), in that order

    def __post_init__(self) -> None:
        for key in ("seq_len", "global_batch_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"training: {key} must be a positive integer, got {value!r}")
            if value > MAX_SIZE:
                raise PlanError(f"training: {key} = {value} is absurd (at most {MAX_SIZE}); check the value")
        if self.seq_len * self.global_batch_size > MAX_TOKENS_PER_STEP:
            raise PlanError(f"training: seq_len ({self.seq_len}) x global_batch_size ({self.global_batch_size}) = "
                            f"{self.seq_len * self.global_batch_size:,} tokens per step, more than "
                            f"{MAX_TOKENS_PER_STEP:,}: use a smaller --global-batch")
        if self.dtype not in DTYPES:
            raise PlanError(f"training: dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.grad_dtype not in DTYPES:
            raise PlanError(f"training: grad_dtype must be one of {DTYPES}, got {self.grad_dtype!r}")
        if self.optimizer not in OPTIMIZERS:
            raise PlanError(f"training: optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.precision == "":
            object.__setattr__(self, "precision", self.dtype)
        if self.precision not in PRECISIONS:
            raise PlanError(f"training: precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.precision in DTYPES and self.precision != self.dtype:
            raise PlanError(f"training: precision {self.precision!r} with dtype {self.dtype!r}: a 16/32-bit "
                            "precision is the dtype itself; set both alike (--precision sets both)")
        if self.precision in FP8_PRECISIONS and self.dtype == "fp32":
            raise PlanError(f"training: precision {self.precision} runs around a bf16 or fp16 model, got dtype fp32")
        if self.fp8_params is True and not self.fp8:
            raise PlanError(f"training: fp8_params keeps the weights in 8 bits, which needs precision fp8 or mxfp8, "
                            f"got {self.precision}; drop fp8_params or set the precision")
        if self.attention not in ("", *ATTENTION_KINDS):
            raise PlanError(f"training: attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if not isinstance(self.tp_overlap_cfg, str):
            raise PlanError(f"training: tp_overlap_cfg must be a config name, got {self.tp_overlap_cfg!r}")
        if self.optimizer_dtype not in OPTIMIZER_DTYPES:
            raise PlanError(f"training: optimizer_dtype must be one of {OPTIMIZER_DTYPES}, got {self.optimizer_dtype!r}")
        self._check_lora()
        for key in ("compile", *(k for k, v in _OPTIONAL_KEYS.items() if isinstance(v, bool))):
            if not isinstance(getattr(self, key), bool):
                raise PlanError(f"training: {key} must be true or false, got {getattr(self, key)!r}")

    def _check_lora(self) -> None:
        if self.finetune not in FINETUNE_KINDS:
            raise PlanError(f"training: finetune must be one of {FINETUNE_KINDS}, got {self.finetune!r}")
        rank = self.lora_rank
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_LORA_RANK:
            raise PlanError(f"training: lora_rank must be an integer in 1..{MAX_LORA_RANK}, got {rank!r}")
        alpha = self.lora_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < float("inf"):
            raise PlanError(f"training: lora_alpha must be a positive number, got {alpha!r}")
        object.__setattr__(self, "lora_alpha", float(alpha))
        targets = self.lora_targets
        if isinstance(targets, str) or not isinstance(targets, (list, tuple)):
            raise PlanError(f"training: lora_targets must be a list of {', '.join(LORA_TARGETS)}, got {targets!r}")
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or not targets or len(set(targets)) != len(targets):
            raise PlanError(f"training: lora_targets {list(targets)!r}: give each of {', '.join(LORA_TARGETS)} at "
                            "most once, at least one")
        object.__setattr__(self, "lora_targets", tuple(t for t in LORA_TARGETS if t in targets))
        if self.finetune == "qlora" and self.dtype == "fp32":
            raise PlanError("training: QLoRA computes in bf16 or fp16 around its 4-bit base, got dtype fp32")

    @property
    def lora(self) -> bool:
        """Adapters train and the base is frozen (LoRA or QLoRA)."""
        return self.finetune != "full"

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch_size

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def fp8(self) -> bool:
        """Block GEMMs run in 8 bits (per-tensor fp8 or block-scaled mxfp8)."""
        return self.precision in FP8_PRECISIONS

    def fused_attention(self, engine_default: bool) -> bool:
        """The attention kernel: the training's choice, else the engine's default."""
        return engine_default if self.attention == "" else self.attention == "fused"

    def replace(self, **changes: Any) -> TrainingSpec:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """plan.json's training; the recipe options (_OPTIONAL_KEYS) are optional keys written only
        when they differ from their defaults (plans without them load as before)."""
        data = dataclasses.asdict(self)
        for key, default in _OPTIONAL_KEYS.items():
            if data[key] == default:
                del data[key]
        if not self.lora:
            for key in _LORA_KEYS:
                del data[key]
        else:
            data["lora_targets"] = list(self.lora_targets)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainingSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        missing = [k for k in ("seq_len", "global_batch_size") if k not in data]
        if missing:
            raise PlanError(f"plan.json 'training' is missing keys: {', '.join(missing)}")
        return cls(**{k: (tuple(v) if k == "lora_targets" and isinstance(v, list) else v)
                      for k, v in data.items() if k in known})


def parse_lora_targets(text: str) -> tuple[str, ...]:
    """`--lora-targets q,k,v,o` -> ("q", "k", "v", "o"); "all" is every block linear. A UsageError names what
    is wrong."""
    if text.strip().lower() in ("all", "all-linear"):
        return LORA_TARGETS
    names = tuple(part.strip().lower().removesuffix("_proj") for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in LORA_TARGETS]
    if unknown or not names:
        raise UsageError(f"--lora-targets {text!r}: expected names from {','.join(LORA_TARGETS)} separated by "
                         f"commas (or all){'; unknown: ' + ', '.join(unknown) if unknown else ''}")
    if len(set(names)) != len(names):
        raise UsageError(f"--lora-targets {text!r}: a target is named twice; give each once")
    return tuple(t for t in LORA_TARGETS if t in names)


def training_for(seq_len: int, global_batch_size: int, precision: str = "bf16", **rest: Any) -> TrainingSpec:
    """A TrainingSpec from a `--precision` value: fp8/mxfp8 keep a bf16 model, others are the dtype."""
    dtype = "bf16" if precision in FP8_PRECISIONS else precision
    return TrainingSpec(seq_len=seq_len, global_batch_size=global_batch_size, dtype=dtype, precision=precision,
                        **rest)


def default_seq_len(model_max_seq_len: int) -> int:
    return min(model_max_seq_len, DEFAULT_MAX_SEQ_LEN)


# CPU ranks (the `cpu` cluster) run the executor for tests and smoke runs: a
# step of 1M tokens would need tens of GiB of host memory, so a few thousand.
DEFAULT_CPU_TOKENS_PER_STEP = 1 << 11


def default_global_batch(seq_len: int, on_gpu: bool = True) -> int:
    """About 1M tokens a step on GPUs (2K on CPU ranks), at least one sequence."""
    tokens = DEFAULT_TOKENS_PER_STEP if on_gpu else DEFAULT_CPU_TOKENS_PER_STEP
    return max(1, tokens // seq_len)

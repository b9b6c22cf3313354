"""TrainingSpec: batch, sequence, precision and optimizer of a run.

Orthogonal to the model and the cluster. The global batch counts sequences;
tokens per step = global_batch_size * seq_len.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from topologies.errors import PlanError

DTYPES = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adamw", "sgd")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Sequences per step or tokens per sequence beyond 2^24 (16.7M) are typos, not runs.
MAX_SIZE = 1 << 24
# Tokens per optimizer step: 256x the largest published batch (16M tokens, Llama 3
# 405B); beyond it the search would enumerate millions of data-parallel shapes.
MAX_TOKENS_PER_STEP = 1 << 32

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

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch_size

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainingSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        missing = [k for k in ("seq_len", "global_batch_size") if k not in data]
        if missing:
            raise PlanError(f"plan.json 'training' is missing keys: {', '.join(missing)}")
        return cls(**{k: v for k, v in data.items() if k in known})


def default_seq_len(model_max_seq_len: int) -> int:
    return min(model_max_seq_len, DEFAULT_MAX_SEQ_LEN)


# CPU ranks (the `cpu` cluster) run the executor for tests and smoke runs: a
# step of 1M tokens would need tens of GiB of host memory, so a few thousand.
DEFAULT_CPU_TOKENS_PER_STEP = 1 << 11


def default_global_batch(seq_len: int, on_gpu: bool = True) -> int:
    """About 1M tokens a step on GPUs (2K on CPU ranks), at least one sequence."""
    tokens = DEFAULT_TOKENS_PER_STEP if on_gpu else DEFAULT_CPU_TOKENS_PER_STEP
    return max(1, tokens // seq_len)

"""float8 linear layers with torchao, following torchtitan's float8 converter.

The recipe (torchtitan components/quantization/float8.py, torchao.float8):
- before any parallelism, on the meta device, `convert_to_float8_training`
  swaps the nn.Linear layers of the transformer blocks for Float8Linear
  (dynamic tensorwise scaling: each GEMM casts its operands to float8 with
  scales from their current amax); the filter skips the output layer (its
  vocabulary-wide GEMM and the loss stay in bf16) and every linear whose
  weight dims are not both divisible by 16 (float8 GEMMs need them);
- under FSDP2 the converted weights are all-gathered in float8
  (`enable_fsdp_float8_all_gather`): one byte per weight instead of two;
- after each optimizer step `precompute_float8_dynamic_scale_for_fsdp`
  computes every float8 weight's scale with one all-reduce, for the next
  step's all-gathers.
torchao is imported only here and only for fp8 plans: it is not a dependency
of meshplan, so a missing install is refused with what to install. The
planner refuses fp8 on CPU ranks (planner.engines.executor_refusal): float8
GEMMs need a GPU of compute capability 8.9 or newer, checked when a worker
starts (`check_device`).
"""

from __future__ import annotations

import torch
from torch import nn

from topologies.errors import UsageError

TORCHAO_PIN = "torchao==0.18.0"  # the release that pairs with torch 2.13
OUTPUT_FQNS = ("output",)  # torchtitan's filter_fqns for Llama
MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer have float8 tensor cores


def require_torchao():  # noqa: ANN201 - a module
    """torchao.float8, or a UsageError naming what to install."""
    try:
        import torchao.float8 as float8
    except ImportError as exc:
        raise UsageError(
            f"precision fp8 needs torchao's float8 training (torchao.float8), which is not installed ({exc}); "
            f"install it beside torch with `pip install torch=={torch.__version__.split('+')[0]} {TORCHAO_PIN}`, "
            "or plan with --precision bf16"
        ) from None
    return float8


def check_device(device: torch.device) -> None:
    """float8 GEMMs need compute capability 8.9+; refuse older GPUs with the reason."""
    if device.type != "cuda":
        raise UsageError("precision fp8 runs on GPUs only (torch._scaled_mm); plan CPU ranks with --precision bf16")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise UsageError(
            f"precision fp8 needs a GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer "
            f"(H100, L4, B200...); this {torch.cuda.get_device_name(device)} is "
            f"{capability[0]}.{capability[1]}: plan with --precision bf16"
        )


def convertible(module: nn.Module, fqn: str) -> bool:
    """torchtitan's module filter: nn.Linear, both weight dims divisible by 16, not the output layer."""
    if not isinstance(module, nn.Linear) or any(name in fqn for name in OUTPUT_FQNS):
        return False
    out_features, in_features = module.weight.shape
    return out_features % 16 == 0 and in_features % 16 == 0


def convert(model: nn.Module, *, fsdp_float8_all_gather: bool) -> int:
    """Swap the convertible linears of `model` (meta device is fine) for Float8Linear; returns how many."""
    float8 = require_torchao()
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    float8.convert_to_float8_training(model, module_filter_fn=convertible, config=config)
    from torchao.float8.float8_linear import Float8Linear

    return sum(1 for m in model.modules() if isinstance(m, Float8Linear))


def precompute_scales(parts: list[nn.Module]) -> None:
    """After the optimizer step: the float8 weights' scales for the next all-gathers (one all-reduce)."""
    float8 = require_torchao()
    for part in parts:
        float8.precompute_float8_dynamic_scale_for_fsdp(part)

"""Candidate layouts: what the search enumerates, and the rules that keep the space small.

A candidate is a Layout. The search builds them in two levels:

* a *shape* fixes the mesh (pp, dp_replicate, dp_shard, cp, tp, ep), the ZeRO
  stage, sequence parallelism, the pipeline schedule and its virtual stages;
* a *leaf* adds the micro-batch size (hence grad_accum_steps) and the
  recomputation, which is where memory is decided.

Rules that bound the space (each is a hard constraint, a dominance argument
or a stated heuristic; a flag the user pins always overrides a heuristic):

R1  tp divides both the attention and the KV head counts (hard).
R2  pp * virtual_stages <= layers (hard); cp divides seq_len, and with
    sequence parallel tp * cp does too (hard).
R3  Heuristic: unpinned cp > 1 only while every CP rank keeps at least
    MIN_CP_TOKENS tokens; below that attention is too small for CP's K/V
    exchange to pay off.
R4  ZeRO stage 0 <=> dp_shard == 1 (the Layout's own rule); ZeRO 1-3 for
    every dp_shard > 1 dividing dp, and ZeRO-2/3 over the cp ranks alone
    (dp 1, cp > 1: torchtitan's FSDP 1 x CP 8) beside stage 0.
R5  With tp > 1 both sequence parallel on and off are searched. SP shards
    the norm/dropout activations tp ways (never more memory) and its
    reduce-scatter + all-gather move the same bytes as the all-reduce it
    replaces, yet it is not dominated in time: on NVSwitch with NVLS the
    switch reduces an all-reduce in one pass, which the collective model
    prices below RS + AG.
R6  GPipe is searched next to 1F1B: it keeps every micro-batch's activations
    alive, but its all-forward-then-all-backward order overlaps the gradient
    reduction differently, and the event simulation can find it faster. It is
    the only schedule that runs grad_accum_steps < pp.
R7  Interleaved 1F1B uses virtual stages that split each rank's layers
    evenly (v divides layers / pp) and needs grad_accum_steps % pp == 0,
    as Megatron's and torch.distributed.pipelining's schedules do. ZB-V uses
    exactly 2 chunks per rank.
R8  Micro-batch sizes divide the per-replica batch. Memory never falls as
    the micro-batch grows, so a recomputation level that failed at a smaller
    micro-batch is not tried again at a larger one (see planner.search.search).
R9  Dominance: for a fixed shape and micro-batch, the lightest recomputation
    that fits wins (more recomputation only adds FLOPs). Offload
    (`Pins.offload`): none unless asked; pinned, that kind; "auto", every kind
    the engine runs (planner.engines.Engine.offload_kinds), each its own
    search, ranked together (planner.simulate.offload prices the host link,
    the host's optimizer step and the node's RAM; a cluster that does not
    state its host is searched without offload).
R10 MoE: ep divides the expert count, etp the experts' inner size, and
    ep * etp the ranks of a stage's replica, dp_shard * cp * tp (the expert
    grid of planner.layout). Unpinned etp is 1 or tp: etp = tp lines the
    expert shards up with the dense TP groups (Megatron-Core's default),
    etp 1 keeps experts whole (DeepSeek's and Qwen3's recipes); other values
    split experts across TP groups for no saving either of them lacks.
    Heuristic: unpinned ep is a power of two or the expert count (384
    experts: 1, 2, ..., 128, 384), as published recipes use; the odd
    divisors in between (3, 6, 12, ...) multiply the space for layouts no
    recipe runs. Dense models use ep = etp = 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from math import gcd

from planner.layout import OFFLOAD_KINDS, PP_SCHEDULES, RECOMPUTE_KINDS, RECOMPUTE_MODULES, Layout, divisors
from planner.model.spec import ModelSpec
from topologies.errors import UsageError

MIN_CP_TOKENS = 1024  # R3: smallest sequence chunk per CP rank the search proposes on its own
BATCH_TOLERANCE = 0.25  # a default global batch may move this far from ~1M tokens to suit dp


@dataclass(frozen=True)
class Pins:
    """What the user fixed on the command line; None leaves the option to the search."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None  # total data parallel degree, dp_replicate * dp_shard
    dp_shard: int | None = None
    cp: int | None = None
    zero_stage: int | None = None
    micro_batch_size: int | None = None
    recompute: str | None = None
    sequence_parallel: bool | None = None
    pp_schedule: str | None = None
    virtual_stages: int | None = None
    offload: str | None = None
    ep: int | None = None  # expert parallelism (MoE)
    etp: int | None = None  # expert tensor parallelism (MoE)
    # Megatron-Core's --recompute-modules: on every layout whose recompute is "selective" (Layout.recompute_modules)
    recompute_modules: tuple[str, ...] | None = None
    # layers of each pipeline chunk (Layout.layers_per_stage: Megatron's --decoder-first/last-pipeline-num-layers
    # split), for the pinned pp x virtual stages
    layers_per_stage: tuple[int, ...] | None = None
    # layers per chunk whose activations wait in host memory (Layout.activation_offload_layers: Megatron-Core's
    # cpu_offloading_num_layers)
    activation_offload_layers: int | None = None

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "dp", "dp_shard", "cp", "micro_batch_size", "virtual_stages", "ep", "etp"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise UsageError(f"--{key.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.zero_stage not in (None, 0, 1, 2, 3):
            raise UsageError(f"--zero must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        for key, allowed in (("recompute", RECOMPUTE_KINDS), ("pp_schedule", PP_SCHEDULES),
                             ("offload", (*OFFLOAD_KINDS, "auto"))):
            value = getattr(self, key)
            if value is not None and value not in allowed:
                raise UsageError(f"--{key.replace('_', '-')} must be one of {', '.join(allowed)}, got {value!r}")
        self._check_recompute_modules()
        self._check_consistency()

    def _check_recompute_modules(self) -> None:
        modules = self.recompute_modules
        if modules is None:
            return
        unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
        if unknown or not modules or len(set(modules)) != len(modules):
            why = f"unknown {', '.join(unknown)}" if unknown else "a module named twice" if modules else "no module"
            raise UsageError(f"--recompute-modules {','.join(modules)}: {why}; Megatron-Core's modules are "
                             f"{', '.join(RECOMPUTE_MODULES)}")
        if self.recompute != "selective":
            raise UsageError(f"--recompute-modules {','.join(modules)} names what selective recomputation redoes, "
                             f"but --recompute is {self.recompute}; use --recompute selective (or leave it out)")

    def _check_consistency(self) -> None:
        if self.zero_stage == 0 and self.dp_shard not in (None, 1):
            raise UsageError(f"--zero 0 shards nothing, so --dp-shard must be 1, got {self.dp_shard}; "
                             "use --zero 1-3 to shard")
        if self.zero_stage in (1, 2, 3) and self.dp_shard == 1 and (self.cp or 1) == 1:
            raise UsageError(f"--zero {self.zero_stage} shards over dp_shard x cp, but --dp-shard is 1 and --cp "
                             f"{self.cp or 'is not given'}; use --zero 0, a larger --dp-shard or --cp > 1")
        if self.dp is not None and self.dp_shard is not None and self.dp % self.dp_shard:
            raise UsageError(f"--dp-shard ({self.dp_shard}) must divide --dp ({self.dp}), "
                             "the total data-parallel degree dp_replicate * dp_shard")
        if self.sequence_parallel and self.tp == 1:
            raise UsageError("--sequence-parallel needs --tp > 1")
        v, sched = self.virtual_stages, self.pp_schedule
        if v is not None and sched is not None:
            Layout(pp=2, pp_schedule=sched, virtual_stages=v)  # raises PlanError (exit 2) with the rule
        if self.pp == 1 and ((v or 1) > 1 or sched in ("interleaved-1f1b", "zb-v", "dualpipev")):
            raise UsageError("--pp 1 has no pipeline: drop --pp-schedule/--virtual-stages or pin --pp > 1")
        lps = self.layers_per_stage
        if lps is not None:
            chunks = (self.pp or 0) * (v or len(lps) // (self.pp or 1))
            if self.pp is None or len(lps) != chunks or not lps or min(lps) < 1:
                raise UsageError(f"--layers-per-stage {','.join(map(str, lps))} gives the layers of each pipeline "
                                 f"chunk: one count >= 1 per chunk, --pp x virtual stages of them (--pp "
                                 f"{self.pp or 'not pinned'}, --virtual-stages {v or 'any'}); pin --pp and give a "
                                 "multiple of it")
        if self.activation_offload_layers is not None and self.activation_offload_layers < 0:
            raise UsageError(f"--activation-offload-layers must be >= 0, got {self.activation_offload_layers}")

    def pinned(self) -> dict[str, object]:
        """The options the user fixed, by name, for messages and for checking a result."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def to_json(self) -> dict[str, object]:
        """plan.json's search.pins: the pinned options by field name (lists for tuples)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.pinned().items()}

    @classmethod
    def from_json(cls, data: dict) -> Pins:
        """Pins from to_json's object; unknown names are a UsageError (a plan from a newer meshplan?)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise UsageError(f"plan.json search.pins has unknown options {unknown}; known: {sorted(names)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


@lru_cache(maxsize=1024)

def _choices(pinned: int | None, allowed: tuple[int, ...]) -> tuple[int, ...]:
    if pinned is None:
        return allowed
    return (pinned,) if pinned in allowed else ()


def global_batch_for(dp: int, unit: int, target: int, fixed: bool) -> int | None:
    """The global batch (sequences) a layout with this dp runs, or None when it cannot.

    `unit` is what one optimizer step must be a multiple of: dp, times the
    micro-batch when that is pinned. A batch the user gave (`fixed`) must be a
    multiple of it. The default batch (~1M tokens) is rounded to the nearest
    multiple, at least one unit, and refused when that moves it more than
    BATCH_TOLERANCE away: such a layout would win or lose on a different batch.
    """
    if fixed:
        return target if target % unit == 0 else None
    batch = unit * max(1, round(target / unit))
    return batch if abs(batch - target) <= BATCH_TOLERANCE * target else None


def mesh_degrees(n_gpus: int, model: ModelSpec, seq_len: int, pins: Pins) -> Iterator[tuple[int, int, int, int]]:
    """(pp, dp, cp, tp) with pp * dp * cp * tp == n_gpus under R1-R3 and the pins."""
    heads = gcd(model.n_heads, model.n_kv_heads)
    for tp in _choices(pins.tp, tuple(d for d in divisors(n_gpus) if heads % d == 0)):
        for pp in _choices(pins.pp, tuple(d for d in divisors(n_gpus // tp) if d <= model.n_layers)):
            rest = n_gpus // (tp * pp)
            cps = tuple(c for c in divisors(rest) if seq_len % c == 0
                        and (pins.cp is not None or c == 1 or seq_len // c >= MIN_CP_TOKENS))
            for cp in _choices(pins.cp, cps):
                dp = rest // cp
                if pins.dp is None or pins.dp == dp:
                    yield pp, dp, cp, tp


def data_parallel_splits(dp: int, pins: Pins, cp: int = 1) -> Iterator[tuple[int, int, int]]:
    """(dp_replicate, dp_shard, zero_stage) for a data-parallel degree and the cp degree beside it, under R4."""
    shards = _choices(pins.dp_shard, divisors(dp))
    for dp_shard in shards:
        zeros = (1, 2, 3) if dp_shard > 1 else (0, 2, 3) if dp == 1 and cp > 1 else (0,)
        for zero in zeros:
            if pins.zero_stage is None or pins.zero_stage == zero:
                yield dp // dp_shard, dp_shard, zero


@lru_cache(maxsize=4096)
def expert_degrees(model: ModelSpec, dp_shard: int, cp: int, tp: int = 1, ep_pin: int | None = None,
                   etp_pin: int | None = None) -> tuple[tuple[int, int], ...]:
    """R10: (ep, etp) pairs for a MoE model; ((1, 1),) for a dense one."""
    if model.moe is None:
        return ((1, 1),) if ep_pin in (None, 1) and etp_pin in (None, 1) else ()
    ranks = dp_shard * cp * tp
    etps = (etp_pin,) if etp_pin is not None else tuple(sorted({1, tp}))
    out = []
    for etp in etps:
        if model.moe.expert_ffn_hidden % etp:
            continue
        eps = tuple(e for e in divisors(model.moe.n_experts) if e & (e - 1) == 0 or e == model.moe.n_experts)
        for ep in _choices(ep_pin, eps if ep_pin is None else divisors(model.moe.n_experts)):
            if ranks % (ep * etp) == 0:
                out.append((ep, etp))
    return tuple(out)


def sequence_parallel_options(tp: int, cp: int, seq_len: int, pins: Pins) -> tuple[bool, ...]:
    """R5: SP on and off when tp > 1 and the sequence splits evenly over tp * cp; the pinned value only."""
    can = tp > 1 and seq_len % (tp * cp) == 0
    options = (True, False) if can else (False,)
    if pins.sequence_parallel is not None:
        return tuple(o for o in options if o == pins.sequence_parallel)
    return options


def schedules(pp: int, n_layers: int, pins: Pins, overlapped: bool = False) -> tuple[tuple[str, int], ...]:
    """(pp_schedule, virtual_stages) pairs for a pipeline depth, under R2 and R7; DualPipeV where `overlapped`
    (the engine runs it: Engine.pp_schedules) or pinned."""
    if pp == 1:
        if pins.pp_schedule not in (None, "gpipe", "1f1b") or pins.virtual_stages not in (None, 1):
            return ()
        return ((pins.pp_schedule or "1f1b", 1),)
    options: list[tuple[str, int]] = [("1f1b", 1), ("gpipe", 1)]
    if n_layers % pp == 0:
        options += [("interleaved-1f1b", v) for v in divisors(n_layers // pp) if v >= 2]
    elif 2 * pp <= n_layers:
        options.append(("interleaved-1f1b", 2))
    if 2 * pp <= n_layers:
        options.append(("zb-v", 2))
        if overlapped or pins.pp_schedule == "dualpipev":
            options.append(("dualpipev", 2))
    if pins.pp_schedule is not None:
        options = [o for o in options if o[0] == pins.pp_schedule]
        if pins.pp_schedule == "interleaved-1f1b" and pins.virtual_stages is not None:
            v = pins.virtual_stages
            options = [("interleaved-1f1b", v)] if pp * v <= n_layers else []
    if pins.virtual_stages is not None:
        options = [o for o in options if o[1] == pins.virtual_stages]
    if pins.layers_per_stage is not None:  # the pinned split fixes the chunks per rank, even or not
        v = len(pins.layers_per_stage) // pp
        kinds = ("1f1b", "gpipe") if v == 1 else ("interleaved-1f1b", "zb-v", "dualpipev") if v == 2 \
            else ("interleaved-1f1b",)
        options = [(kind, v) for kind in kinds if pins.pp_schedule in (None, kind)
                   and (kind != "dualpipev" or overlapped or pins.pp_schedule == kind)]
    return tuple(options)


def pipeline_allows(layout: Layout, grad_accum_steps: int, needs_pp_microbatches: bool = True) -> bool:
    """Whether a schedule can run this many micro-batches: interleaved 1F1B in groups of pp (plan.validate's
    rule), and at least pp of them for a 1F1B-like schedule where the engine's pipeline needs it
    (planner.engines.mechanisms.Pipeline.needs_pp_microbatches; Engine.microbatch_refusal says why)."""
    if layout.pp == 1 or layout.pp_schedule == "gpipe":
        return True
    if grad_accum_steps < layout.pp and needs_pp_microbatches:
        return False
    if layout.pp_schedule == "dualpipev":  # DualPipeV asserts 2 pp micro-batches (both implementations)
        return grad_accum_steps >= 2 * layout.pp
    return layout.pp_schedule != "interleaved-1f1b" or grad_accum_steps % layout.pp == 0


@dataclass(frozen=True)
class ShapeGroup:
    """Shapes that share a mesh (pp, dp, cp, tp) and sequence parallelism.

    They differ only in `splits`, (dp_replicate, dp_shard, zero_stage, ep, etp),
    and `schedules`; `shapes` yields split by split, schedule innermost. The
    search bounds a group's schedules before it builds any of its Layouts.
    """

    pp: int
    dp: int
    cp: int
    tp: int
    sequence_parallel: bool
    schedules: tuple[tuple[str, int], ...]
    splits: tuple[tuple[int, int, int, int, int], ...]
    layers_per_stage: tuple[int, ...] = ()  # pinned (Pins.layers_per_stage), for schedules with as many chunks
    activation_offload_layers: int = 0  # pinned (Pins.activation_offload_layers)

    def layout(self, split: tuple[int, int, int, int, int], schedule: tuple[str, int], offload: str) -> Layout:
        replicate, shard, zero, ep, etp = split
        lps = self.layers_per_stage if len(self.layers_per_stage) == self.pp * schedule[1] else ()
        return Layout.trusted(tp=self.tp, pp=self.pp, dp_replicate=replicate, dp_shard=shard, cp=self.cp, ep=ep,
                              etp=etp, zero_stage=zero, sequence_parallel=self.sequence_parallel,
                              pp_schedule=schedule[0], virtual_stages=schedule[1], offload=offload,
                              layers_per_stage=lps, activation_offload_layers=self.activation_offload_layers)


def shape_groups(n_gpus: int, model: ModelSpec, seq_len: int, pins: Pins,
                 dp_ok: Callable[[int], bool] = lambda dp: True, overlapped: bool = False) -> Iterator[ShapeGroup]:
    """The groups of `shapes`, in its order, for the dp that `dp_ok` accepts (DualPipeV where `overlapped`)."""
    for pp, dp, cp, tp in mesh_degrees(n_gpus, model, seq_len, pins):
        if not dp_ok(dp):
            continue
        scheds = schedules(pp, model.n_layers, pins, overlapped)
        splits = tuple((replicate, shard, zero, ep, etp) for replicate, shard, zero in data_parallel_splits(dp, pins, cp)
                       for ep, etp in expert_degrees(model, shard, cp, tp, pins.ep, pins.etp))
        for sp in sequence_parallel_options(tp, cp, seq_len, pins):
            yield ShapeGroup(pp, dp, cp, tp, sp, scheds, splits, pins.layers_per_stage or (),
                             pins.activation_offload_layers or 0)


def shapes(n_gpus: int, model: ModelSpec, seq_len: int, pins: Pins, offload: str,
           dp_ok: Callable[[int], bool] = lambda dp: True, overlapped: bool = False) -> Iterator[Layout]:
    """Every shape (leaf-free Layout, micro_batch_size 1) the search considers, for the dp that `dp_ok` accepts
    (with DualPipeV where `overlapped`: the engine runs it)."""
    for group in shape_groups(n_gpus, model, seq_len, pins, dp_ok, overlapped):
        for split in group.splits:
            for schedule in group.schedules:
                yield group.layout(split, schedule, offload)


def offload_options(pins: Pins, kinds: tuple[str, ...], host_known: bool) -> tuple[str, ...]:
    """R9: the offload levels searched: the pinned one, every kind the engine runs under "auto" (none alone
    where the cluster does not state its host), else none."""
    if pins.offload == "auto":
        return tuple(k for k in OFFLOAD_KINDS if k in kinds and (k == "none" or host_known))
    return (pins.offload or "none",)


def recompute_options(pins: Pins) -> tuple[str, ...]:
    """R9: recomputation levels from lightest to heaviest."""
    return (pins.recompute,) if pins.recompute is not None else RECOMPUTE_KINDS


def check_pins(n_gpus: int, model: ModelSpec, seq_len: int, global_batch: int | None, pins: Pins) -> None:
    """Reject pinned values no layout of this model on n_gpus can honour (UsageError, exit 2)."""
    heads = gcd(model.n_heads, model.n_kv_heads)
    if pins.tp is not None and heads % pins.tp:
        raise UsageError(f"--tp {pins.tp} must divide the attention heads ({model.n_heads}) and KV heads "
                         f"({model.n_kv_heads}) of {model.name}; try --tp in {list(divisors(heads))}")
    stages = (pins.pp or 1) * (pins.virtual_stages or 1)
    if stages > model.n_layers:
        raise UsageError(f"--pp {pins.pp or 1} x --virtual-stages {pins.virtual_stages or 1} = {stages} exceeds the "
                         f"{model.n_layers} layers of {model.name}")
    if (pins.ep or 1) * (pins.etp or 1) > 1 and model.moe is None:
        raise UsageError(f"--ep/--etp need a mixture-of-experts model; {model.name} is dense")
    if model.moe is not None and pins.ep is not None and model.moe.n_experts % pins.ep:
        raise UsageError(f"--ep {pins.ep} must divide the {model.moe.n_experts} experts of {model.name}; try --ep in "
                         f"{list(divisors(model.moe.n_experts))}")
    if model.moe is not None and pins.etp is not None and model.moe.expert_ffn_hidden % pins.etp:
        raise UsageError(f"--etp {pins.etp} must divide the experts' inner size ({model.moe.expert_ffn_hidden})")
    if (pins.ep or 1) * (pins.etp or 1) > n_gpus:
        raise UsageError(f"--ep {pins.ep or 1} x --etp {pins.etp or 1} exceeds the {n_gpus} GPUs")
    if pins.layers_per_stage is not None and sum(pins.layers_per_stage) != model.n_layers:
        raise UsageError(f"--layers-per-stage {','.join(map(str, pins.layers_per_stage))} sums to "
                         f"{sum(pins.layers_per_stage)} layers; {model.name} has {model.n_layers}")
    if pins.cp is not None and seq_len % pins.cp:
        raise UsageError(f"--cp {pins.cp} must divide the sequence length ({seq_len})")
    named = {k: getattr(pins, k) for k in ("pp", "dp", "cp", "tp") if getattr(pins, k) is not None}
    product = 1
    for value in named.values():
        product *= value
    if n_gpus % product:
        terms = " * ".join(f"{k}({v})" for k, v in named.items())
        raise UsageError(f"{terms} = {product} does not divide the {n_gpus} GPUs: pick degrees whose product divides "
                         f"{n_gpus} (the search fills in the rest)")
    if pins.dp is None and pins.dp_shard is not None and (n_gpus // product) % pins.dp_shard:
        raise UsageError(f"--dp-shard {pins.dp_shard} does not divide the {n_gpus // product} GPUs left for data "
                         "parallelism")
    if global_batch is not None and pins.dp is not None:
        unit = pins.dp * (pins.micro_batch_size or 1)
        if global_batch % unit:
            raise UsageError(f"--global-batch {global_batch} must be a multiple of dp ({pins.dp})"
                             + (f" * micro-batch ({pins.micro_batch_size})" if pins.micro_batch_size else "")
                             + f" = {unit}")

"""Layout: how one training step is laid out on the ranks, and the rank grid.

A Layout only names degrees and options; it never knows the model or cluster
(the Plan checks the combination). The rank grid is the single mapping from
axis sizes to groups of global ranks, shared by the simulator (which groups
cross nodes?) and the executor (init_device_mesh in the same order).

Mesh axes, outermost to innermost: pp, dp_replicate, dp_shard, cp, tp. TP is
innermost so a TP group is consecutive ranks and stays inside a node when it
fits; PP is outermost so stage boundaries are the only traffic that must cross
the slowest links.

Expert parallelism adds no axis of its own: as in Megatron-Core (expert rank
order tp-ep-dp) and torchtitan, the MoE layers regroup the ranks of one
pipeline stage and data-parallel replica. Flatten the inner axes (dp_shard,
cp, tp) row-major, tp fastest, to an index j = ((s*C + c)*T + t); the expert
grid reads the same j as ((e_dp * ep) + e) * etp + u:
  etp  expert tensor parallelism: etp consecutive ranks split each expert's
       matrices (etp = tp lines them up with the TP groups; etp 1 keeps
       experts whole and lets ep fold in the tp ranks, DeepSeek's recipe);
  ep   expert parallelism: ep ranks etp apart hold disjoint experts and
       exchange tokens by all-to-all; with etp = tp they are the dp_shard x cp
       ranks of one TP coordinate;
  edp  expert data parallelism: the remaining dp_shard*cp*tp / (ep*etp)
       ranks of the stage (times dp_replicate) hold the same experts; expert
       gradients are reduced and expert optimizer states sharded over it.
`expert_groups` lists them; the simulator prices the all-to-all on them.

ZeRO stage says what is sharded across dp_shard: 0 nothing (dp_shard must be
1), 1 optimizer states, 2 + gradients, 3 + parameters. HSDP is
dp_replicate > 1 with dp_shard > 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from topologies.errors import PlanError

MESH_AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Lightest first. selective: Megatron's core-attention recomputation; op:
# torchtitan's per-op selective checkpointing (planner.memory.activations);
# full: whole blocks.
RECOMPUTE_KINDS = ("none", "selective", "op", "full")
# Megatron-Core's selective recomputation modules (TransformerConfig.recompute_modules), which
# planner.memory.activations.recomputed_terms and planner.simulate.compute price; with recompute
# "selective" and no modules named, Megatron's default ["core_attn"] (SELECTIVE_DEFAULT_MODULES).
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
SELECTIVE_DEFAULT_MODULES = ("core_attn",)
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-v", "dualpipev")
# schedules of two chunks per rank in a V (rank r holds chunks r and 2 pp - 1 - r): ZB-V (Qi et al. 2024) and
# DualPipeV (DeepSeek-V3's DualPipe cut in half: deepseek-ai/DualPipe, torch's ScheduleDualPipeV)
V_SCHEDULES = ("zb-v", "dualpipev")
OFFLOAD_KINDS = ("none", "optimizer", "optimizer+params")
# No degree, micro-batch or accumulation count is larger than 2^24 in a real run.
MAX_DEGREE = 1 << 24

# The data-parallel axes, flattened in mesh order: the group that averages gradients
# (priced by planner.simulate, flattened to "dp" by executor.parallel.mesh).
DP_AXES: tuple[str, ...] = ("dp_replicate", "dp_shard")


def zero_axes(cp: int) -> tuple[str, ...]:
    """Mesh axes ZeRO shards model state over: dp_shard with the cp ranks folded in, which hold the
    same weights (Megatron's dp-cp group, torchtitan's dp_shard_cp, DeepSpeed's
    seq_data_parallel_group)."""
    return ("dp_shard", "cp") if cp > 1 else ("dp_shard",)


@dataclass(frozen=True)
class Layout:
    """Degrees and options of one candidate layout."""

    tp: int = 1  # tensor-parallel degree (Megatron-style column/row split)
    pp: int = 1  # pipeline stages
    dp_replicate: int = 1  # data-parallel replicas that hold full copies (HSDP outer)
    dp_shard: int = 1  # data-parallel ranks that shard model state by ZeRO stage
    cp: int = 1  # context-parallel degree (sequence split in attention)
    ep: int = 1  # expert-parallel degree for MoE layers (carved out of dp_shard * cp * tp, module docstring)
    etp: int = 1  # expert tensor-parallel degree: each expert's matrices split over etp ranks
    zero_stage: int = 0  # 0 DDP, 1 optimizer, 2 + grads, 3 + params sharded over dp_shard
    micro_batch_size: int = 1  # sequences per micro-batch per data-parallel rank
    grad_accum_steps: int = 1  # micro-batches per optimizer step per replica
    recompute: str = "none"  # activation recomputation: none | selective | op | full
    sequence_parallel: bool = False  # shard norms/dropout along the sequence over tp
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved-1f1b | zb-v | dualpipev
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved: >= 2; zb-v, dualpipev: 2)
    offload: str = "none"  # none | optimizer | optimizer+params (to host memory)
    layers_per_stage: tuple[int, ...] = field(default=())  # per (virtual) stage, pp*virtual_stages entries
    # full recomputation of only the first N layers of every model chunk (Megatron's
    # --recompute-method block --recompute-num-layers N); 0: every layer
    recompute_layers: int = 0
    # the activations of the first N layers of every model chunk kept in host memory between their forward
    # and backward (Megatron-Core's --cpu-offloading-num-layers, Transformer Engine's CPU offload context);
    # 0: none. Optional plan.json key parallel.activation_offload_layers
    activation_offload_layers: int = 0
    # Megatron-Core's --recompute-modules under recompute "selective" (RECOMPUTE_MODULES), a list that
    # replaces Megatron's default; (): its default, the core attention. Optional plan.json key
    # parallel.recompute_modules
    recompute_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "dp_replicate", "dp_shard", "cp", "ep", "etp", "micro_batch_size",
                    "grad_accum_steps", "virtual_stages"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"layout: {key} must be a positive integer, got {value!r}")
            if value > MAX_DEGREE:
                raise PlanError(f"layout: {key} = {value} is absurd (at most {MAX_DEGREE}); check the value")
        if self.zero_stage not in (0, 1, 2, 3):
            raise PlanError(f"layout: zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.zero_stage == 0 and self.dp_shard != 1:
            raise PlanError(
                f"layout: zero_stage 0 (plain DDP) shards nothing, so dp_shard must be 1, got {self.dp_shard}; "
                "use --zero 1-3 to shard, or move the degree to dp_replicate"
            )
        if self.zero_stage > 0 and self.dp_shard * self.cp == 1:
            raise PlanError(
                f"layout: zero_stage {self.zero_stage} shards over dp_shard x cp, which is 1; "
                "use zero_stage 0, a dp_shard > 1 or a cp > 1"
            )
        if not isinstance(self.recompute_layers, int) or isinstance(self.recompute_layers, bool) \
                or self.recompute_layers < 0:
            raise PlanError(f"layout: recompute_layers must be an integer >= 0, got {self.recompute_layers!r}")
        if self.recompute_layers and self.recompute != "full":
            raise PlanError(f"layout: recompute_layers ({self.recompute_layers}) applies to recompute 'full', "
                            f"got {self.recompute!r}")
        _check_recompute_modules(self.recompute_modules, self.recompute)
        if not isinstance(self.activation_offload_layers, int) or isinstance(self.activation_offload_layers, bool) \
                or self.activation_offload_layers < 0:
            raise PlanError("layout: activation_offload_layers must be an integer >= 0, got "
                            f"{self.activation_offload_layers!r}")
        if self.recompute not in RECOMPUTE_KINDS:
            raise PlanError(f"layout: recompute must be one of {RECOMPUTE_KINDS}, got {self.recompute!r}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise PlanError(f"layout: pp_schedule must be one of {PP_SCHEDULES}, got {self.pp_schedule!r}")
        if self.offload not in OFFLOAD_KINDS:
            raise PlanError(f"layout: offload must be one of {OFFLOAD_KINDS}, got {self.offload!r}")
        if self.pp_schedule == "interleaved-1f1b" and self.virtual_stages < 2:
            raise PlanError(f"layout: interleaved-1f1b needs virtual_stages >= 2, got {self.virtual_stages}")
        if self.pp_schedule in V_SCHEDULES and self.virtual_stages != 2:
            raise PlanError(f"layout: {self.pp_schedule} uses exactly 2 virtual stages per rank, got "
                            f"{self.virtual_stages}")
        if self.pp_schedule in ("gpipe", "1f1b") and self.virtual_stages != 1:
            raise PlanError(f"layout: {self.pp_schedule} uses 1 virtual stage, got {self.virtual_stages}")
        if self.sequence_parallel and self.tp == 1:
            raise PlanError("layout: sequence_parallel needs tp > 1")
        if (self.dp_shard * self.cp * self.tp) % (self.ep * self.etp):
            raise PlanError(
                f"layout: ep ({self.ep}) * etp ({self.etp}) must divide the ranks of a stage's replica, "
                f"dp_shard ({self.dp_shard}) * cp ({self.cp}) * tp ({self.tp}); lower --ep or --etp"
            )
        if self.layers_per_stage:
            stages = self.pp * self.virtual_stages
            if len(self.layers_per_stage) != stages or min(self.layers_per_stage) < 1:
                raise PlanError(
                    f"layout: layers_per_stage {list(self.layers_per_stage)} must have pp ({self.pp}) * "
                    f"virtual_stages ({self.virtual_stages}) = {stages} positive entries"
                )

    @property
    def dp(self) -> int:
        """Total data-parallel degree: dp_replicate * dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """Mesh axes ZeRO shards model state over (`zero_axes`)."""
        return zero_axes(self.cp)

    @property
    def shard_ranks(self) -> int:
        """Ranks of one ZeRO group (`shard_axes`): dp_shard * cp."""
        return self.dp_shard * self.cp

    @property
    def grad_axes(self) -> tuple[str, ...]:
        """Mesh axes gradients are averaged over: the data-parallel ones, and cp, whose ranks see other tokens."""
        return (*DP_AXES, "cp") if self.cp > 1 else DP_AXES

    @property
    def expert_dp_shard(self) -> int:
        """Expert data-parallel ranks within a replica: dp_shard*cp*tp / (ep*etp) (ZeRO shards experts over it)."""
        return self.dp_shard * self.cp * self.tp // (self.ep * self.etp)

    @property
    def edp(self) -> int:
        """The expert data-parallel degree: ranks that hold the same experts."""
        return self.dp_replicate * self.expert_dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in MESH_AXES)

    def stages_of(self, pp_rank: int) -> tuple[int, ...]:
        """The pipeline stages pipeline rank `pp_rank` holds, in execution order (`rank_chunks`)."""
        return rank_chunks(self.pp_schedule, self.pp, self.virtual_stages, pp_rank)

    def mesh_json(self) -> dict[str, Any]:
        """plan.json's `mesh`: axis names and sizes in rank-grid order."""
        return {"axis_names": list(MESH_AXES), "shape": list(self.mesh_shape)}

    def replace(self, **changes: Any) -> Layout:
        return dataclasses.replace(self, **changes)

    @classmethod
    def trusted(cls, **values: Any) -> Layout:
        """A Layout built without `__post_init__`'s checks, for the search's inner loops (~3x cheaper).

        Only for values that already satisfy them by construction (the
        search's enumerations; tests/unit/test_search_trusted_layouts.py
        validates every layout they can produce). Anything read from a user
        or a file goes through the checking constructor.
        """
        layout = object.__new__(cls)
        layout.__dict__.update(_DEFAULTS, **values)
        return layout

    def trusted_replace(self, **changes: Any) -> Layout:
        """`replace` without the checks, under the rule of `trusted`."""
        layout = object.__new__(Layout)
        layout.__dict__.update(self.__dict__, **changes)
        return layout

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)  # parallel.ep and parallel.etp among them
        data["layers_per_stage"] = list(self.layers_per_stage)
        data["recompute_modules"] = list(self.recompute_modules)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Layout:
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if "layers_per_stage" in kwargs:
            lps = kwargs["layers_per_stage"]
            if not isinstance(lps, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in lps):
                raise PlanError(f"parallel.layers_per_stage must be a list of integers, got {lps!r}")
            kwargs["layers_per_stage"] = tuple(lps)
        if "recompute_modules" in kwargs:  # optional: plans written before it hold Megatron's default
            modules = kwargs["recompute_modules"]
            if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
                raise PlanError(f"parallel.recompute_modules must be a list of module names, got {modules!r}")
            kwargs["recompute_modules"] = tuple(modules)
        return cls(**kwargs)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Layout)}


def _check_recompute_modules(modules: tuple[str, ...], recompute: str) -> None:
    """Layout's rule for recompute_modules: known names, no repeats, only under recompute "selective"."""
    if not isinstance(modules, tuple) or not all(isinstance(m, str) for m in modules):
        raise PlanError(f"layout: recompute_modules must be a tuple of module names, got {modules!r}")
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown:
        raise PlanError(f"layout: unknown recompute_modules {unknown}; Megatron-Core's are "
                        f"{', '.join(RECOMPUTE_MODULES)}")
    if len(set(modules)) != len(modules):
        raise PlanError(f"layout: recompute_modules {list(modules)} names a module twice")
    if modules and recompute != "selective":
        raise PlanError(f"layout: recompute_modules {list(modules)} apply to recompute 'selective', got {recompute!r}")


def selective_modules(layout: Layout) -> tuple[str, ...]:
    """The modules recomputation redoes in the backward under recompute "selective" (Megatron-Core's list,
    its default ["core_attn"] when none is named); () under any other kind."""
    if layout.recompute != "selective":
        return ()
    return layout.recompute_modules or SELECTIVE_DEFAULT_MODULES


def recompute_label(layout: Layout) -> str:
    """How tables name a layout's recomputation: the kind, "full:N" for N layers per chunk, or the named
    modules of a selective one ("selective:layernorm+moe_act")."""
    if layout.recompute_layers:
        return f"{layout.recompute}:{layout.recompute_layers}"
    if layout.recompute_modules:
        return f"{layout.recompute}:{'+'.join(layout.recompute_modules)}"
    return layout.recompute


def recompute_fields(kind: str, recompute_layers: int, modules: tuple[str, ...]) -> dict[str, Any]:
    """Layout fields of one recompute level of a search: `modules` (the pinned --recompute-modules) ride only
    on the selective level."""
    return {"recompute": kind, "recompute_layers": recompute_layers,
            "recompute_modules": modules if kind == "selective" else ()}


def recomputed_fraction(layout: Layout, n_layers: int) -> float:
    """Share of a chunk's layers whose forward is redone under full recomputation (1.0: all, 0.0: not full).

    Partial recomputation (recompute_layers = N) redoes the first N layers of
    each chunk of ceil(n_layers / (pp * virtual_stages)) layers.
    """
    return recomputed_share(layout.recompute, layout.recompute_layers, n_layers, layout.pp * layout.virtual_stages)


def recomputed_share(kind: str, recompute_layers: int, n_layers: int, chunks: int) -> float:
    """recomputed_fraction from its parts (the search's bound asks without building a Layout)."""
    if kind != "full":
        return 0.0
    if recompute_layers == 0:
        return 1.0
    chunk = -(-n_layers // chunks)
    return min(recompute_layers, chunk) / chunk


def partial_recompute_options(n_layers: int, pp: int, virtual_stages: int) -> tuple[int, ...]:
    """recompute_layers the search tries: about a quarter, half and three quarters of a chunk."""
    chunk = -(-n_layers // (pp * virtual_stages))
    return tuple(sorted({n for n in (chunk // 4, chunk // 2, 3 * chunk // 4) if 1 <= n < chunk}))


def divisors(n: int) -> tuple[int, ...]:
    """All divisors of n, ascending (the degrees an axis of n ranks can take)."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def balanced_layers(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """Split n_layers over n_stages as evenly as possible, extra layers on middle stages.

    The first stage also holds the embedding and the last the output layer, so
    when the split is uneven the spare layers go to the stages in between.
    """
    if n_stages > n_layers:
        raise PlanError(f"cannot split {n_layers} layers over {n_stages} pipeline stages: pp * virtual_stages > layers")
    base, extra = divmod(n_layers, n_stages)
    counts = [base] * n_stages
    order = list(range(1, n_stages - 1)) + [0, n_stages - 1] if n_stages > 2 else list(range(n_stages))
    for i in order[:extra]:
        counts[i] += 1
    return tuple(counts)


@lru_cache(maxsize=4096)
def rank_chunks(schedule: str, pp: int, virtual_stages: int, rank: int) -> tuple[int, ...]:
    """Model chunks (pipeline stages, 0-based in model order) that pipeline rank `rank` holds, in execution order.

    1f1b / gpipe: r; interleaved-1f1b: r, r + pp, ..., r + (v-1)*pp (looped);
    zb-v, dualpipev: r and 2*pp - 1 - r (the V shape: rank 0 holds the first and the last
    chunk). The memory model, the simulator and the executor's stage builder
    all ask this one function.
    """
    if schedule in V_SCHEDULES:
        return (rank, 2 * pp - 1 - rank)
    return tuple(rank + i * pp for i in range(virtual_stages))


def stage_ranges(layers_per_stage: tuple[int, ...]) -> tuple[range, ...]:
    """Transformer layer indices of every (virtual) pipeline stage, in model order.

    Stage s owns layers [sum(lps[:s]), sum(lps[:s+1])); the first stage also
    owns the embedding, the last the final norm and output layer.
    """
    out, start = [], 0
    for count in layers_per_stage:
        out.append(range(start, start + count))
        start += count
    return tuple(out)


# ---- the rank grid ---------------------------------------------------------


@lru_cache(maxsize=4096)
def axis_groups(shape: tuple[int, ...], axes: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Groups of global ranks that communicate along `axes` (one or more mesh axes).

    `shape` is the mesh shape in MESH_AXES order. Ranks are laid out row-major
    (tp fastest), so rank = ((((pp*R + r)*S + s)*C + c)*T + t). A group is
    every rank that differs only in the coordinates of `axes`; several axes
    are flattened in mesh order (("dp_replicate", "dp_shard") is the full DP
    group). Returns the groups in order of their smallest rank.
    """
    import numpy as np

    if len(shape) != len(MESH_AXES):
        raise PlanError(f"mesh shape {shape} must have one size per axis {MESH_AXES}")
    unknown = [a for a in axes if a not in MESH_AXES]
    if unknown:
        raise PlanError(f"unknown mesh axes {unknown}; known: {MESH_AXES}")
    grid = np.arange(int(np.prod(shape))).reshape(shape)
    picked = [MESH_AXES.index(a) for a in MESH_AXES if a in axes]
    rest = [i for i in range(len(MESH_AXES)) if i not in picked]
    size = int(np.prod([shape[i] for i in picked])) if picked else 1
    rows = grid.transpose(rest + picked).reshape(-1, size)
    return tuple(tuple(int(r) for r in row) for row in rows)


def rank_coords(shape: tuple[int, ...], rank: int) -> dict[str, int]:
    """Coordinates of a global rank on each mesh axis."""
    coords = {}
    for axis, size in zip(reversed(MESH_AXES), reversed(shape), strict=True):
        coords[axis] = rank % size
        rank //= size
    return {a: coords[a] for a in MESH_AXES}


# ---- the expert grid (module docstring) ------------------------------------


@lru_cache(maxsize=4096)
def expert_group_offsets(ep: int, etp: int, kind: str) -> tuple[int, ...]:
    """Offsets of one expert group from its first rank: "ep" (stride etp) or "etp" (consecutive)."""
    if kind == "ep":
        return tuple(e * etp for e in range(ep))
    if kind == "etp":
        return tuple(range(etp))
    raise PlanError(f"expert group kind must be 'ep' or 'etp', got {kind!r}")


def expert_groups(shape: tuple[int, ...], ep: int, etp: int, kind: str = "ep") -> tuple[tuple[int, ...], ...]:
    """Every expert-parallel ("ep") or expert-tensor-parallel ("etp") group of global ranks.

    `shape` is the mesh shape in MESH_AXES order; (dp_shard, cp, tp) are its
    innermost axes, so the ranks of one stage's replica are `inner`
    consecutive global ranks, which the expert grid regroups.
    """
    if len(shape) != len(MESH_AXES):
        raise PlanError(f"mesh shape {shape} must have one size per axis {MESH_AXES}")
    pp, replicate, shard, cp, tp = shape
    inner = shard * cp * tp
    if inner % (ep * etp):
        raise PlanError(f"ep ({ep}) * etp ({etp}) must divide dp_shard * cp * tp ({inner})")
    offsets = expert_group_offsets(ep, etp, kind)
    block = ep * etp
    bases = [o * inner + b * block + (u if kind == "ep" else e * etp)
             for o in range(pp * replicate) for b in range(inner // block)
             for u in (range(etp) if kind == "ep" else [0]) for e in (range(ep) if kind == "etp" else [0])]
    return tuple(tuple(base + off for off in offsets) for base in sorted(bases))

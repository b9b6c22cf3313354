"""Families of shapes, bounded before they are built: how the search skips most of a large space.

On 16,384 GPUs a 1T model has about 15,000 shapes (a MoE model over 100,000,
with ep and etp), and building each one's Layout and pricing its gradient
reduction is most of a search. A *family* is one `ShapeGroup` (mesh pp x dp x
cp x tp and sequence parallelism) with one pipeline schedule; its *members*
are the group's splits (dp_replicate, dp_shard, ZeRO, ep, etp). Branch-and-bound
(planner.search.search) then works on three levels, each bound never above the
ones below it, so expanding in bound order finds exactly what bounding every
candidate would (and pops the candidates in the same order):

1. family x micro-batch: `StepBound.relaxed` with each layer term at the
   minimum over the members (GPU time over their expert grids, FSDP
   collectives, expert all-to-alls) and every rank's tail at 0;
2. member x micro-batch: the same with the member's own layer terms, still
   no Layout built;
3. candidate: the shape's Layout and full bound (`StepBound.for_shape`).

The engine's refusals are asked of a shape when it is built; the bounds of
levels 1 and 2 cover refused members too, which keeps them lower bounds. So
the shapes a search never built are counted in `SearchStats.shapes` whether
or not the engine would run them, except when nothing was found: then every
shape is asked, for the error that names the refusal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from planner.engines import get_engine
from planner.layout import Layout, divisors
from planner.memory.params import pipeline_params
from planner.memory.states import state_floor_bytes
from planner.search.bound import OVERLAPPED_SCHEDULES, ShapeBound
from planner.search.candidates import ShapeGroup, global_batch_for, pipeline_allows, shape_groups
from planner.training import TrainingSpec


@dataclass
class Shape:
    """A shape with its batch, and what memory checks learned about it."""

    layout: Layout
    training: TrainingSpec
    per_replica: int  # sequences per data-parallel replica per step
    bound: ShapeBound  # its step-time bound for any micro-batch and recompute
    state_fits: bool | None = None  # None until model_state_bytes is checked
    levels: dict[int, int] = field(default_factory=dict)  # micro-batch -> lightest fitting recompute level
    state_floors: dict | None = None  # planner.memory.floors.stage_state_floors, with the model-state check


@dataclass
class Family:
    """One schedule of a ShapeGroup: its shapes differ only in the split of dp, ZeRO and the expert grid."""

    group_index: int  # enumeration order of its group
    group: ShapeGroup
    schedule_index: int
    schedule: tuple[str, int]  # (pp_schedule, virtual_stages)
    training: TrainingSpec
    per_replica: int
    micro_batches: tuple[int, ...]  # the micro-batch sizes its schedule can run
    shapes: dict[int, Shape | None] = field(default_factory=dict)  # built on demand; None: refused after all
    states_fit: np.ndarray | None = None  # per member: False where its model states alone cannot fit (a floor)

    @property
    def members(self) -> range:
        """Indices into group.splits (the engine's refusals are asked when a member's shape is built)."""
        return range(len(self.group.splits))

    @property
    def pipeline(self) -> tuple[int, str, int]:
        return self.group.pp, self.schedule[0], self.schedule[1]

    def mesh(self, split: tuple[int, int, int, int, int]) -> tuple[int, ...]:
        """The mesh shape (pp, dp_replicate, dp_shard, cp, tp) of a split."""
        g = self.group
        return g.pp, split[0], split[1], g.cp, g.tp


def build_families(ctx, offload: str) -> list[Family]:
    """Every family whose dp can run the global batch; counts its shapes and refusals in ctx.stats.

    `ctx` is the search's context (planner.search.search._Context).
    """
    batches: dict[int, int | None] = {}

    def dp_ok(dp: int) -> bool:
        if dp not in batches:
            unit = dp * (ctx.pins.micro_batch_size or 1)
            batches[dp] = global_batch_for(dp, unit, ctx.target_batch, ctx.batch_fixed)
            ctx.stats.batch_rejected += batches[dp] is None
        return batches[dp] is not None

    engine = get_engine(ctx.engine)
    needs_pp, overlapped = engine.pipeline.needs_pp_microbatches, "dualpipev" in engine.pp_schedules
    out: list[Family] = []
    for index, group in enumerate(shape_groups(ctx.cluster.world_size, ctx.model, ctx.seq_len, ctx.pins, dp_ok,
                                               overlapped)):
        if not group.splits:
            continue
        training = ctx.training(batches[group.dp])
        per_replica = training.global_batch_size // group.dp
        pinned = ctx.pins.micro_batch_size
        for s, schedule in enumerate(group.schedules):
            probe = Layout.trusted(pp=group.pp, pp_schedule=schedule[0], virtual_stages=schedule[1])
            mbs = tuple(mb for mb in ((pinned,) if pinned else divisors(per_replica))
                        if pipeline_allows(probe, per_replica // mb, needs_pp))
            out.append(Family(index, group, s, schedule, training, per_replica, mbs))
            ctx.stats.shapes += len(group.splits)
    return out


class FamilyBounds:
    """The level-1 and level-2 bounds of the module docstring, and the shapes built on demand."""

    def __init__(self, ctx, offload: str) -> None:
        self.ctx, self.bound, self.offload = ctx, ctx.bound, offload
        self._probes: dict[tuple, Layout] = {}
        self.candidates_counted = False  # SearchStats.candidates holds every member's (set by the search)
        self._first_refusal: tuple[int, int, int] | None = None  # enumeration position of the first refused split
        self._group_terms: dict[int, _Terms] = {}  # by group index
        self._grid_sets: dict[int, tuple[tuple[int, int], ...]] = {}
        self._low_units: dict[tuple, tuple[float, float, float, float]] = {}

    def family(self, fam: Family, micro_batch_size: int, recompute: tuple[str, int]) -> float:
        """Level 1: never above `members` for any member of `fam` (per token)."""
        g, grids = fam.group, self._grids(fam)
        key = (g.tp, g.cp, g.sequence_parallel, grids, micro_batch_size, recompute,
               *(fam.pipeline if recompute[1] else ()))
        low = self._low_units.get(key)
        if low is None:
            units = [self._unit(fam, grid, micro_batch_size, recompute) for grid in grids]
            scales = [self.bound.host_scale(self._probe(fam, grid, recompute), fam.training) for grid in grids]
            low = self._low_units[key] = (tuple(min(u[i] for u in units) for i in range(4)),
                                          tuple(min(h[i] for h in scales) for i in range(2)))
        return self._relaxed(fam, low[0], (0.0, 0.0), 0.0, low[1], micro_batch_size, recompute)

    def _grids(self, fam: Family) -> tuple[tuple[int, int], ...]:
        """The distinct expert grids (ep, etp) of the group's splits."""
        key = fam.group_index
        hit = self._grid_sets.get(key)
        if hit is None:
            hit = self._grid_sets[key] = tuple(dict.fromkeys((split[3], split[4]) for split in fam.group.splits))
        return hit

    def members(self, fam: Family, micro_batch_size: int, recompute: tuple[str, int]) -> np.ndarray:
        """Level 2, for every member of `fam` at once: never above the bound of its shape (per token)."""
        terms = self._terms(fam)
        units = np.array([self._unit(fam, grid, micro_batch_size, recompute) for grid in terms.grids])[terms.grid]
        scales = np.array([self.bound.host_scale(self._probe(fam, grid, recompute), fam.training)
                           for grid in terms.grids])[terms.grid]
        expert_s = terms.expert_s * 0.0 if fam.schedule[0] in OVERLAPPED_SCHEDULES else terms.expert_s
        return self._relaxed(fam, tuple(units.T), (terms.ag, terms.ag_rs), expert_s, tuple(scales.T),
                             micro_batch_size, recompute, np.maximum)

    def states_may_fit(self, fam: Family) -> np.ndarray:
        """Per member of `fam`: False where a floor of its model states (planner.memory.states.state_floor_bytes,
        never above `stage_state_floors`' totals) plus the fixed overhead exceeds the capacity, so that no
        micro-batch or recomputation can make it fit; such members need no Layout, bound or memory check.

        A stage's dense parameters do not depend on the expert grid and its routed experts are split by ep x
        etp (planner.memory.params), so every member is priced on the stages of one grid (ep = etp = 1): each
        stage's routed experts over ep x etp, less one parameter per layer that layer_kind_params' rounding
        may have added."""
        if fam.states_fit is None:
            ctx, g = self.ctx, fam.group
            splits = np.array(g.splits, dtype=np.int64).reshape(-1, 5)
            _, shard, zero, ep, etp = splits.T
            grid = (ep * etp).astype(np.float64)
            whole = g.layout(g.splits[0], fam.schedule, self.offload).trusted_replace(ep=1, etp=1)
            need = np.zeros(len(splits))
            for sp in {id(sp): sp for sp in pipeline_params(ctx.model, whole, ctx.engine)}.values():
                experts = np.maximum(0.0, sp.experts / grid - (sp.layers + ctx.model.mtp_layers)) if sp.experts \
                    else np.zeros(len(splits))
                states, grads = state_floor_bytes(get_engine(ctx.engine), fam.training, sp.dense, experts, zero,
                                                  shard * g.cp, shard, shard * g.cp * g.tp // (ep * etp), ep,
                                                  self.offload)
                need = np.maximum(need, states + grads)
            fam.states_fit = need + ctx.other_bytes <= ctx.capacity_bytes
        return fam.states_fit

    def ask_refusals(self, families: list[Family]) -> None:
        """The engine's refusal of every shape not built yet, for the counts and the reason of an empty search."""
        ctx = self.ctx
        engine = get_engine(ctx.engine)
        for fam in families:
            for j in fam.members:
                if j not in fam.shapes:
                    layout = fam.group.layout(fam.group.splits[j], fam.schedule, self.offload)
                    refusal = engine.refusal(ctx.model, layout, ctx.dtype, ctx.on_gpu, fam.training)
                    if refusal:
                        self._refused(fam, (fam.group_index, j, fam.schedule_index), refusal)
                        fam.shapes[j] = None

    def _refused(self, fam: Family, position: tuple[int, int, int], refusal: str) -> None:
        """Count one shape of `fam` (and its candidates) as refused instead of searched; keep the reason of the
        first refused shape in enumeration order (every shape's, when nothing was accepted)."""
        stats = self.ctx.stats
        stats.shapes -= 1
        if self.candidates_counted:
            stats.candidates -= len(fam.micro_batches)
        stats.unsupported += 1
        if self._first_refusal is None or position < self._first_refusal:
            self._first_refusal, stats.unsupported_reason = position, refusal

    def shape(self, fam: Family, j: int) -> Shape | None:
        """Level 3: member j's Shape, built once; None if the engine refuses it."""
        if j not in fam.shapes:
            ctx = self.ctx
            layout = fam.group.layout(fam.group.splits[j], fam.schedule, self.offload)
            refusal = get_engine(ctx.engine).refusal(ctx.model, layout, ctx.dtype, ctx.on_gpu, fam.training)
            if refusal:  # the plan must run on our executor (planner.engines)
                self._refused(fam, (fam.group_index, j, fam.schedule_index), refusal)
                fam.shapes[j] = None
            else:
                fam.shapes[j] = Shape(layout, fam.training, fam.per_replica, self.bound.for_shape(layout, fam.training))
        return fam.shapes[j]

    # ---- pieces ----------------------------------------------------------

    def _relaxed(self, fam: Family, units: tuple, fsdp: tuple, expert_s, host_scale: tuple, micro_batch_size: int,
                 recompute: tuple[str, int], maximum: Callable = max):
        g = fam.group
        seconds = self.bound.relaxed(units, fsdp, expert_s, host_scale, fam.training, micro_batch_size, recompute,
                                     fam.pipeline, g.tp, g.cp, fam.per_replica, maximum)
        return seconds / fam.training.tokens_per_step

    def _unit(self, fam: Family, grid: tuple[int, int], micro_batch_size: int,
              recompute: tuple[str, int]) -> tuple[float, float, float, float]:
        """StepBound.unit of a member with expert grid (ep, etp), asked on a probe layout with the same unit key."""
        return self.bound.unit(self._probe(fam, grid, recompute), fam.training, micro_batch_size, recompute)

    def _probe(self, fam: Family, grid: tuple[int, int], recompute: tuple[str, int]) -> Layout:
        """A layout with what StepBound.unit and host_scale read of a member with expert grid (ep, etp): tp, cp,
        sequence parallelism, the expert grid, its recompute ("none", as every shape's), and the pipeline when
        partial recomputation makes the unit depend on it."""
        g, (ep, etp) = fam.group, grid
        key = (g.tp, g.cp, g.sequence_parallel, ep, etp, *(fam.pipeline if recompute[1] else ()))
        probe = self._probes.get(key)
        if probe is None:
            pp, schedule, v = fam.pipeline if recompute[1] else (1, "1f1b", 1)
            probe = self._probes[key] = Layout.trusted(tp=g.tp, pp=pp, dp_shard=ep * etp, cp=g.cp, ep=ep, etp=etp,
                                                       zero_stage=1 if ep * etp > 1 else 0,
                                                       sequence_parallel=g.sequence_parallel, pp_schedule=schedule,
                                                       virtual_stages=v)
        return probe

    def _terms(self, fam: Family) -> _Terms:
        """The members' layer terms that do not depend on the micro-batch, as arrays (shared by a group's schedules)."""
        key = fam.group_index
        hit = self._group_terms.get(key)
        if hit is None:
            grids: dict[tuple[int, int], int] = {}
            experts: dict[tuple, float] = {}  # the ZeRO stages of a split share it
            rows = []
            for j in fam.members:
                split = fam.group.splits[j]
                replicate, shard, zero, ep, etp = split
                mesh = fam.mesh(split)
                expert_s = experts.get((replicate, shard, ep, etp))
                if expert_s is None:
                    expert_s = experts[replicate, shard, ep, etp] = self.bound.expert(mesh, ep, etp, fam.training)
                fsdp = self.bound.fsdp(zero, ep, etp, mesh, fam.training) if zero >= 2 else (0.0, 0.0)
                rows.append((grids.setdefault((ep, etp), len(grids)), *fsdp, expert_s))
            table = np.array(rows, dtype=np.float64).reshape(-1, 4)
            hit = self._group_terms[key] = _Terms(tuple(grids), table[:, 0].astype(np.int64), table[:, 1],
                                                  table[:, 2], table[:, 3])
        return hit


@dataclass(frozen=True)
class _Terms:
    """Per member of a family: index into `grids` (its (ep, etp)), FSDP all-gather, all-gather + reduce-scatter,
    expert communication."""

    grids: tuple[tuple[int, int], ...]
    grid: np.ndarray
    ag: np.ndarray
    ag_rs: np.ndarray
    expert_s: np.ndarray

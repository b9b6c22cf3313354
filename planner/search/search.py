"""Layout search: enumerate candidates, prune what does not fit, branch-and-bound on step time.

Order of work, cheapest test first (the rules themselves are in planner.search.candidates):

1. shapes: mesh degrees, ZeRO, SP, schedule (planner.search.candidates.shapes),
   each with the global batch its dp runs and its micro-batch sizes, grouped in
   families that share mesh, SP and schedule (planner.search.families) and are
   bounded before any of their Layouts is built;
2. model state (params + grads + optimizer on the worst stage,
   `planner.memory.states.model_state_bytes`) plus the fixed overhead must fit: otherwise no
   micro-batch or recomputation can save the shape;
3. leaves: a micro-batch with the lightest recomputation that fits (memory
   never falls as the micro-batch grows, so what failed at a smaller
   micro-batch is not tried again at a larger one);
4. branch-and-bound: every (shape, micro-batch) gets a lower bound of its
   step time (`planner.search.bound.StepBound`: `planner.simulate.step.compute_lower_bound_s`
   is the same for almost every layout of a search, this one prices shapes, TP, FSDP,
   the pipeline bubble and the DP tail, typically within a few % of the
   simulated time); they are expanded in order of that bound, so memory is checked
   and the simulator run only for candidates that could still enter the top
   k, and the search stops when the next bound cannot beat the k-th best.
   Families and their members enter the same queue with bounds below their
   candidates', so candidates are popped in the order a queue of all of them
   would pop them (the same answer), while most are never built.

Ranking is by step time per token, which is step time whenever every layout
runs the same global batch (always, when --global-batch is given; by default
a layout whose dp does not divide ~1M tokens rounds the batch, see
`candidates.global_batch_for`). Ties go to the layout with less memory.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from planner.engines import get_engine
from planner.layout import Layout, partial_recompute_options, recompute_fields
from planner.memory.estimate import default_other_bytes
from planner.memory.floors import peak_floor_bytes, stage_state_floors
from planner.memory.states import model_states
from planner.model.spec import ModelSpec
from planner.plan import with_stage_layers
from planner.search.bound import StepBound
from planner.search.candidates import Pins, offload_options, recompute_options
from planner.search.families import Family, FamilyBounds, Shape, build_families
from planner.simulate.calibration import CalibrationProfile, load_calibration
from planner.simulate.offload import host_refusal, host_stated
from planner.simulate.step import StepResult, simulate_step, step_memory
from planner.training import TrainingSpec, default_global_batch
from topologies.cluster import Cluster
from topologies.errors import UsageError

# A plan keeps 5% of GPU memory free on top of the memory model's fixed
# overhead (`other`): the model is an estimate, and running out of memory
# costs a crashed job while 5% less memory costs at most a smaller
# micro-batch or more recomputation. `meshplan validate-memory` measures it.
USABLE_MEMORY_FRACTION = 0.95


@dataclass(frozen=True)
class Scored:
    """One simulated layout."""

    layout: Layout  # layers_per_stage filled in
    training: TrainingSpec  # its global batch (may differ from the target, see module doc)
    result: StepResult

    @property
    def seconds_per_token(self) -> float:
        return self.result.step_time_s / self.training.tokens_per_step

    @property
    def key(self) -> tuple[float, int]:
        """Rank key: time per token (9 significant digits, so equal times tie), then memory."""
        return float(f"{self.seconds_per_token:.9g}"), self.result.memory.peak_bytes


@dataclass(frozen=True)
class NearMiss:
    """The candidate that came closest to fitting, for the infeasibility message."""

    layout: Layout
    needed_bytes: int
    capacity_bytes: int
    what: str  # "model state" or "peak memory"
    usable_fraction: float = USABLE_MEMORY_FRACTION  # of the GPU's memory, from --memory-headroom


@dataclass
class SearchStats:
    # shapes whose dp can run the global batch, less those the engine refuses (asked of the shapes the
    # search built; of all of them when it found nothing)
    shapes: int = 0
    batch_rejected: int = 0  # data-parallel degrees that cannot run it
    state_pruned: int = 0  # shapes whose model state alone does not fit
    candidates: int = 0  # (shape, micro-batch) pairs given a bound
    memory_checks: int = 0
    floor_pruned: int = 0  # memory checks a floor of the peak answered (planner.memory.floors.peak_floor_bytes)
    host_pruned: int = 0  # offloading shapes whose host state does not fit the node's RAM
    host_reason: str = ""  # the first such shape's figures (planner.simulate.offload.host_refusal)
    simulated: int = 0
    bound_pruned: int = 0  # candidates never looked at again thanks to the bound
    unsupported: int = 0  # shapes meshplan's executor cannot run (engine meshplan only)
    unsupported_reason: str = ""  # the first such refusal, for the error when nothing is left
    simulate_s: float = 0.0  # time spent in simulate_step
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class SearchResult:
    ranked: tuple[Scored, ...]  # best first, at most top_k
    target_batch: int  # the global batch asked for (or the ~1M-token default)
    batch_fixed: bool  # True when the user gave --global-batch
    stats: SearchStats
    near_miss: NearMiss | None = None
    # what the ranked layouts were simulated with, so an explanation can simulate a suggested change alike
    calibration: CalibrationProfile | None = None
    engine: str = "meshplan"
    usable_fraction: float = USABLE_MEMORY_FRACTION

    @property
    def best(self) -> Scored:
        return self.ranked[0]


@dataclass
class _Context:
    """Everything fixed during one search, with the per-batch TrainingSpec cache."""

    model: ModelSpec
    cluster: Cluster
    seq_len: int
    target_batch: int
    batch_fixed: bool
    pins: Pins
    engine: str
    calibration: CalibrationProfile
    bound: StepBound
    usable_fraction: float = USABLE_MEMORY_FRACTION
    precision: str = "bf16"  # how block GEMMs run (TrainingSpec.precision); given, never searched
    attention: str = ""  # fused | eager | "" (the engine's)
    compile: bool = False
    async_tp: bool = False  # TrainingSpec.async_tp: given, never searched
    recipe: dict[str, bool] = field(default_factory=dict)  # TrainingSpec's recipe options (plan --recipe)
    stats: SearchStats = field(default_factory=SearchStats)
    near_miss: NearMiss | None = None
    # True: every memory check that fails is made in full and kept as a miss, so that `near_miss` is the
    # closest layout of all (what an infeasible search reports); False, the first pass: layouts that
    # a floor shows cannot fit are dropped unmeasured (they cannot change what fits, nor the ranking)
    exact_misses: bool = False
    _trainings: dict[int, TrainingSpec] = field(default_factory=dict)

    @property
    def capacity_bytes(self) -> int:
        """What a plan may use: usable_fraction (default USABLE_MEMORY_FRACTION) of the GPU's memory."""
        return int(self.cluster.gpu.memory_bytes * self.usable_fraction)

    @property
    def other_bytes(self) -> int:
        """Fixed overhead per GPU: the calibration's, else the memory model's default."""
        measured = self.calibration.other_bytes
        return default_other_bytes(self.cluster.gpu) if measured is None else measured

    @property
    def on_gpu(self) -> bool:
        return self.cluster.gpu.kind != "cpu"

    @property
    def dtype(self) -> str:
        """bf16 on GPUs (also under fp8/mxfp8 GEMMs); fp32 on CPU ranks, which compute in fp32 whatever a plan says."""
        if not self.on_gpu:
            return "fp32"
        return self.precision if self.precision in ("fp16", "fp32") else "bf16"

    def training(self, batch: int) -> TrainingSpec:
        if batch not in self._trainings:
            precision = self.precision if self.on_gpu else "fp32"
            self._trainings[batch] = TrainingSpec(seq_len=self.seq_len, global_batch_size=batch, dtype=self.dtype,
                                                  precision=precision, attention=self.attention,
                                                  compile=self.compile, async_tp=self.async_tp, **self.recipe)
        return self._trainings[batch]

    def recompute_kinds(self) -> tuple[str, ...]:
        """The pinned or searched recompute kinds this engine implements, lightest first."""
        kinds = get_engine(self.engine).recompute_kinds
        return tuple(r for r in recompute_options(self.pins) if r in kinds)

    def miss(self, layout: Layout, needed: int, what: str) -> None:
        if self.near_miss is None or needed < self.near_miss.needed_bytes:
            self.near_miss = NearMiss(layout, needed, self.capacity_bytes, what, self.usable_fraction)


def search(model: ModelSpec, cluster: Cluster, seq_len: int, global_batch: int | None = None,
           pins: Pins | None = None, engine: str = "meshplan", calibration: CalibrationProfile | None = None,
           top_k: int = 5, usable_memory_fraction: float = USABLE_MEMORY_FRACTION, precision: str = "bf16",
           attention: str = "", compile: bool = False, async_tp: bool = False,
           recipe: dict[str, bool] | None = None) -> SearchResult:
    """The top_k layouts for training `model` on `cluster`, best first.

    Returns an empty `ranked` when nothing fits (the caller turns `near_miss`
    into an InfeasibleError) or when no layout satisfies the pins and batch
    (`stats.shapes` is 0; `stats.batch_rejected` > 0 when the batch is why).
    `usable_memory_fraction` is `plan --memory-headroom` (1 - PCT/100).
    """
    started = time.perf_counter()
    calibration = calibration or load_calibration(None, cluster.gpu)
    ctx = _Context(model=model, cluster=cluster, seq_len=seq_len,
                   target_batch=global_batch or default_global_batch(seq_len, cluster.gpu.kind != "cpu"), batch_fixed=global_batch is not None,
                   pins=pins or Pins(), engine=engine, calibration=calibration,
                   bound=StepBound(model, cluster, calibration, engine,
                                   (pins.recompute_modules or ()) if pins else ()),
                   usable_fraction=usable_memory_fraction,
                   precision=precision, attention=attention, compile=compile, async_tp=async_tp,
                   recipe=dict(recipe or {}))
    if ctx.pins.offload not in (None, "none", "auto") and host_stated(cluster):
        raise UsageError(host_stated(cluster))
    offloads = offload_options(ctx.pins, get_engine(engine).offload_kinds, host_stated(cluster) is None)
    ranked, searched = _search_offloads(ctx, offloads, top_k)
    if not ranked and ctx.stats.shapes:  # again, measuring every miss: the closest layout the error names
        ctx = dataclasses.replace(ctx, stats=SearchStats(), near_miss=None, exact_misses=True, _trainings={})
        ranked, searched = _search_offloads(ctx, offloads, top_k)
    if not ranked:  # the counts and the refusals the error names, of the final pass only
        for families, bounds in searched:
            bounds.ask_refusals(families)
    ctx.stats.elapsed_s = time.perf_counter() - started
    return SearchResult(tuple(ranked), ctx.target_batch, ctx.batch_fixed, ctx.stats, ctx.near_miss, calibration,
                        engine, usable_memory_fraction)


def _bound(sh: Shape, mb: int, recompute: tuple[str, int]) -> float:
    """Lower bound of the step time per token."""
    return sh.bound.seconds(mb, recompute) / sh.training.tokens_per_step


# queue entries: (bound per token, order, what, item); `order` breaks ties so that families and members
# come before candidates of the same bound, and candidates keep the order of the full enumeration
_FAMILY, _MEMBER, _CANDIDATE = 0, 1, 2


def _search_offloads(ctx: _Context, offloads: tuple[str, ...], top_k: int
                     ) -> tuple[list[Scored], list[tuple[list[Family], FamilyBounds]]]:
    """The best top_k over every offload level searched, and each level's families and bounds."""
    ranked: list[Scored] = []
    searched = []
    for offload in offloads:
        families, bounds = build_families(ctx, offload), FamilyBounds(ctx, offload)
        searched.append((families, bounds))
        ranked = sorted([*ranked, *_branch_and_bound(ctx, families, bounds, top_k)], key=lambda s: s.key)[:top_k]
    return ranked, searched


def _branch_and_bound(ctx: _Context, families: list[Family], bounds: FamilyBounds, top_k: int) -> list[Scored]:
    """Expand (shape, micro-batch) candidates in order of their bound until none can enter the top k.

    Families and their members (planner.search.families) enter the queue with
    bounds below those of their candidates, and are expanded only when
    popped, so candidates reach the queue in time to be popped in the order a
    queue of every candidate would pop them. A candidate is (shape, micro-batch,
    recompute level, fits); one not yet known to fit is memory-checked
    when popped; if it needs heavier recomputation than its bound assumed, it
    goes back with the bound of that recomputation.
    """
    recomputes = ctx.recompute_kinds()
    if not recomputes or get_engine(ctx.engine).model_refusal(ctx.model):  # a module the engine does not build
        return []
    partial = get_engine(ctx.engine).partial_recompute and ctx.pins.recompute is None and "full" in recomputes
    by_pipeline: dict[tuple[int, int], tuple[tuple[str, int], ...]] = {}

    def levels_of(pp: int, v: int) -> tuple[tuple[str, int], ...]:
        """(kind, recompute_layers) from lightest to heaviest; partial full recomputation before full."""
        key = (pp, v)
        if key not in by_pipeline:
            extra = partial_recompute_options(ctx.model.n_layers, *key) if partial else ()
            by_pipeline[key] = tuple(lv for kind in recomputes for lv in (
                [("full", n) for n in extra] + [("full", 0)] if kind == "full" else [(kind, 0)]))
        return by_pipeline[key]

    ctx.stats.candidates += sum(len(fam.members) * len(fam.micro_batches) for fam in families)
    bounds.candidates_counted = True
    queue = [(bounds.family(fam, mb, levels_of(fam.group.pp, fam.schedule[1])[0]), (-1, k), _FAMILY, (fam, mb))
             for k, (fam, mb) in enumerate((fam, mb) for fam in families for mb in fam.micro_batches)]
    heapq.heapify(queue)
    best: list[Scored] = []  # sorted by key, at most top_k
    serial = len(queue)  # tie-breaker of families, members and candidates that went back
    popped = pushed_back = 0  # candidates, for the count of those the bound pruned
    while queue:
        bound, _, what, item = heapq.heappop(queue)
        if len(best) == top_k and bound > best[-1].seconds_per_token:
            ctx.stats.bound_pruned += ctx.stats.candidates - popped + pushed_back
            break
        if what == _FAMILY:
            fam, mb = item
            if not fam.members:
                continue
            # its members in bound order behind one queue entry (a cursor), which holds the next one's bound
            member_bounds = bounds.members(fam, mb, levels_of(fam.group.pp, fam.schedule[1])[0])
            order = np.argsort(member_bounds, kind="stable")
            if not ctx.exact_misses:  # members whose model states cannot fit are never built
                order = order[bounds.states_may_fit(fam)[order]]
                if not len(order):
                    continue
            serial += 1
            heapq.heappush(queue, (float(member_bounds[order[0]]), (-1, serial), _MEMBER,
                                   (fam, mb, order.tolist(), member_bounds[order].tolist(), 0)))
            continue
        if what == _MEMBER:
            fam, mb, order, values, at = item
            if at + 1 < len(order):
                serial += 1
                heapq.heappush(queue, (values[at + 1], (-1, serial), _MEMBER, (fam, mb, order, values, at + 1)))
            sh = bounds.shape(fam, order[at])
            if sh is not None:
                position = (0, (fam.group_index, order[at], fam.schedule_index, mb))
                heapq.heappush(queue, (_bound(sh, mb, levels_of(fam.group.pp, fam.schedule[1])[0]), position,
                                       _CANDIDATE, (sh, mb, 0, False)))
            continue
        popped += 1
        sh, mb, level, fits = item
        levels = levels_of(sh.layout.pp, sh.layout.virtual_stages)
        if not fits:
            found = _lightest_fit(ctx, sh, mb, level, levels)
            if found is None:
                continue
            if found != level:
                serial += 1
                pushed_back += 1
                heapq.heappush(queue, (_bound(sh, mb, levels[found]), (1, serial), _CANDIDATE, (sh, mb, found, True)))
                continue
        layout = with_stage_layers(ctx.model, sh.layout.trusted_replace(
            micro_batch_size=mb, grad_accum_steps=sh.per_replica // mb,
            **recompute_fields(*levels[level], ctx.pins.recompute_modules or ())))
        tick = time.perf_counter()
        result = simulate_step(ctx.model, sh.training, layout, ctx.cluster, ctx.calibration, engine=ctx.engine)
        ctx.stats.simulate_s += time.perf_counter() - tick
        ctx.stats.simulated += 1
        best.append(Scored(layout, sh.training, result))
        best.sort(key=lambda s: s.key)
        del best[top_k:]
    return best


def _lightest_fit(ctx: _Context, sh: Shape, mb: int, level: int,
                  recomputes: tuple[tuple[str, int], ...]) -> int | None:
    """The lightest recompute level >= `level` whose memory fits at this micro-batch, or None (R8, R9)."""
    if sh.state_fits is None:  # the model states alone (planner.memory.states.model_state_bytes)
        sh.state_floors = stage_state_floors(ctx.model, sh.training, sh.layout, ctx.engine)
        state = max(total for _, _, total in sh.state_floors.values()) + ctx.other_bytes
        sh.state_fits = state <= ctx.capacity_bytes
        if not sh.state_fits:
            ctx.stats.state_pruned += 1
            ctx.miss(sh.layout, state, "model state")
        if sh.state_fits and sh.layout.offload != "none":  # the offloaded state must fit the node's RAM
            host = host_refusal(model_states(ctx.model, sh.training, sh.layout, ctx.engine).host, ctx.cluster)
            if host:
                sh.state_fits = False
                ctx.stats.host_pruned += 1
                ctx.stats.host_reason = ctx.stats.host_reason or host
    if not sh.state_fits:
        return None
    smaller = [lv for m, lv in sh.levels.items() if m < mb]
    level = max([level, *smaller])
    while level < len(recomputes):
        layout = with_stage_layers(ctx.model, sh.layout.trusted_replace(
            micro_batch_size=mb, grad_accum_steps=sh.per_replica // mb,
            **recompute_fields(*recomputes[level], ctx.pins.recompute_modules or ())))
        # a floor of the peak first (planner.memory.floors.peak_floor_bytes): what cannot fit by its
        # states and kept activations alone is never estimated in full (measuring every miss, only
        # what cannot come closer than the nearest miss so far, whose figure the infeasibility message names)
        if ctx.near_miss is not None or not ctx.exact_misses:
            floor = peak_floor_bytes(ctx.model, sh.training, layout, ctx.engine, ctx.other_bytes, sh.state_floors)
            if floor > ctx.capacity_bytes and (not ctx.exact_misses or floor >= ctx.near_miss.needed_bytes):
                ctx.stats.floor_pruned += 1
                level += 1
                continue
        memory = step_memory(ctx.model, sh.training, layout, ctx.cluster, ctx.calibration, ctx.engine)
        ctx.stats.memory_checks += 1
        if memory.peak_bytes <= ctx.capacity_bytes:
            sh.levels[mb] = level
            return level
        ctx.miss(layout, memory.peak_bytes, "peak memory")
        level += 1
    sh.levels[mb] = level
    return None

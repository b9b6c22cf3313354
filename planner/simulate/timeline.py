"""One simulated step as lanes of intervals: what the Perfetto trace and the step chart both show.

Per pipeline stage, a compute lane and one lane per kind of communication the step exposes:

  compute   every F, B and W operation (its whole duration), the optimizer step, and the stage's
            idle time inside the pipeline as `bubble` (its gaps sum to the stage's bubble in
            time_breakdown_s: p2p waits included)
  TP CP EP FSDP offload
            communication inside an operation that its compute does not hide. The simulator
            knows how long, not where inside the operation: drawn at the operation's end, the
            kinds back to back in LAYER_COMM_KEYS order
  PP        activation (after F) and gradient (after B) transfers to the next chunk's rank
  DP        gradient reduction, tied-embedding sync and the parameter all-gather after the pipeline

Only the lanes some interval uses exist (`Timeline.lanes`). Times are seconds from the step's start.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.layout import Layout
from planner.simulate.events import LAYER_COMM_KEYS
from planner.simulate.pipeline import KIND_NAMES, B, F, W, chunk_owner
from planner.simulate.step import StepResult
from topologies.errors import UsageError

LANES = ("compute", "TP", "CP", "EP", "FSDP", "offload", "PP", "DP")
LANE_OF = {"tp_comm": "TP", "cp_comm": "CP", "ep_comm": "EP", "fsdp_comm": "FSDP", "offload_comm": "offload",
           "send activations": "PP", "send gradients": "PP", "dp_comm": "DP", "embedding_sync": "DP",
           "param_gather": "DP", "optimizer": "compute", "bubble": "compute", "F": "compute", "B": "compute",
           "W": "compute"}
OPERATIONS = KIND_NAMES  # F, B, W
IDLE_MIN_S = 1e-9  # gaps shorter than this are rounding, not idle time


@dataclass(frozen=True)
class Interval:
    """One drawn span: on `stage`'s `lane`, what (`kind`) from start_s to end_s."""

    stage: int
    kind: str  # an OPERATIONS letter, bubble, optimizer, a LAYER_COMM_KEYS or tail key, send activations/gradients
    start_s: float
    end_s: float
    chunk: int | None = None  # model chunk (virtual stage) of the operation it belongs to
    micro_batch: int | None = None

    @property
    def lane(self) -> str:
        return LANE_OF[self.kind]

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def is_operation(self) -> bool:
        return self.kind in OPERATIONS


@dataclass(frozen=True)
class Timeline:
    """Every interval of one step, unfolded; `planner.charts.timeline` folds it for drawing."""

    schedule: str
    pp: int
    virtual_stages: int
    micro_batches: int
    step_time_s: float
    critical_stage: int  # the stage that finishes last
    time_breakdown_s: dict[str, float]
    intervals: tuple[Interval, ...]

    @property
    def lanes(self) -> tuple[str, ...]:
        """The lanes some interval uses, compute first, in LANES order."""
        used = {i.lane for i in self.intervals}
        return tuple(lane for lane in LANES if lane in used or lane == "compute")

    def on(self, stage: int, lane: str | None = None) -> list[Interval]:
        return [i for i in self.intervals if i.stage == stage and (lane is None or i.lane == lane)]

    def bubble_s(self, stage: int) -> float:
        return sum(i.duration_s for i in self.intervals if i.stage == stage and i.kind == "bubble")


def timeline_of(result: StepResult, layout: Layout) -> Timeline:
    """The lanes of a step simulated with events (`simulate_step(..., events=True)`) of `layout`."""
    events = result.events
    if events is None:
        raise UsageError("the step was simulated without events: call simulate_step(..., events=True)")
    schedule, pp, v = layout.pp_schedule, layout.pp, layout.virtual_stages
    owner = chunk_owner(schedule, pp, v)
    n_chunks = pp * v
    out: list[Interval] = []
    for op in events.ops:
        kind = KIND_NAMES[op.kind]
        where = {"chunk": op.chunk, "micro_batch": op.micro_batch}
        out.append(Interval(op.rank, kind, op.start_s, op.end_s, **where))
        if op.kind != W:  # exposed communication, at the operation's end, kinds back to back
            comm = events.op_comm_s.get((op.kind, op.chunk), {})
            t = op.end_s - min(sum(comm.values()), op.end_s - op.start_s)
            for key in LAYER_COMM_KEYS:
                if comm.get(key, 0.0) > 0:
                    end = min(t + comm[key], op.end_s)
                    out.append(Interval(op.rank, key, t, end, **where))
                    t = end
        nxt = op.chunk + 1 if op.kind == F else op.chunk - 1
        if op.kind in (F, B) and 0 <= nxt < n_chunks and owner[nxt] != op.rank:
            lag = events.p2p_s[min(op.chunk, nxt)]
            if lag > 0:
                label = "send activations" if op.kind == F else "send gradients"
                out.append(Interval(op.rank, label, op.end_s, op.end_s + lag, **where))
    for stage in range(pp):
        out.extend(_bubbles(stage, [o for o in events.ops if o.rank == stage]))
    for stage, tail in enumerate(events.tails):
        out.extend(Interval(stage, name, start, end) for name, start, end in tail)
    out.sort(key=lambda i: (i.stage, LANES.index(i.lane), i.start_s))
    return Timeline(schedule, pp, v, layout.grad_accum_steps, result.step_time_s, result.critical_stage,
                    dict(result.time_breakdown_s), tuple(out))


def _bubbles(stage: int, ops) -> list[Interval]:
    """The stage's idle gaps from the step's start to its last operation's end."""
    gaps, t = [], 0.0
    for op in sorted(ops, key=lambda o: o.start_s):
        if op.start_s - t > IDLE_MIN_S:
            gaps.append(Interval(stage, "bubble", t, op.start_s))
        t = max(t, op.end_s)
    return gaps

